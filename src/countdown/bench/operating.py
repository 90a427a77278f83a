"""Operating points of one model: how much faster, for how much quality, per configuration and k.

:func:`operating_points` measures, for dense and each method spec at each k on the user's model and
machine: decode tokens/s through ``countdown.generate_fast`` against the dense model in the same
harness (CUDA: compiled, CUDA graphs, the Triton kernel path; CPU: eager with the ``gather`` path,
which reads only the kept rows), and quality on held-out text as the operating-point tables give it
(:mod:`countdown.bench.quality`): decode-style perplexity (the first half of each window a dense prompt,
the rest sparse and scored) relative to dense, and KL(dense || sparse) and top-1 agreement on the
same positions, from one forward per window. SP-Prac artifacts come from
:func:`countdown.artifacts.prepare.prepare` (calibrated / trained once, cached). A model with random
weights (a paper-scale ``*-shape``: no tokenizer) gets speed-only artifacts and no quality columns.

Skipping rows against fewer bits: a ``dual[mixed]`` spec (rows refined to 8 bits, the rest at 4: docs/mixed.md)
runs on a copy of the model made as a user makes it (``countdown.prepare`` converts the MLPs to the nested 8-bit
format, ``countdown.quantize(group=G, lm_head=True)`` then holds every other Linear in 4 bits, ``countdown.sparsify``)
and is measured beside the dense 4-bit model (another copy, ``countdown.quantize`` with the same G: the same 4-bit
non-MLP Linears, so that the two differ in the MLP alone) and the skipping specs on the model as loaded. Every row
gives ``mlp_bits``, the bits a decode step reads per MLP weight (scales and a selector's own bytes included): the
kind's ``weight_bytes`` at the row's kept share (1 - Sparsity-Real) or, dense, the modules' own bytes. Speed and
perplexity are both against the model as loaded, so bits, speed and quality of every row compare on one scale.

The timings alternate: ``samples`` rounds, each timing dense once and then every configuration at every k once,
and dense once more at the end. A configuration's speed-up in round r is its tokens/s over the geometric mean of
the dense timings just before and after that round (:func:`paired_speedups`), so that a machine whose speed drifts
(a CPU shared with other work, a clock that changes) moves both sides of each ratio; each row gives the median of
the rounds' ratios and their min and max (``speedup_min`` / ``speedup_max``). On CUDA each round compiles each
patch state again (Inductor's caches make the repeats cheaper than the first).
"""

from __future__ import annotations

import contextlib
import datetime
import math
import statistics
from dataclasses import dataclass, field

import torch

from . import measure
from .opreport import pareto, recommendation, write_operating_points  # noqa: F401  (countdown bench's report)
from ..spec import Spec, parse_spec

COLUMNS = ["model", "method", "sparsity", "sparsity_real", "ppl_increase", "kl", "decode_speedup", "device", "date",
           "ppl", "dense_ppl", "top1", "tokens_per_s", "dense_tokens_per_s", "batch", "new_tokens", "harness", "path",
           "quality", "artifacts", "weights", "speedup_min", "speedup_max", "samples", "mlp_bits"]
NEW_COLUMNS = ("mlp_bits",)  # columns that a table of an earlier release lacks (its rows get them empty)
INT4_GROUP = 64  # the dense 4-bit row's group where no dual[mixed] spec names one (dual[mixed]'s default)
MIXED_WEIGHTS = "nested8+int4"  # a dual[mixed] row's weights: nested 8-bit MLPs, every other Linear 4-bit
QUANTIZED = {"int4": "4-bit weights", MIXED_WEIGHTS: "nested 8-bit MLPs, the other Linears 4-bit"}


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
    samples: int = 3  # rounds of alternated timings (module docstring)
    artifacts_dir: str | None = None
    speed_only: bool = False
    fast_step: bool = True  # CUDA: time every row on countdown.decode.linears.fastest_step (undone after)
    # the model in 4 bits (countdown.quantize: every Linear and lm_head, RTN), dense; measured too wherever a
    # dual[mixed] spec is. int4_group: its group (None: the dual[mixed] specs' group, else INT4_GROUP)
    int4: bool = False
    int4_group: int | None = None

    def __post_init__(self):
        """The numbers against countdown.options.RANGES (those of ``countdown bench``), before any work; texts
        as ``--texts`` reads them (a source name or a file path; a list of strings is the text itself)."""
        from ..data.texts import as_texts
        from ..options import check_all, check_optional
        from ..sparse_methods.registry import sparsity_list

        self.ks = sparsity_list(self.ks)
        check_all(window=self.window, batch=self.batch, prompt=self.prompt, max_new_tokens=self.new_tokens,
                  samples=self.samples)
        check_optional("max_tokens", self.ppl_tokens, "ppl_tokens")
        check_optional("num_tokens", self.calib_tokens, "calib_tokens")
        self.texts = None if self.texts is None else as_texts(self.texts)
        self.calib_texts = None if self.calib_texts is None else as_texts(self.calib_texts)
        if self.int4_group is not None:
            from ..int4.format import GROUPS

            if self.int4_group not in GROUPS:
                raise ValueError(f"int4_group must be one of {GROUPS}, got {self.int4_group!r}")


def _artifacts(model, tokenizer, spec: Spec, s: BenchSettings, speed_only: bool):
    if speed_only:
        from .speedonly import (RANDOM_KINDS, IdTokenizer, decode_prompts, fit_cuts_on_decode, generated_texts,
                                library_artifacts, random_artifacts)

        if spec.kind in RANDOM_KINDS:
            art = random_artifacts(model, spec, s.ks)
        else:  # e.g. shadow: the library's closed-form fit on the dense model's own greedy text
            texts = generated_texts(model, min(s.prompt, 32), 1024, 4)
            art = library_artifacts(model, spec, s.ks, texts, IdTokenizer(), num_tokens=1024)
        fit_cuts_on_decode(model, art, decode_prompts(model.config.vocab_size, 8, min(s.prompt, 32)), new_tokens=16)
        return art, "speed-only"
    from ..artifacts.prepare import prepare

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
    from ..patch.sparsify import sparsify, unsparsify, with_mode
    from .quality import decode_quality

    sparsify(model, with_mode(spec, "prac", art), k, artifacts=art, path="masked")
    try:
        return decode_quality(model, held)
    finally:
        unsparsify(model)


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


def paired_speedups(dense: list[float], sparse: list[list[float]]) -> list[dict]:
    """Speed-ups from alternated timings: ``dense`` holds the R + 1 dense tokens/s (before round 0, ..., after the
    last round), ``sparse`` one list of R tokens/s per configuration (round r between dense[r] and dense[r + 1]).
    Each configuration's ratio in round r is its tokens/s over ``sqrt(dense[r] * dense[r + 1])``; returns per
    configuration the median, min and max ratio, its median tokens/s and the median of those dense references."""
    refs = [math.sqrt(a * b) for a, b in zip(dense, dense[1:])]
    out = []
    for runs in sparse:
        if len(runs) != len(refs):
            raise ValueError(f"{len(runs)} timings of a configuration against {len(refs)} rounds of dense timings")
        ratios = [t / ref for t, ref in zip(runs, refs)]
        out.append({"decode_speedup": statistics.median(ratios), "speedup_min": min(ratios),
                    "speedup_max": max(ratios), "tokens_per_s": statistics.median(runs),
                    "dense_tokens_per_s": statistics.median(refs), "samples": len(runs)})
    return out


@dataclass
class _Block:
    """Timings under one patch of one model: ``points`` are (row, k) pairs timed in turn (k None: the model as
    it is); ``spec`` / ``art`` patch the model for the block (None: dense)."""

    model: object
    spec: Spec | None
    art: object
    points: list = field(default_factory=list)


def _time(model, prompt, s: BenchSettings, harness: str) -> float:
    return measure.time_decode(model, prompt, s.new_tokens, harness)["tokens_per_s"]


def _run_block(block: _Block, prompt, s: BenchSettings, fast: bool, harness: str, path: str, bar) -> list[float]:
    """One round of ``block``: patched once (one compile on CUDA), each point timed once (thresholds / cuts
    switched in place), then unpatched."""
    from ..decode.generate import reset_decoders
    from ..patch.sparsify import sparsify, unsparsify, with_mode
    from .speedonly import private_copy, retarget

    tps = []
    if block.spec is not None:
        sparsify(block.model, with_mode(block.spec, "prac", block.art), block.points[0][1],
                 artifacts=private_copy(block.art), path=path)
    try:
        with _fast_step(block.model, fast):
            for row, k in block.points:
                bar.set_postfix_str(f"{row['method']} k={k:g}" if k is not None else row["method"])
                if k is not None:
                    retarget(block.model, block.art, k)
                tps.append(_time(block.model, prompt, s, harness))
                bar.update(1)
    finally:
        reset_decoders()
        if block.spec is not None:
            unsparsify(block.model)
    return tps


def operating_points(model, tokenizer, settings: BenchSettings, model_name: str = "model", log=print,
                     progress: bool = True) -> list[dict]:
    """One row per configuration with :data:`COLUMNS`: dense (the model as loaded) first, then each skipping spec
    x k on the model as loaded, then, where ``settings.int4`` or a dual[mixed] spec asks for it, the dense row of a
    4-bit copy (``weights`` "int4"), then each dual[mixed] spec x k on its own copy with the other Linears 4-bit
    (``weights`` "nested8+int4"; the other rows' ``weights`` is the dtype as loaded). See the module docstring.

    ``tokenizer`` None (or ``settings.speed_only``) measures speed only, with speed-only artifacts:
    the quality columns are left empty and ``quality`` says ``speed only``. Specs this library cannot
    run are skipped with the reason logged. Quality first, then the alternated timings (see the module docstring)."""
    from tqdm.auto import tqdm

    s = settings
    speed_only = s.speed_only or tokenizer is None
    device = next(model.parameters()).device
    cuda = device.type == "cuda"
    harness, path = ("compile-cdt", "auto") if cuda else ("eager", "gather")
    device_name = torch.cuda.get_device_name(device) if cuda else "cpu"
    model.generation_config.eos_token_id = None  # every run decodes exactly new_tokens
    held = None
    if not speed_only:
        from .quality import held_out

        held = held_out(model, tokenizer, texts=s.texts, max_tokens=s.ppl_tokens, window=s.window)
    prompt = torch.randint(0, model.config.vocab_size, (s.batch, s.prompt),
                           generator=torch.Generator().manual_seed(3)).to(device)
    specs = [spec.resolved() for spec in map(parse_spec, s.specs) if not spec.is_dense]
    mixed = [spec for spec in specs if spec.kind == "mixed"]
    skipping = [spec for spec in specs if spec.kind != "mixed"]
    int4 = s.int4 or bool(mixed)
    bar = tqdm(total=len(specs) + (1 if int4 else 0), desc="countdown bench: quality", disable=not progress)
    base = {"model": model_name, "device": device_name, "date": datetime.date.today().isoformat(), "batch": s.batch,
            "new_tokens": s.new_tokens, "harness": harness,
            "quality": "speed only (random weights)" if speed_only else "decode-style ppl, KL",
            "weights": str(next(model.parameters()).dtype).replace("torch.", "")}
    dense_ppl = None if held is None else held.dense_ppl
    dense_row = {**base, "method": "dense", "sparsity": 0.0, "sparsity_real": 0.0, "ppl_increase": 0.0 if dense_ppl else "",
                 "kl": 0.0 if dense_ppl else "", "top1": 1.0 if dense_ppl else "", "ppl": dense_ppl or "",
                 "dense_ppl": dense_ppl or "", "path": "dense", "artifacts": "", "mlp_bits": dense_mlp_bits(model)}
    blocks = [block for spec in skipping for block in _spec_block(model, tokenizer, spec, s, held, prompt, path, base,
                                                                  bar, log)]
    if int4:
        blocks.append(_int4_block(model, tokenizer, s, held, base, int4_group(s, mixed)))
        bar.update(1)
    for spec in mixed:
        blocks += _mixed_block(model, tokenizer, spec, s, held, prompt, path, base, bar, log)
    bar.close()
    fast = cuda and s.fast_step
    points = sum(len(b.points) for b in blocks)
    bar = tqdm(total=s.samples * (1 + points) + 1, desc="countdown bench: speed, alternated", disable=not progress)
    dense_block = _Block(model, None, None, [(dense_row, None)])
    dense_tps = _run_block(dense_block, prompt, s, fast, harness, path, bar)
    sparse_tps = [[] for _ in range(points)]
    for _ in range(s.samples):
        timed = [t for block in blocks for t in _run_block(block, prompt, s, fast, harness, path, bar)]
        for runs, t in zip(sparse_tps, timed):
            runs.append(t)
        dense_tps += _run_block(dense_block, prompt, s, fast, harness, path, bar)
    bar.close()
    middle = statistics.median(dense_tps)
    dense_row.update(decode_speedup=1.0, tokens_per_s=middle, dense_tokens_per_s=middle, samples=len(dense_tps),
                     speedup_min=min(dense_tps) / middle, speedup_max=max(dense_tps) / middle)
    rows = [dense_row]
    for (row, _), speed in zip((p for b in blocks for p in b.points), paired_speedups(dense_tps, sparse_tps)):
        row.update(speed)
        rows.append(row)
        if row["weights"] in QUANTIZED:
            log(f"{QUANTIZED[row['weights']]}, {row['method']}"
                f"{'' if row['method'] == 'dense' else ' k = ' + format(row['sparsity'], 'g')}: "
                f"{row['mlp_bits']:.2f} bits read per MLP weight, {row['tokens_per_s']:.1f} tokens/s, "
                f"{row['decode_speedup']:.2f}x the loaded model"
                + ("" if row["ppl_increase"] == "" else f", perplexity {100 * row['ppl_increase']:+.1f} %"))
    return rows


def int4_group(s: BenchSettings, mixed: list[Spec]) -> int:
    """The dense 4-bit row's group: ``s.int4_group``, else the dual[mixed] specs' (the first one's where they
    differ), else :data:`INT4_GROUP`."""
    if s.int4_group is not None:
        return s.int4_group
    from ..selectors.base import get_kind

    groups = [int(spec.options.get("group", get_kind("mixed").defaults["group"])) for spec in mixed]
    return groups[0] if groups else INT4_GROUP


def _mlp_weights(model) -> list:
    """(d_model, d_inter, its Linear modules: gate, up, down, or a fused gate_up and down) of each Gated-MLP."""
    from ..model.gated_mlp import find_gated_mlps

    return [(g.d_model, g.d_inter, [getattr(g.module, name) for name in ((g.fused, g.down) if g.fused is not None
                                                                         else (g.gate, g.up, g.down))])
            for g in find_gated_mlps(model)]


def _module_bytes(module) -> int:
    """Bytes a dense read of one MLP Linear takes: a 4-bit one's codes and scales, a nested one's planes as it reads
    them, a float one's weight."""
    from ..int4.linear import Int4Linear
    from ..int4.nested_linear import NestedLinear

    if isinstance(module, Int4Linear):
        return module.int4.nbytes
    if isinstance(module, NestedLinear):
        return module.nested.nbytes if module.read == "both" else module.nested.nbytes // 2
    return module.weight.numel() * module.weight.element_size()


def dense_mlp_bits(model) -> float:
    """Bits a dense decode step of ``model`` reads per MLP weight (its MLPs' modules as held)."""
    mlps = _mlp_weights(model)
    return 8 * sum(_module_bytes(m) for _, _, parts in mlps for m in parts) / sum(3 * d * i for d, i, _ in mlps)


def kind_mlp_bits(model, art, kept: float) -> float:
    """Bits a decode step reads per MLP weight through an SP-Prac artifact's kind at kept share ``kept`` (of the
    MLP's rows: 1 - Sparsity-Real): its ``weight_bytes`` summed over the MLPs, in the model's element size."""
    from ..selectors.base import get_kind

    kind = get_kind(art.kind)
    elem = next(model.parameters()).element_size()
    mlps = _mlp_weights(model)
    total = sum(kind.weight_bytes(d, i, min(max(kept, 0.0), 1.0), elem, art.meta) for d, i, _ in mlps)
    return 8 * total / sum(3 * d * i for d, i, _ in mlps)


def _spec_block(model, tokenizer, spec, s: BenchSettings, held, prompt, path: str, base: dict, bar,
                log, after=None) -> list[_Block]:
    """The timing block of one spec on ``model`` (its rows at every k, quality filled in), or none where the spec
    cannot be built here (logged). ``after(model, art)``: called once the artifact is built, before any row (the
    mixed copy's other Linears are quantized there)."""
    from ..decode.generate import reset_decoders
    from ..patch.sparsify import sparsify, unsparsify, with_mode
    from .speedonly import SpecUnavailable, private_copy

    speed_only = s.speed_only or tokenizer is None
    dense_ppl = None if held is None else held.dense_ppl
    bar.set_postfix_str(spec.label)
    try:
        art, art_label = _artifacts(model, tokenizer, spec, s, speed_only)
    except (SpecUnavailable, ValueError, TypeError) as error:
        log(f"skipping {spec.label}: {type(error).__name__}: {str(error)[:200]}")
        bar.update(1)
        return []
    if after is not None:
        after(model, art)
    block = _Block(model, spec, art)
    for k in sorted(s.ks, reverse=True):
        if speed_only:
            from .measure import kept_fractions

            sparsify(model, with_mode(spec, "prac", art), k, artifacts=private_copy(art), path="masked")
            try:
                q = {"sparsity_real": 1 - kept_fractions(model, prompt, 16)[0]}
            finally:
                unsparsify(model)
                reset_decoders()
        else:
            q = _quality(model, spec, k, art, held)
        real = round(q["sparsity_real"], 4)  # as the table gives it: the bits below are that share's arithmetic
        block.points.append(({**base, "method": spec.label, "sparsity": k, "sparsity_real": real,
                              "ppl_increase": "" if speed_only else q["ppl"] / dense_ppl - 1,
                              "kl": "" if speed_only else q["kl"], "top1": "" if speed_only else q["top1"],
                              "ppl": "" if speed_only else q["ppl"], "dense_ppl": dense_ppl or "", "path": path,
                              "artifacts": art_label,
                              "mlp_bits": kind_mlp_bits(model, art, 1 - real)}, k))
    bar.update(1)
    return [block]


def _mixed_block(model, tokenizer, spec, s: BenchSettings, held, prompt, path: str, base: dict, bar,
                 log) -> list[_Block]:
    """A dual[mixed] spec on a copy of ``model`` made as a user makes it: ``prepare`` (the MLPs nested), then
    ``countdown.quantize(group=G, lm_head=True)`` (every other Linear 4-bit, G the spec's group), then its rows;
    scored against the model as loaded (``held``)."""
    import copy

    from ..int4 import quantize
    from ..model.gated_mlp import find_gated_mlps
    from ..selectors.base import get_kind

    def rest_in_4_bits(copied, art):
        get_kind(art.kind).prepare_model(copied, find_gated_mlps(copied), art.meta)  # nested (prepare did, or this)
        quantize(copied, group=int(art.meta["group"]), lm_head=True)

    return _spec_block(copy.deepcopy(model), tokenizer, spec, s, held, prompt, path,
                       {**base, "weights": MIXED_WEIGHTS}, bar, log, after=rest_in_4_bits)


def _int4_block(model, tokenizer, s: BenchSettings, held, base: dict, group: int = INT4_GROUP) -> _Block:
    """The dense row of a copy of ``model`` quantized to 4 bits (every decoder Linear and lm_head, RTN groups of
    ``group``), scored against the model as loaded (``held``): what a user gets from 4-bit weights alone."""
    import copy

    from ..int4 import quantize
    from .quality import compare_held, held_out

    quantized = quantize(copy.deepcopy(model), group=group, lm_head=True)
    q = None
    if held is not None:
        q = compare_held(held, held_out(quantized, tokenizer, texts=s.texts, max_tokens=s.ppl_tokens, window=s.window))
    row = {**base, "method": "dense", "sparsity": 0.0, "sparsity_real": 0.0,
           "ppl_increase": "" if q is None else q["ppl_increase"], "kl": "" if q is None else q["kl"],
           "top1": "" if q is None else q["top1"], "ppl": "" if q is None else q["ppl"],
           "dense_ppl": "" if held is None else held.dense_ppl, "path": "int4", "artifacts": f"RTN g{group}",
           "weights": "int4", "mlp_bits": dense_mlp_bits(quantized), "group": group}
    return _Block(quantized, None, None, [(row, None)])
