"""The decode benchmark: dense and every configuration at every k, in one process, against one budget.

What makes it fast (issue 14, item 4): one compile per (configuration, batch) — switching k copies the
new thresholds / cuts into the patched model's buffers in place (:func:`speedonly.retarget`), which the
compiled step reads from the device, so every k after the first runs on the same graph; Inductor's
caches (FX graph, Triton kernels, coordinate-descent results) live in one folder for the whole run, so
the kernels a configuration shares with dense (attention, norms, projections) are tuned once; and
speed-only artifacts (:mod:`speedonly`: random predictors, cuts fitted on the model's own decode steps,
seconds instead of minutes of calibration and training). The dense baseline is timed ``dense_samples``
times on its compiled graph and reported as min / median / max.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from countdown.bench.measure import kept_fractions, time_decode
from countdown.bench.speedonly import (SPEED_ONLY, RANDOM_KINDS, IdTokenizer, SpecUnavailable, decode_prompts,
                                       fit_cuts_on_decode, generated_texts, library_artifacts, private_copy,
                                       random_artifacts, retarget)
from countdown.spec import Spec, parse_spec

from .checks import clear_dynamo_counts, dynamo_counts
from .timing import Budget, PeakMemory, spread
from .weightbytes import model_bytes, step_weight_bytes

TIMED_PROMPT_SEED = 3


@dataclass
class DecodeSettings:
    """What :func:`decode_sweep` times. ``batch_specs``: labels also timed at batch > 1 (None: all)."""

    specs: list[Spec]
    ks: list[float] = field(default_factory=lambda: [0.9, 0.8, 0.7])
    batches: list[int] = field(default_factory=lambda: [1, 4])
    new_tokens: list[int] = field(default_factory=lambda: [512])
    prompt: int = 64
    harness: str = "compile-cdt"
    dense_samples: int = 3
    samples: int = 1
    eager_tokens: list[int] = field(default_factory=list)
    kept_steps: int = 32
    fit_rounds: int = 2
    fit_prompts: int = 8
    fit_tokens: int = 32
    budget_s: float = 480.0
    compile_estimate_s: float = 45.0
    batch_specs: list[str] | None = None
    profile: bool = False
    breakdown: bool = True


def on_device(art, device):
    """``art`` with every tensor on ``device``: selectors built from it (every ``sparsify`` and
    :func:`countdown.bench.speedonly.retarget`) then unpack and copy there, not on the host (seconds per layer at
    8B)."""
    return type(art)(art.meta, {name: t.to(device) for name, t in art.tensors.items()})


class _Artifacts:
    """Speed-only artifacts per spec, built on first use and kept for every batch."""

    def __init__(self, model, settings: DecodeSettings, log):
        self.model, self.settings, self.log = model, settings, log
        self.cache: dict[str, tuple] = {}

    def get(self, spec: Spec):
        if spec.label not in self.cache:
            start = time.perf_counter()
            s = self.settings
            vocab = self.model.config.vocab_size
            if spec.kind in RANDOM_KINDS:
                art = random_artifacts(self.model, spec, s.ks)
                how = "random predictor" if spec.kind != "threshold" else "thresholds"
            else:
                art, how = self._library(spec), "library fit on the dense model's greedy text"
            prompts = decode_prompts(vocab, s.fit_prompts, s.prompt)
            history = fit_cuts_on_decode(self.model, art, prompts, new_tokens=s.fit_tokens, rounds=s.fit_rounds)
            rank = art.meta.get("d_rank")
            label = (f"{SPEED_ONLY}: {how}{f' (rank {rank})' if rank and spec.kind != 'threshold' else ''}, "
                     f"cuts fitted on decode steps ({s.fit_rounds} rounds, {s.fit_prompts} prompts x {s.fit_tokens} tokens)")
            self.log(f"{spec.label} artifacts in {time.perf_counter() - start:.1f}s: {label}; Sparsity-Real per "
                     f"round {history}")
            self.cache[spec.label] = (art, label, history)
        return self.cache[spec.label]

    def _library(self, spec: Spec):
        s = self.settings
        texts = generated_texts(self.model, s.prompt, 2048, s.fit_prompts)
        return library_artifacts(self.model, spec, s.ks, texts, IdTokenizer(), num_tokens=2048)


def decode_sweep(model, settings: DecodeSettings, meta: dict, log=print, checkpoint=None) -> list[dict]:
    """Time dense and every spec of ``settings`` on ``model`` (on CUDA with the compiled harness, on
    CPU eager); returns the rows (``harness.report.DECODE_COLUMNS``) and fills ``meta`` with
    ``skipped`` (spec -> reason), ``dense_spread``, ``breakdown`` and ``profiles``. ``checkpoint(rows)``,
    if given, is called after every configuration (e.g. to write the report so far)."""
    from countdown.decode.generate import reset_decoders
    from countdown.patch.sparsify import sparsify, unsparsify, with_mode

    s = settings
    budget = Budget(s.budget_s)
    cuda = next(model.parameters()).device.type == "cuda"
    harness = s.harness if cuda else "eager"
    copy_bps = meta.get("copy_gbps", float("nan")) * 1e9
    max_cache_len = s.prompt + max(s.new_tokens)
    arts = _Artifacts(model, s, log)
    rows: list[dict] = []
    skipped = meta.setdefault("skipped", {})
    specs = [spec.resolved() for spec in map(parse_spec, s.specs) if not spec.is_dense]
    prompt_all = torch.randint(0, model.config.vocab_size, (max(s.batches), s.prompt),
                               generator=torch.Generator().manual_seed(TIMED_PROMPT_SEED))
    prompt_all = prompt_all.to(next(model.parameters()).device)

    def add(label, spec, k, batch, n, stats_list, kept, art_label, harness_name, peak, patched_bytes, art=None):
        stats = sorted(stats_list, key=lambda st: st["tokens_per_s"])[len(stats_list) // 2]  # the median sample
        kept_token, kept_union = kept
        kept_read = kept_union if batch > 1 else kept_token
        built = {key: art.meta.get(key) for key in ("d_rank", "bits", "group")} if art is not None else {}
        opts = {key: v for key, v in {**(spec.options if spec else {}), **built}.items()
                if v is not None and key in ("d_rank", "bits", "group")}
        nbytes = step_weight_bytes(model, spec.roofline_kind if spec else "dense",
                                           1.0 if spec is None else kept_read, batch, **opts)
        gbps = nbytes / (stats["ms_per_step"] / 1e3) / 1e9
        tps = [st["tokens_per_s"] for st in stats_list]
        graphs = dynamo_counts() if harness_name.startswith("compile") else None
        row = {
            "device": meta.get("device"), "date": meta.get("date"), "run": meta.get("run"), "config": meta.get("config"),
            "method": label, "harness": harness_name, "sparsity": "" if k is None else k,
            "sparsity_real": "" if k is None else round(1 - kept_token, 4),
            "kept_union": "" if k is None else round(kept_union, 4), "batch": batch, "new_tokens": n,
            "tokens_per_s": round(stats["tokens_per_s"], 2), "decode_tokens_per_s": round(stats["decode_tokens_per_s"], 2),
            "ms_per_step": round(stats["ms_per_step"], 4), "gbps": round(gbps, 1),
            "copy_gbps": round(copy_bps / 1e9, 1), "bw_share": round(gbps * 1e9 / copy_bps, 4) if copy_bps == copy_bps else "",
            "weight_gb_per_step": round(nbytes / 1e9, 4),
            "peak_mem_gb": "" if peak is None else round(peak / 1e9, 3),
            "model_mem_gb": round(patched_bytes / 1e9, 3), "setup_s": round(stats_list[0]["setup_s"], 1),
            "graphs": "" if graphs is None else graphs["unique_graphs"],
            "graph_breaks": "" if graphs is None else graphs["graph_breaks"], "artifacts": art_label,
            "tokens_per_s_min": round(min(tps), 2), "tokens_per_s_max": round(max(tps), 2), "samples": len(tps),
        }
        rows.append(row)
        log(f"  {label:14s} {harness_name:11s} k={row['sparsity'] or '-':<4} b={batch} n={n}: "
            f"{row['tokens_per_s']:8.1f} tok/s (min {row['tokens_per_s_min']}, max {row['tokens_per_s_max']}, "
            f"{len(tps)} samples) {row['ms_per_step']:.3f} ms/step {gbps:6.0f} GB/s"
            + (f" ({100 * row['bw_share']:.0f}% of copy)" if row["bw_share"] != "" else "")
            + f" setup {row['setup_s']}s" + (f" graphs {row['graphs']} breaks {row['graph_breaks']}" if graphs else ""))
        return row

    def timed(prompt, lengths, harness_name, samples):
        out = {}
        for n in lengths:
            out[n] = [time_decode(model, prompt, n, harness_name, max_cache_len) for _ in range(samples)]
        return out

    for batch in s.batches:
        prompt = prompt_all[:batch]
        if batch == 1:
            for n in s.eager_tokens:
                with PeakMemory() as peak:
                    res = timed(prompt, [n], "eager", 1)
                add("dense", None, None, batch, n, res[n], (1.0, 1.0), "", "eager", peak.bytes, model_bytes(model))
        if budget.left() < s.compile_estimate_s + 15:
            log(f"budget: skipping dense b={batch} ({budget.left():.0f}s left)")
            continue
        clear_dynamo_counts()
        with PeakMemory() as peak:
            res = timed(prompt, s.new_tokens, harness, max(1, s.dense_samples))
        dense_rows = [add("dense", None, None, batch, n, res[n], (1.0, 1.0), "", harness, peak.bytes,
                          model_bytes(model)) for n in s.new_tokens]
        meta.setdefault("dense_spread", {})[str(batch)] = {
            str(n): spread([st["tokens_per_s"] for st in res[n]]) for n in s.new_tokens}
        if cuda and s.profile and harness != "eager":
            meta.setdefault("profiles", []).append({"method": "dense", "batch": batch,
                                                    **_safe(lambda: profile(model), log)})
        reset_decoders()
        if checkpoint is not None:
            checkpoint(rows)
        if cuda and s.breakdown:
            from .breakdown import op_breakdown

            ops = _safe(lambda: {"ops": op_breakdown(model, batch, cache_len=max_cache_len + (-max_cache_len) % 128,
                                                     filled=s.prompt + max(s.new_tokens) // 2)}, log)
            meta.setdefault("breakdown", {})[str(batch)] = {**ops, "step_ms": dense_rows[0]["ms_per_step"]}
        for spec in specs:
            if batch > 1 and s.batch_specs is not None and spec.label not in s.batch_specs:
                continue
            if budget.left() < s.compile_estimate_s + 20:
                log(f"budget: skipping {spec.label} b={batch} ({budget.left():.0f}s left)")
                skipped.setdefault(f"{spec.label} b={batch}", "time budget")
                continue
            try:
                art, art_label, _ = arts.get(spec)
            except SpecUnavailable as error:
                skipped[spec.label] = str(error)
                log(f"skipping {error}")
                continue
            ks = sorted(s.ks, reverse=True)
            sparsify(model, with_mode(spec.method, "prac", art), ks[0], artifacts=private_copy(art), path="masked")
            kept = {}
            try:
                for k in ks:
                    retarget(model, art, k)
                    kept[k] = kept_fractions(model, prompt, s.kept_steps)
            finally:
                unsparsify(model)
                reset_decoders()
            sparsify(model, with_mode(spec.method, "prac", art), ks[0], artifacts=private_copy(art), path="auto")
            try:
                patched = model_bytes(model)
                clear_dynamo_counts()  # one count over every k: retargeting must not recompile
                last_k = None
                for k in ks:
                    if budget.left() < -30:  # once compiled, the other k cost seconds each: finish them
                        log(f"budget: skipping {spec.label} k={k} b={batch}")
                        skipped.setdefault(f"{spec.label} k={k} b={batch}", "time budget")
                        break
                    retarget(model, art, k)
                    last_k = k
                    with PeakMemory() as peak:
                        res = timed(prompt, s.new_tokens, harness, max(1, s.samples))
                    for n in s.new_tokens:
                        add(spec.label, spec, k, batch, n, res[n], kept[k], art_label, harness, peak.bytes, patched, art)
                if cuda and s.profile and harness != "eager" and last_k is not None:
                    retarget(model, art, ks[0])  # the sparsest k: where the targets are set
                    meta.setdefault("profiles", []).append({"method": spec.label, "k": ks[0], "batch": batch,
                                                            **_safe(lambda: profile(model), log)})
            except Exception as error:  # report and go on: the other configurations still run
                log(f"{spec.label} b={batch} FAILED: {type(error).__name__}: {str(error)[:400]}")
                skipped[f"{spec.label} b={batch}"] = f"failed: {type(error).__name__}: {str(error)[:200]}"
            finally:
                reset_decoders()
                unsparsify(model)
            if checkpoint is not None:
                checkpoint(rows)
    return rows


def profile(model) -> dict:
    from .breakdown import profile_steps

    return profile_steps(model)


def _safe(fn, log) -> dict:
    try:
        return fn()
    except Exception as error:  # a diagnostic that fails must not lose the timings
        log(f"diagnostic failed: {type(error).__name__}: {str(error)[:300]}")
        return {"error": f"{type(error).__name__}: {str(error)[:300]}"}
