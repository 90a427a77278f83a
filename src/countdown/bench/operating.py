"""Operating points of one model: how much faster, for how much quality, per configuration and k.

:func:`operating_points` measures, for dense and each method spec at each k on the user's model and
machine: decode tokens/s through ``countdown.generate_fast`` against the dense model in the same
harness (CUDA: compiled, CUDA graphs, the Triton kernel path; CPU: eager with the ``gather`` path,
which reads only the kept rows), and quality on held-out text as the operating-point tables give it
(:mod:`countdown.bench.quality`): decode-style perplexity (the first half of each window a dense prompt,
the rest sparse and scored) relative to dense, and KL(dense || sparse) and top-1 agreement on the
same positions, from one forward per window. SP-Prac artifacts come from
:func:`countdown.prac.prepare.ensure_artifacts` (calibrated / trained once, cached). A model with random
weights (a paper-scale ``*-shape``: no tokenizer) gets speed-only artifacts and no quality columns.
"""

from __future__ import annotations

import contextlib
import datetime
from dataclasses import dataclass, field

import torch

from . import measure
from .opreport import pareto, recommendation, write_operating_points  # noqa: F401  (countdown bench's report)
from ..spec import Spec, parse_spec

COLUMNS = ["model", "method", "sparsity", "sparsity_real", "ppl_increase", "kl", "decode_speedup", "device", "date",
           "ppl", "dense_ppl", "top1", "tokens_per_s", "dense_tokens_per_s", "batch", "new_tokens", "harness", "path",
           "quality", "artifacts", "weights"]


@dataclass
class BenchSettings:
    """What :func:`operating_points` measures (see ``countdown bench --help`` for each field)."""

    specs: list[Spec]
    ks: list[float] = field(default_factory=lambda: [0.7, 0.8, 0.9])
    texts: list[str] | None = None  # held-out text; None: countdown.data.texts.eval_texts()
    calib_texts: list[str] | None = None  # None: the library's calibration text
    calib_tokens: int | None = None  # None: the library's default
    ppl_tokens: int = 4096
    window: int = 512
    batch: int = 1
    prompt: int = 64
    new_tokens: int = 128
    samples: int = 3
    artifacts_dir: str | None = None
    speed_only: bool = False
    fast_step: bool = True  # CUDA: time every row on countdown.decode.linears.fastest_step (undone after)
    int4: bool = False  # last, the model in 4 bits (countdown.quantize, RTN group 128, lm_head too), dense

    def __post_init__(self):
        """The numbers against countdown.options.RANGES (those of ``countdown bench``), before any work; texts
        as ``--texts`` reads them (a source name or a file path; a list of strings is the text itself)."""
        from ..data.texts import as_texts
        from ..options import check_all, check_optional
        from ..registry import sparsity_list

        self.ks = sparsity_list(self.ks)
        check_all(window=self.window, batch=self.batch, prompt=self.prompt, max_new_tokens=self.new_tokens,
                  samples=self.samples)
        check_optional("max_tokens", self.ppl_tokens, "ppl_tokens")
        check_optional("num_tokens", self.calib_tokens, "calib_tokens")
        self.texts = None if self.texts is None else as_texts(self.texts)
        self.calib_texts = None if self.calib_texts is None else as_texts(self.calib_texts)


def _artifacts(model, tokenizer, spec: Spec, s: BenchSettings, speed_only: bool):
    if speed_only:
        from .runner import IdTokenizer, generated_texts
        from .speedonly import RANDOM_KINDS, decode_prompts, fit_cuts_on_decode, library_artifacts, random_artifacts

        if spec.kind in RANDOM_KINDS:
            art = random_artifacts(model, spec, s.ks)
        else:  # e.g. shadow: the library's closed-form fit on the dense model's own greedy text
            texts = generated_texts(model, min(s.prompt, 32), 1024, 4)
            art = library_artifacts(model, spec, s.ks, texts, IdTokenizer(), num_tokens=1024)
        fit_cuts_on_decode(model, art, decode_prompts(model.config.vocab_size, 8, min(s.prompt, 32)), new_tokens=16)
        return art, "speed-only"
    from ..prac.prepare import prepare

    if s.artifacts_dir is None:
        from ..data.texts import cache_root

        folder = cache_root() / "artifacts"
    else:
        folder = s.artifacts_dir
    options: dict = {"progress": False}  # the spec's kind and options key the cached file, shared with the sweep
    if s.calib_texts is not None:
        options["texts"] = s.calib_texts
    if s.calib_tokens is not None:
        options["num_tokens"] = s.calib_tokens
    art = prepare(model, tokenizer, spec, s.ks, cache_dir=folder, **options)
    return art, f"{art.kind}, {art.meta['data'].get('num_tokens')} tokens of {art.meta['data'].get('name')}"


def _quality(model, spec, k, art, held) -> dict:
    from ..sparse import sparsify, unsparsify, with_mode
    from .quality import decode_quality

    sparsify(model, with_mode(spec, "prac", art), k, artifacts=art, path="masked")
    try:
        return decode_quality(model, held)
    finally:
        unsparsify(model)


def _speed(model, prompt, s: BenchSettings, harness: str) -> float:
    runs = [measure.time_decode(model, prompt, s.new_tokens, harness) for _ in range(max(1, s.samples))]
    return sorted(r["tokens_per_s"] for r in runs)[len(runs) // 2]


@contextlib.contextmanager
def _fast_step(model, on: bool):
    """The fastest decode step (countdown.decode.linears.fastest_step) around the speed timings only;
    quality is measured on the model as loaded. Nothing when ``on`` is False."""
    if not on:
        yield
        return
    from ..decode.generate import reset_decoders
    from ..decode.linears import fastest_step

    fastest_step(model)
    try:
        yield
    finally:
        fastest_step(model, on=False)
        reset_decoders()  # the compiled steps captured the fused modules


def operating_points(model, tokenizer, settings: BenchSettings, model_name: str = "model", log=print,
                     progress: bool = True) -> list[dict]:
    """One row per configuration (dense first, then each available spec x k) with :data:`COLUMNS`.

    ``tokenizer`` None (or ``settings.speed_only``) measures speed only, with speed-only artifacts:
    the quality columns are left empty and ``quality`` says ``speed only``. Specs this library cannot
    run are skipped with the reason logged. ``settings.int4`` adds, last, each spec on a 4-bit copy with W_down
    held transposed (``weights`` "int4-downT") and the dense row of the model quantized to 4 bits *in place*
    (``weights`` "int4"; the other rows' ``weights`` is the dtype as loaded)."""
    from tqdm.auto import tqdm

    from ..decode.generate import reset_decoders

    s = settings
    speed_only = s.speed_only or tokenizer is None
    device = next(model.parameters()).device
    cuda = device.type == "cuda"
    harness, path = ("compile-cdt", "auto") if cuda else ("eager", "gather")
    device_name = torch.cuda.get_device_name(device) if cuda else "cpu"
    date = datetime.date.today().isoformat()
    model.generation_config.eos_token_id = None  # every run decodes exactly new_tokens
    held = None
    if not speed_only:
        from .quality import held_out

        held = held_out(model, tokenizer, texts=s.texts, max_tokens=s.ppl_tokens, window=s.window)
    prompt = torch.randint(0, model.config.vocab_size, (s.batch, s.prompt),
                           generator=torch.Generator().manual_seed(3)).to(device)
    specs = [spec.resolved() for spec in map(parse_spec, s.specs) if not spec.is_dense]
    total = 1 + len(specs) * len(s.ks) * (2 if s.int4 else 1) + (1 if s.int4 else 0)
    bar = tqdm(total=total, desc="countdown bench", disable=not progress)
    base = {"model": model_name, "device": device_name, "date": date, "batch": s.batch, "new_tokens": s.new_tokens,
            "harness": harness, "quality": "speed only (random weights)" if speed_only else "decode-style ppl, KL",
            "weights": str(next(model.parameters()).dtype).replace("torch.", "")}
    fast = cuda and s.fast_step
    with _fast_step(model, fast):
        dense_tps = _speed(model, prompt, s, harness)
    reset_decoders()
    dense_ppl = None if held is None else held.dense_ppl
    rows = [{**base, "method": "dense", "sparsity": 0.0, "sparsity_real": 0.0, "ppl_increase": 0.0 if dense_ppl else "",
             "kl": 0.0 if dense_ppl else "", "top1": 1.0 if dense_ppl else "", "decode_speedup": 1.0, "ppl": dense_ppl or "", "dense_ppl": dense_ppl or "",
             "tokens_per_s": dense_tps, "dense_tokens_per_s": dense_tps, "path": "dense", "artifacts": ""}]
    bar.update(1)
    for spec in specs:
        rows += _spec_rows(model, tokenizer, spec, s, held, prompt, fast, harness, path, base, dense_tps, bar, log)
    if s.int4:
        # the sparse 4-bit rows first (a copy of the model as loaded), listed after the dense 4-bit row (in place)
        sparse4 = _int4_sparse_rows(model, tokenizer, specs, s, held, prompt, fast, harness, path, base, dense_tps,
                                    bar, log) if specs else []
        rows.append(_int4_row(model, tokenizer, s, held, prompt, fast, harness, base, dense_tps, log))
        rows += sparse4
    bar.close()
    return rows


def _spec_rows(model, tokenizer, spec, s: BenchSettings, held, prompt, fast: bool, harness: str, path: str,
               base: dict, dense_tps: float, bar, log) -> list[dict]:
    """The rows of one spec at every k on ``model``: quality on the model as held (``held``), speed over
    ``dense_tps`` (the model as loaded, dense)."""
    from ..decode.generate import reset_decoders
    from ..sparse import sparsify, unsparsify, with_mode
    from .runner import private_copy
    from .speedonly import SpecUnavailable, retarget

    speed_only = s.speed_only or tokenizer is None
    dense_ppl = None if held is None else held.dense_ppl
    rows = []
    bar.set_postfix_str(spec.label)
    try:
        art, art_label = _artifacts(model, tokenizer, spec, s, speed_only)
    except (SpecUnavailable, ValueError, TypeError) as error:
        log(f"skipping {spec.label}: {type(error).__name__}: {str(error)[:200]}")
        bar.update(len(s.ks))
        return rows
    ks = sorted(s.ks, reverse=True)
    quality = {}
    for k in ks:
        if speed_only:
            from .measure import kept_fractions

            sparsify(model, with_mode(spec, "prac", art), k, artifacts=private_copy(art), path="masked")
            try:
                quality[k] = {"sparsity_real": 1 - kept_fractions(model, prompt, 16)[0]}
            finally:
                unsparsify(model)
                reset_decoders()
        else:
            quality[k] = _quality(model, spec, k, art, held)
    # one patch (one compile on CUDA) for every k: the thresholds / cuts are switched in place
    sparsify(model, with_mode(spec, "prac", art), ks[0], artifacts=private_copy(art), path=path)
    try:
        with _fast_step(model, fast):  # around every k: one compile serves them all
            for k in ks:
                retarget(model, art, k)
                tps = _speed(model, prompt, s, harness)
                q = quality[k]
                rows.append({**base, "method": spec.label, "sparsity": k,
                             "sparsity_real": round(q["sparsity_real"], 4),
                             "ppl_increase": "" if speed_only else q["ppl"] / dense_ppl - 1,
                             "kl": "" if speed_only else q["kl"], "top1": "" if speed_only else q["top1"],
                             "decode_speedup": tps / dense_tps,
                             "ppl": "" if speed_only else q["ppl"], "dense_ppl": dense_ppl or "",
                             "tokens_per_s": tps, "dense_tokens_per_s": dense_tps, "path": path,
                             "artifacts": art_label})
                bar.update(1)
    finally:
        reset_decoders()
        unsparsify(model)
    return rows


def _int4_sparse_rows(model, tokenizer, specs, s: BenchSettings, held, prompt, fast: bool, harness: str, path: str,
                      base: dict, dense_tps: float, bar, log) -> list[dict]:
    """Sparse rows on 4-bit weights: each spec at each k on a copy of ``model`` quantized with W_down held
    transposed (``countdown.quantize(transposed_down=True)``, RTN group 128, lm_head too: the layout whose skipped
    rows are bytes not read; on CUDA a calibrated mono / cats threshold runs the kept-rows kernels, docs/int4.md),
    calibrated on that copy; quality against the model as loaded, speed over its dense row. ``weights``
    "int4-downT"."""
    import copy

    from ..int4 import quantize

    quantized = quantize(copy.deepcopy(model), group=128, lm_head=True, transposed_down=True)
    rows = []
    for spec in specs:
        rows += _spec_rows(quantized, tokenizer, spec, s, held, prompt, fast, harness, path,
                           {**base, "weights": "int4-downT"}, dense_tps, bar, log)
    for row in rows:
        log(f"4-bit weights, W_down held transposed, {row['method']} k = {row['sparsity']}: "
            f"{row['tokens_per_s']:.1f} tokens/s, {row['decode_speedup']:.2f}x the loaded model"
            + ("" if row["ppl_increase"] == "" else f", perplexity {100 * row['ppl_increase']:+.1f} %"))
    return rows


def _int4_row(model, tokenizer, s: BenchSettings, held, prompt, fast: bool, harness: str, base: dict,
              dense_tps: float, log) -> dict:
    """The dense row of ``model`` quantized in place to 4 bits (every decoder Linear and lm_head, RTN group 128),
    scored against the model as loaded (``held``) and timed on the same harness: what a user gets from 4-bit weights
    alone (the sparse 4-bit rows: :func:`_int4_sparse_rows`)."""
    from ..decode.generate import reset_decoders
    from ..int4 import quantize
    from .quality import compare_held, held_out

    loaded = str(next(model.parameters()).dtype).replace("torch.", "")
    quantize(model, group=128, lm_head=True)
    q = None
    if held is not None:
        q = compare_held(held, held_out(model, tokenizer, texts=s.texts, max_tokens=s.ppl_tokens, window=s.window))
    with _fast_step(model, fast):
        tps = _speed(model, prompt, s, harness)
    reset_decoders()
    log(f"4-bit weights (RTN group 128, lm_head too): {tps:.1f} tokens/s, {tps / dense_tps:.2f}x the {loaded} model"
        + ("" if q is None else f", perplexity {100 * q['ppl_increase']:+.1f} %"))
    return {**base, "method": "dense", "sparsity": 0.0, "sparsity_real": 0.0,
            "ppl_increase": "" if q is None else q["ppl_increase"], "kl": "" if q is None else q["kl"],
            "top1": "" if q is None else q["top1"], "decode_speedup": tps / dense_tps, "ppl": "" if q is None else q["ppl"],
            "dense_ppl": "" if held is None else held.dense_ppl, "tokens_per_s": tps, "dense_tokens_per_s": dense_tps,
            "path": "int4", "artifacts": "", "weights": "int4"}
