"""The SP-Prac commands of the command line: ``calibrate``, ``train`` and ``quality``.

Each output path is checked (writable; not a file of another kind unless ``--force``) and locked for
the whole run before the model is even loaded, so a bad ``--out`` fails in a second and a second run
on the same ``--out`` stops at once instead of both printing "wrote".
"""

from __future__ import annotations

import json

from ..options import add_number, path_option
from .common import add_model_args, check_model_arg, load_text_arg


def _artifact_out(args, slug: str, ks: list[float]):
    """The output path, checked before any work: writable, and not a file of another kind."""
    from pathlib import Path

    from ..artifacts.store import refuse_foreign
    from ..io import check_writable

    label = "_".join(f"{k:g}" for k in ks)
    path = Path(args.out if args.out is not None else f"{slug}-{args.model.replace('/', '_')}-k{label}.safetensors")
    check_writable(path)  # first: a name too long, a read-only file or folder, a path under a file
    if not args.force:
        refuse_foreign(path)
    return path


def _summarise_artifact(art, path) -> None:
    from ..spec import artifact_spec

    meta = art.meta
    print(f"wrote {path}: {meta['method']} {meta['kind']} ({artifact_spec(art).label}), k = "
          f"{', '.join(f'{k:g}' for k in art.sparsities)}, {meta['data']['num_tokens']} tokens of {meta['data']['name']}")


def _build_artifact(args, build) -> int:
    """Check the output (and a checkpoint folder), lock them for the run, build with
    ``build(model, tok, spec, kind, ks)`` (``kind``: --kind, else the spec's, else None), save."""
    import contextlib
    from pathlib import Path

    import countdown
    from ..io import check_writable_dir, file_lock
    from ..artifacts.prepare import TRAINED
    from ..spec import build_options, parse_spec

    # the spec and method checks before the (slow) model load
    spec = parse_spec(args.method)
    method = countdown.get_method(spec.method)
    _, kind, _ = build_options(spec, args.kind, {})  # --kind against the brackets
    if args.command == "calibrate" and kind is None and method.prac != "threshold":
        raise ValueError(f"method {method.name!r} does not use calibrated thresholds: use `countdown train` "
                         f"(or `countdown calibrate --method 'dual[shadow4]'` / --kind shadow for dual)")
    if args.command == "calibrate" and kind in TRAINED:
        raise ValueError(f"kind {kind!r} is gradient-trained: use `countdown train`")
    if args.command == "train" and method.prac != "predictor":
        raise ValueError(f"method {method.name!r} does not use a trained predictor: use `countdown calibrate`")
    ks = args.sparsity  # parsed and checked by argparse (countdown.options.sparsities)
    out = _artifact_out(args, spec.slug, ks)
    checkpoint = getattr(args, "checkpoint", None)
    if checkpoint is not None:
        check_writable_dir(checkpoint, "--checkpoint")
    check_model_arg(args.model)
    args.texts = load_text_arg(args.texts)  # a wrong --texts stops here, before the model load
    with contextlib.ExitStack() as locks:  # a second run on the same --out stops now, not after the work
        locks.enter_context(file_lock(out, what="artifact"))
        if checkpoint is not None:  # the training takes this lock again (re-entrant): same file
            locks.enter_context(file_lock(Path(checkpoint) / "config.json", what="checkpoint folder"))
        model, tok = countdown.load_model(args.model, dtype=args.dtype, device=args.device)
        art = build(model, tok, spec, kind, ks)
        art.save(out, force=args.force)
    _summarise_artifact(art, out)
    return 0


def _kind_options(args, names) -> dict:
    return {name: getattr(args, name) for name in names if getattr(args, name, None) is not None}


def cmd_calibrate(args) -> int:
    import countdown

    def build(model, tok, spec, kind, ks):
        kind = kind or countdown.artifacts.prepare.default_kind(spec.method)
        names = {"threshold": ("rule",), "teal": ("allocation",)}.get(kind) or TRAIN_OPTIONS[kind]
        return countdown.prepare(model, tok, spec, ks, kind=args.kind, texts=args.texts,
                                 num_tokens=args.num_tokens, refine=not args.no_refine,
                                 **_kind_options(args, names))

    return _build_artifact(args, build)


# The options of `countdown train` that each kind takes.
TRAIN_OPTIONS = {"shadow": ("bits", "group", "cut_rule"), "hybrid": ("d_rank", "cut_rule")}
TRAINED_OPTIONS = ("d_rank", "epochs", "pos_weight", "init", "seed", "cut_rule")


def cmd_train(args) -> int:
    import countdown

    def build(model, tok, spec, kind, ks):
        kind = kind or countdown.artifacts.prepare.default_kind(spec.method)
        art = countdown.prepare(model, tok, spec, ks, kind=kind, texts=args.texts,
                                num_tokens=args.num_tokens, selection=args.selection,
                                checkpoint=args.checkpoint, refine=not args.no_refine,
                                **_kind_options(args, TRAIN_OPTIONS.get(kind, TRAINED_OPTIONS)))
        if args.refine_on_decode:
            _refine_on_decode(args, model, tok, art)
        return art

    return _build_artifact(args, build)


def _refine_on_decode(args, model, tok, art) -> None:
    import torch

    import countdown
    from ..data.texts import calibration_texts
    from ..selectors.stream import token_windows

    # prompts: 8 windows of 32 tokens of the calibration text; the model then writes 64 tokens each
    texts = args.texts or calibration_texts()
    windows = [w for w in token_windows(tok, texts, 8 * 32, 32, name=None) if w.shape[1] == 32][:8]
    history = countdown.refine_cuts_on_decode(model, art, torch.cat(windows), new_tokens=64,
                                              rounds=args.refine_on_decode)
    for k, rounds in history.items():
        print(f"k={k:g}: Sparsity-Real of the model's own decode steps per round "
              f"{', '.join(f'{v:.3f}' for v in rounds)} (cuts re-fitted after each)")


def cmd_quality(args) -> int:
    import countdown
    from ..artifacts.store import footprint, load_artifacts

    art = load_artifacts(args.artifacts)
    if args.selection:
        art = art.with_selection(args.selection)
    check_model_arg(args.model)
    texts = load_text_arg(args.texts)
    model, tok = countdown.load_model(args.model, dtype=args.dtype, device=args.device)
    report = countdown.predictor_quality(model, tok, art, texts=texts, num_tokens=args.num_tokens)
    report["footprint"] = footprint(art, model)
    share = report["footprint"]["share"]
    if args.json:
        print(json.dumps(report, default=float))
        return 0
    print(f"{report['method']} {report['kind']} selection={report['selection']} on {report['num_tokens']} "
          f"held-out tokens; footprint {100 * share:.2f} % of the model's parameters")
    for k, r in report["by_sparsity"].items():
        print(f"  k={float(k):g}: precision {r['precision']:.3f}  recall {r['recall']:.3f}  F1 {r['f1']:.3f}  "
              f"skipped {r['sparsity']:.3f}")
    return 0


CALIB_TEXTS_HELP = "calibration text: wiki (default), xsum, or a .txt/.jsonl file (a source name if it is one, else a path)"


def _shadow_numbers(p) -> None:
    add_number(p, "--bits", range="bits", default=None, help="shadow: bits per weight (default 4)")
    add_number(p, "--group", range="group", default=None,
               help="shadow: quantization group along d_model, a divisor of it (default 64)")


def add_prac_commands(sub) -> None:
    """Add ``calibrate``, ``train`` and ``quality`` to the subparsers ``sub``."""
    out_help = "artifact path (default <method spec>-<model>-k<k>.safetensors in the current folder, e.g. dual-shadow3-...)"
    force_help = "replace --out even if it is not a countdown artifact (default: refuse)"
    p = sub.add_parser("calibrate", help="SP-Prac artifacts without training: thresholds for cats / mono / teal "
                                         "(several k from one pass); with --kind shadow or hybrid, dual's")
    add_model_args(p)
    p.add_argument("--method", default="mono", help="a method spec: cats, mono or teal; dual with its kind, "
                                                  "'dual[shadow4]' or 'dual[hybrid]' (default mono)")
    add_number(p, "--sparsity", "-k", range="sparsities", default="0.7,0.8,0.9",
               help="comma-separated k (default 0.7,0.8,0.9)")
    p.add_argument("--kind", default=None, choices=["threshold", "shadow", "hybrid", "teal"],
                   help="threshold (default for cats / mono), shadow or hybrid (dual needs one of these two, here "
                        "or in --method's brackets), teal (teal's own, its default)")
    p.add_argument("--texts", default=None, help=CALIB_TEXTS_HELP)
    add_number(p, "--num-tokens", range="num_tokens", default=None,
               help="calibration tokens (default 4096 for thresholds, 8192 otherwise)")
    p.add_argument("--rule", default=None, choices=["mean-quantile", "pooled"],
                   help="threshold rule (default mean-quantile, the paper's)")
    p.add_argument("--allocation", default=None, choices=["greedy", "uniform"],
                   help="teal: per-layer split of k between x and s, TEAL's greedy or uniform (default greedy)")
    _shadow_numbers(p)
    p.add_argument("--cut-rule", default=None, choices=["mean-quantile", "pooled"],
                   help="shadow / hybrid cut rule (default mean-quantile)")
    p.add_argument("--no-refine", action="store_true", help="cuts from the dense model only (the paper; default: refined)")
    p.add_argument("--out", default=None, type=path_option, help=out_help)
    p.add_argument("--force", action="store_true", help=force_help)
    p.set_defaults(func=cmd_calibrate)

    p = sub.add_parser("train", help="SP-Prac predictors for dual / dejavu, streamed layer by layer (resumable)")
    add_model_args(p)
    p.add_argument("--method", default="dual", help="a method spec: dual or dejavu, or with its kind, e.g. "
                                                  "'dual[lowrank256]', 'dejavu[ternary]' (default dual)")
    add_number(p, "--sparsity", "-k", range="sparsities", default="0.7,0.8,0.9",
               help="comma-separated k (default 0.7,0.8,0.9)")
    p.add_argument("--kind", default=None, choices=["lowrank", "ternary", "hybrid", "shadow"],
                   help="predictor kind, also writable in --method's brackets (default: shadow for dual, lowrank "
                        "for dejavu)")
    add_number(p, "--d-rank", range="d_rank", default=None, help="rank (default 64 lowrank, 128 hybrid)")
    add_number(p, "--epochs", range="epochs", default=None, help="training epochs (default 2)")
    add_number(p, "--pos-weight", range="pos_weight", default=None,
               help="BCE weight of kept rows, > 1 weighs them up for recall (default none)")
    p.add_argument("--init", default=None, choices=["gate", "random"], help="predictor start (default gate)")
    _shadow_numbers(p)
    p.add_argument("--selection", default="cut", choices=["cut", "logit", "topk"], help="run-time rule (default cut)")
    p.add_argument("--cut-rule", default=None, choices=["mean-quantile", "pooled"], help="cut rule (default mean-quantile)")
    add_number(p, "--seed", range="seed", default=None, help="training seed (default 42)")
    p.add_argument("--texts", default=None, help=CALIB_TEXTS_HELP)
    add_number(p, "--num-tokens", range="num_tokens", default=None, help="calibration tokens (default 8192)")
    p.add_argument("--no-refine", action="store_true", help="cuts from the dense model only (default: refined)")
    add_number(p, "--refine-on-decode", range="refine_on_decode", default=0, metavar="ROUNDS",
               help="then re-fit the cuts on the sparse model's own greedy continuations of 8 calibration "
                        "prompts (lowrank / ternary / shadow; rounds, default 0 = off): Sparsity-Real at decode "
                        "time = k")
    p.add_argument("--checkpoint", default=None, type=path_option, help="folder: finished layers are kept, a rerun resumes (default none)")
    p.add_argument("--out", default=None, type=path_option, help=out_help)
    p.add_argument("--force", action="store_true", help=force_help)
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("quality", help="precision / recall / F1 of SP-Prac masks against SP-Ideal, and footprint")
    add_model_args(p)
    p.add_argument("--artifacts", required=True, help="the artifact file to measure (required)")
    p.add_argument("--selection", default=None, choices=["cut", "logit", "topk"],
                   help="override the stored rule (default: the artifact's)")
    p.add_argument("--texts", default=None, help="held-out text: xsum (default), wiki, or a .txt/.jsonl file")
    add_number(p, "--num-tokens", range="num_tokens", default=4096, help="held-out tokens (default 4096)")
    p.add_argument("--json", action="store_true", help="print one JSON object (default: a table)")
    p.set_defaults(func=cmd_quality)
