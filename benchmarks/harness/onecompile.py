"""The decode benchmark in one device call: dense and every configuration at every k, compiled once.

Order of work (each step labelled in the log, every row written as soon as it is measured):

1. the compiled dense decoder as everyone runs it (``generate_fast``, full-graph torch.compile with CUDA
   graphs and coordinate-descent tuning): ``dense_samples`` timings of one compile;
2. per method spec, speed-only artifacts (:mod:`countdown.bench.speedonly`: random predictors, or the
   library's own closed-form fit for kinds it cannot synthesise) with cuts fitted on the model's own
   decode steps for every k, and the kept fraction each k gives (masked path, counted);
3. the model's Gated-MLPs behind slots (:mod:`harness.slots`): the step compiled ONCE; dense,
   then each spec patched into the slots, one CUDA-graph capture per spec, every k by copying its cuts
   into the selectors' device buffers (no recompilation: Dynamo's graph count is in every row); per
   (spec, k) decode tokens/s, and the MLP alone (``time_graph`` over the first layers' weights, inputs
   recorded from dense decode steps) against its roofline (weight bytes / copy bandwidth); dense in
   the slots again at the end;
4. the full-graph dense decoder compiled a second time, if the budget allows (the baseline's spread
   across compiles).

Between 2 and 3, if mask files are given, masks recorded on real models are replayed at this shape
against random masks of the same kept fraction (:mod:`harness.maskreplay`).

Speed-ups against dense are taken against the fastest compiled dense decoder of the run (full-graph or
slots: the conservative choice), and also against dense in the slots (``speedup_vs_dense_same_harness``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from countdown.bench.measure import kept_fractions, time_decode
from countdown.bench.speedonly import SpecUnavailable, decode_prompts, retarget
from countdown.patch.sparsify import with_mode
from countdown.spec import Spec, parse_spec

from .checks import clear_dynamo_counts, dynamo_counts
from .rows import decode_row, shapes_of
from .timing import Budget, PeakMemory, spread
from .weightbytes import model_bytes

SLOT_HARNESS = "one-compile"
SLOT_INDUCTOR_OPTIONS = {"coordinate_descent_tuning": True, "triton.cudagraphs": False}


@dataclass
class OneCompileSettings:
    """What :func:`one_compile_sweep` times (batch 1). ``compile``: ``"inductor"`` on CUDA;
    ``"eager-backend"`` or None for CPU smoke runs (no CUDA graphs there)."""

    specs: list[Spec]
    ks: list[float] = field(default_factory=lambda: [0.5, 0.6, 0.7, 0.8, 0.9])
    new_tokens: int = 512
    prompt: int = 64
    dense_samples: int = 3
    samples: int = 1
    prefills: int = 3  # a row's prefill time: the median of this many runs of the prompt (eager: it varies)
    dense_compiles: int = 2
    breakdown: bool = True  # the per-op breakdown of the dense step (harness.breakdown), CUDA only
    profile: bool = False  # torch.profiler over the captured slot step: dense, and each spec at its last k
    fit_prompts: int = 8
    fit_tokens: int = 32
    fit_rounds: int = 1
    kept_steps: int = 32
    kernel_layers: int = 8
    kernel_tokens: int = 4
    budget_s: float = 480.0
    compile: str | None = "inductor"
    masks: list[str] = field(default_factory=list)


def _speed_artifacts(model, spec: Spec, s: OneCompileSettings, log):
    """Speed-only artifacts of ``spec`` at every k, cuts fitted on decode steps; (art, label)."""
    from countdown.model.gated_mlp import require_gated_mlps
    from countdown.selectors.base import selectors_for
    from countdown.bench.speedonly import (RANDOM_KINDS, SPEED_ONLY, IdTokenizer, fit_cuts_on_decode, generated_texts,
                                           library_artifacts, random_artifacts)

    from .runner import on_device

    art, how = None, ""
    if spec.kind in RANDOM_KINDS:
        try:
            art = on_device(random_artifacts(model, spec, s.ks), next(model.parameters()).device)
            selectors_for(art, require_gated_mlps(model), spec.method, s.ks[0])  # a kind of another layout fails here
            how = {"threshold": "thresholds", "shadow": "shadows of the model's own weights"}.get(spec.kind,
                                                                                                "random predictor")
        except Exception as error:  # e.g. a method whose thresholds are laid out otherwise: let the library build it
            log(f"{spec.label}: no random stand-in ({type(error).__name__}: {str(error)[:120]}); the library builds it")
            art = None
    if art is None:
        texts = generated_texts(model, s.prompt, 2048, s.fit_prompts)
        art = on_device(library_artifacts(model, spec, s.ks, texts, IdTokenizer(), num_tokens=2048),
                        next(model.parameters()).device)
        how = "library fit on the dense model's greedy text"
    prompts = decode_prompts(model.config.vocab_size, s.fit_prompts, s.prompt)
    history = fit_cuts_on_decode(model, art, prompts, new_tokens=s.fit_tokens, rounds=s.fit_rounds)
    rank = art.meta.get("d_rank")
    label = (f"{SPEED_ONLY}: {how}{f' (rank {rank})' if rank and spec.kind not in ('threshold', 'shadow') else ''}, cuts fitted on "
             f"decode steps ({s.fit_rounds} round(s), {s.fit_prompts} prompts x {s.fit_tokens} tokens)")
    return art, label, history


def _mlp_inputs(model, prompt, layers: int, tokens: int) -> list[list[torch.Tensor]]:
    """Inputs of the first ``layers`` Gated-MLPs at ``tokens`` dense decode steps (eager)."""
    from countdown.decode.generate import generate_fast
    from countdown.model.gated_mlp import require_gated_mlps

    mlps = require_gated_mlps(model)[:layers]
    seen: list[list[torch.Tensor]] = [[] for _ in mlps]
    handles = [g.module.register_forward_pre_hook(lambda m, a, i=i: seen[i].append(a[0].detach().clone())
                                                  if a[0].shape[-2] == 1 else None) for i, g in enumerate(mlps)]
    try:
        generate_fast(model, prompt[:1], tokens + 1, compile=False)
    finally:
        for h in handles:
            h.remove()
    return [xs[:tokens] for xs in seen]


def mlp_time(modules, inputs, reps: int = 25) -> float:
    """Median microseconds per Gated-MLP call, cycling over ``modules`` x their recorded inputs."""
    from .timing import time_graph

    calls = [lambda m=m, x=x: m(x) for m, xs in zip(modules, inputs) for x in xs]
    return time_graph(calls, reps=reps, device=inputs[0][0].device)


def _mlp_kept(holder, modules, inputs) -> float:
    """Sparsity-Real of the patched ``holder`` on the recorded inputs (counted on the masked path)."""
    from countdown.patch.sparsify import sparsity_real, state_of
    from countdown.patch.state import reset_sparsity_stats

    state = state_of(holder)
    path, state.path = state.path, "masked"
    try:
        reset_sparsity_stats(holder)
        for m, xs in zip(modules, inputs):
            for x in xs:
                m(x)
        per_layer = sparsity_real(holder)["per_layer"][:len(modules)]
        return sum(per_layer) / len(per_layer)
    finally:
        state.path = path


def one_compile_sweep(model, settings: OneCompileSettings, meta: dict, log=print, checkpoint=None) -> list[dict]:
    """Time dense and every spec of ``settings`` at every k on ``model`` (batch 1); returns decode rows
    (``harness.report.DECODE_COLUMNS``) and fills ``meta`` (``skipped``, ``dense_spread``,
    ``slot_graphs``, ``kernel``, ``mask_replay``, ``sparsity_real_8b``)."""
    from countdown.decode.generate import reset_decoders
    from countdown.patch.sparsify import sparsify, unsparsify
    from countdown.bench.speedonly import private_copy

    s = settings
    budget = Budget(s.budget_s)
    cuda = next(model.parameters()).device.type == "cuda"
    device = next(model.parameters()).device
    rows: list[dict] = []
    skipped = meta.setdefault("skipped", {})
    max_cache_len = s.prompt + s.new_tokens + (-(s.prompt + s.new_tokens)) % 128
    prompt = torch.randint(0, model.config.vocab_size, (1, s.prompt),
                           generator=torch.Generator().manual_seed(3)).to(device)
    ctx = {"meta": meta, "shapes": shapes_of(model), "copy_bps": meta.get("copy_gbps", float("nan")) * 1e9,
           "batch": 1, "new_tokens": s.new_tokens}

    def done():
        if checkpoint is not None:
            checkpoint(rows)

    def dense_full_graph(which: int):
        harness = "compile-cdt" if cuda else "eager"
        torch._dynamo.reset()
        clear_dynamo_counts()
        with PeakMemory() as peak:
            stats = [time_decode(model, prompt, s.new_tokens, harness, max_cache_len)
                     for _ in range(max(1, s.dense_samples))]
        rows.append(decode_row(ctx, "dense", None, None, stats, (1.0, 1.0), f"full-graph compile #{which}", harness, peak.bytes,
                               model_bytes(model), graphs=dynamo_counts() if cuda else None))
        meta.setdefault("dense_spread", {}).setdefault("1", {})[f"{harness} #{which}"] = spread(
            [st["tokens_per_s"] for st in stats])
        reset_decoders()
        torch._dynamo.reset()
        log(f"dense full-graph compile #{which}: {rows[-1]['tokens_per_s']} tokens/s "
            f"(setup {rows[-1]['setup_s']} s)")
        done()

    # 1. the compiled dense decoder as generate_fast runs it, and where its step's time goes
    if s.dense_compiles > 0:
        dense_full_graph(1)
    if cuda and s.breakdown:
        from .breakdown import op_breakdown
        from .runner import _safe

        ops = _safe(lambda: {"ops": op_breakdown(model, 1, cache_len=max_cache_len,
                                                 filled=s.prompt + s.new_tokens // 2)}, log)
        meta.setdefault("breakdown", {})["1"] = {**ops, "step_ms": rows[0]["ms_per_step"] if rows else None}
        log("per-op breakdown of the dense step: " + ("done" if "ops" in ops else ops.get("error", "")))
        done()
    # 2. artifacts, cuts and kept fractions of every spec (no compile)
    prepared = []
    for spec in map(parse_spec, s.specs):
        if spec.is_dense:
            continue
        spec = spec.resolved()
        start = time.perf_counter()
        try:
            art, label, history = _speed_artifacts(model, spec, s, log)
        except (SpecUnavailable, ValueError, TypeError, NotImplementedError, RuntimeError) as error:
            skipped[spec.label] = f"{type(error).__name__}: {str(error)[:200]}"
            log(f"skipping {spec.label}: {skipped[spec.label]}")
            continue
        kept = {}
        sparsify(model, with_mode(spec.method, "prac", art), s.ks[0], artifacts=private_copy(art), path="masked")
        try:
            for k in s.ks:
                retarget(model, art, k)
                kept[k] = kept_fractions(model, prompt, s.kept_steps)
        finally:
            unsparsify(model)
            reset_decoders()
        meta.setdefault("sparsity_real_8b", {})[spec.label] = {f"{k:g}": round(1 - kept[k][0], 4) for k in s.ks}
        log(f"{spec.label}: artifacts and cuts in {time.perf_counter() - start:.1f} s ({label}); Sparsity-Real "
            f"{meta['sparsity_real_8b'][spec.label]} (fit rounds {history})")
        prepared.append((spec, art, label, kept))
    # 3. real masks replayed at this shape (the assumption every row below rests on)
    if s.masks:
        from .maskreplay import replay_files

        meta["mask_replay"] = replay_files(model, s.masks, ctx["copy_bps"], log=log)
        done()
    # 4. one compile for every configuration
    _slot_phase(model, prepared, s, ctx, rows, prompt, max_cache_len, budget, log, done)
    # 5. the full-graph dense decoder once more
    if s.dense_compiles > 1 and budget.left() > 75:
        dense_full_graph(2)
    elif s.dense_compiles > 1:
        skipped["dense full-graph compile #2"] = f"time budget ({budget.left():.0f} s left)"
    done()
    return rows


def _slot_phase(model, prepared, s: OneCompileSettings, ctx, rows, prompt, max_cache_len, budget, log, done) -> None:
    """Dense and every prepared spec at every k through one compiled step (see the module docstring).
    If the Inductor compile or its capture fails, the eager step is captured instead (harness
    ``one-compile-eager``: the same for every row, so the ratios hold; said in the log and meta)."""
    from countdown.patch.sparsify import sparsify, unsparsify
    from countdown.bench.speedonly import private_copy
    from .slots import CapturedDecoder, SlotModel

    meta, skipped = ctx["meta"], ctx["meta"].setdefault("skipped", {})
    cuda = next(model.parameters()).device.type == "cuda"
    inputs = _mlp_inputs(model, prompt, s.kernel_layers, s.kernel_tokens) if s.kernel_layers else None
    slots = SlotModel(model)
    modules = [g.module for g in slots.mlps[:s.kernel_layers]]
    harness = SLOT_HARNESS
    dec = CapturedDecoder(model, slots.holder, 1, max_cache_len, compile=s.compile, options=SLOT_INDUCTOR_OPTIONS)
    clear_dynamo_counts()
    try:
        dense_kernel = mlp_time(modules, inputs) if inputs else None
        meta["kernel"] = {"dense_us": dense_kernel, "layers": len(modules), "tokens": s.kernel_tokens}

        def time_slots(label, spec, k, kept, art_label, art=None, setup=0.0, kernel_us=None, kernel_real=None):
            with PeakMemory() as peak:
                stats = []
                for _ in range(max(1, s.dense_samples if spec is None else s.samples)):
                    _, prefill_s, decode_s = dec.run(prompt, s.new_tokens, s.prefills)
                    stats.append(_stats(s.new_tokens, prefill_s, decode_s, setup))
            row = decode_row(ctx, label, spec, k, stats, kept, art_label, harness, peak.bytes,
                             model_bytes(model) + model_bytes(slots.holder), art=art,
                             graphs=dynamo_counts() if s.compile else None,
                             kernel_us=dense_kernel if spec is None else kernel_us, kernel_real=kernel_real,
                             dense_kernel_us=dense_kernel)
            rows.append(row)
            log(f"  {label:16s} k={'-' if k is None else f'{k:g}':4s} {row['tokens_per_s']:8.1f} tok/s "
                f"{row['ms_per_step']:.3f} ms/step, MLP {row['kernel_us']} us ({row['kernel_roofline_us']} us "
                f"roofline), graphs {row['graphs']}")
            spreads = meta.setdefault("dense_spread", {}).setdefault("1", {})
            if spec is None:
                spreads[f"{harness} #{sum(1 for key in spreads if key.startswith(harness + ' #')) + 1}"] = spread(
                    [st["tokens_per_s"] for st in stats])

        try:
            setup = dec.capture(prompt)
        except Exception as error:  # keep the run: the eager step in our CUDA graph serves every row alike
            log(f"slots: the compiled step failed ({type(error).__name__}: {str(error)[:300]}); capturing the eager "
                "step instead")
            meta["slot_fallback"] = f"{type(error).__name__}: {str(error)[:300]}"
            torch._dynamo.reset()
            harness = SLOT_HARNESS + "-eager"
            dec = CapturedDecoder(model, slots.holder, 1, max_cache_len, compile=None)
            setup = dec.capture(prompt)
        log(f"slots: step compiled and captured in {setup:.1f} s ({harness})")
        time_slots("dense", None, None, (1.0, 1.0), "", setup=setup)
        _profile_slots(s, dec, meta, "dense", None, log)
        _floor(dec, slots, prompt, s, meta, log)
        done()
        for spec, art, art_label, kept in prepared:
            if budget.left() < 25:
                skipped[spec.label] = "time budget"
                log(f"budget: skipping {spec.label} ({budget.left():.0f} s left)")
                continue
            start = time.perf_counter()
            try:
                sparsify(slots.holder, with_mode(spec.method, "prac", art), s.ks[0], artifacts=private_copy(art), path="auto")
                try:
                    setup = dec.capture(prompt)
                    for k in s.ks:
                        retarget(slots.holder, art, k)
                        us = mlp_time(modules, inputs) if inputs else None
                        real = _mlp_kept(slots.holder, modules, inputs) if inputs else None
                        time_slots(spec.label, spec, k, kept[k], art_label, art=art, setup=setup, kernel_us=us,
                                   kernel_real=real)
                        setup = 0.0
                    _profile_slots(s, dec, meta, spec.label, s.ks[-1], log)
                finally:
                    dec.release()
                    unsparsify(slots.holder)
            except Exception as error:  # report and go on: the other configurations still run
                skipped[spec.label] = f"failed: {type(error).__name__}: {str(error)[:200]}"
                log(f"{spec.label} FAILED: {type(error).__name__}: {str(error)[:400]}")
            log(f"{spec.label}: {time.perf_counter() - start:.1f} s in the slots")
            done()
        dec.capture(prompt)
        time_slots("dense", None, None, (1.0, 1.0), "")  # the slot baseline again, after every method
        meta["slot_graphs"] = dynamo_counts()
        log(f"slots: Dynamo over every configuration and k: {meta['slot_graphs']} (1 graph, 0 breaks: no recompile)")
    finally:
        dec.release()
        slots.restore()
        done()


def _floor(dec, slots, prompt, s: OneCompileSettings, meta: dict, log) -> None:
    """The step with every Gated-MLP a zero fill (:class:`harness.slots.ZeroMLP`) into
    ``meta["floor"]``: what no MLP method can go below in this harness; a row's MLP time in the step is
    its ms/step minus this floor, over the layers (the report's "in the step" column)."""
    from .slots import ZeroMLP

    try:
        with slots.replaced(lambda m: ZeroMLP()):
            setup = dec.capture(prompt)
            stats = [_stats(s.new_tokens, *dec.run(prompt, s.new_tokens, s.prefills)[1:], setup)
                     for _ in range(max(1, s.dense_samples))]
            _profile_slots(s, dec, meta, "floor", None, log)
            dec.release()
    except Exception as error:  # diagnostics: never lose the run for it
        log(f"floor (zero MLPs) failed: {type(error).__name__}: {str(error)[:300]}")
        return
    ms = sorted(st["ms_per_step"] for st in stats)
    meta["floor"] = {"ms_per_step": spread(ms)["median"], "ms_per_step_all": ms, "layers": len(slots.mlps),
                     "tokens_per_s": spread([st["tokens_per_s"] for st in stats])["median"]}
    log(f"  floor (every Gated-MLP a zero fill): {meta['floor']['ms_per_step']:.3f} ms/step "
        f"({meta['floor']['tokens_per_s']:.1f} tok/s)")


def _profile_slots(s: OneCompileSettings, dec, meta: dict, label: str, k, log) -> None:
    """With ``s.profile``: the captured step's kernels (torch.profiler over 16 replays) into
    ``meta["slot_profiles"]``, the classes in the log. The replays write the cache at their own
    positions; :meth:`CapturedDecoder.run` resets it before the next timing."""
    if not s.profile or dec.graph is None:
        return
    from .breakdown import profile_calls

    try:
        prof = profile_calls(dec.graph.replay, 16, dec.device)
    except Exception as error:  # a profile is diagnostics: never lose the run for it
        log(f"slot profile of {label} failed: {type(error).__name__}: {error}")
        return
    finally:
        dec.cache.reset()
    prof["kernels"] = prof["kernels"][:40]
    meta.setdefault("slot_profiles", []).append({"method": label, "k": k, **prof})
    classes = ", ".join(f"{name} {e['ms_per_step']:.3f} ms ({e['kernels_per_step']:.0f})"
                        for name, e in sorted(prof["classes"].items(), key=lambda kv: -kv[1]["ms_per_step"]))
    log(f"  profile {label} k={k}: {prof['device_ms_per_step']:.3f} ms of kernel spans per step (they overlap where "
        f"programmatic dependent launch starts a kernel early to wait): {classes}")


def _stats(new_tokens: int, prefill_s: float, decode_s: float, setup_s: float) -> dict:
    steps = max(1, new_tokens - 1)
    return {"tokens_per_s": new_tokens / (prefill_s + decode_s), "decode_tokens_per_s": steps / decode_s,
            "ms_per_step": 1e3 * decode_s / steps, "setup_s": setup_s}
