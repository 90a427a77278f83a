"""The ``countdown`` command line: a thin shell over the Python API."""

from __future__ import annotations

import argparse
import json
import sys


def _sparsities(text: str) -> list[float]:
    from .registry import check_sparsity

    return [check_sparsity(part) for part in text.split(",") if part.strip()]


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m",
                   help="catalogue name, .gguf file, Hugging Face folder or hub id (default: smollm2-135m)")
    p.add_argument("--dtype", default="fp32", help="fp32, bf16 or fp16 (default fp32)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")


def _sparse_args(p: argparse.ArgumentParser, default_scope: str = "decode") -> None:
    p.add_argument("--method", default="mono", help="dense, cats, mono, dual, dejavu (or m-countdown, d-countdown)")
    p.add_argument("--sparsity", "-k", type=float, default=0.8, help="fraction of rows skipped per token, in (0, 1)")
    p.add_argument("--mode", default="ideal", choices=["ideal", "prac"])
    p.add_argument("--scope", default=default_scope, choices=["decode", "all"],
                   help="decode: prompt dense, generated tokens sparse; all: every position sparse")
    p.add_argument("--artifacts", default=None, help="thresholds/predictors for --mode prac")


def _texts(source: str | None):
    if source is None:
        return None
    from .data import load_texts

    return load_texts(source)


def cmd_methods(args) -> int:
    from .registry import get_method, methods

    for name in methods():
        m = get_method(name)
        aliases = f"  (aliases: {', '.join(m.aliases)})" if m.aliases else ""
        print(f"{name:<8} {m.description}{aliases}")
    return 0


def cmd_ppl(args) -> int:
    import countdown

    model, tok = countdown.load_model(args.model, dtype=args.dtype, device=args.device)
    method = countdown.get_method(args.method)
    countdown.sparsify(model, method.name, None if method.is_dense else args.sparsity, mode=args.mode,
                       scope=args.scope, artifacts=args.artifacts)
    ppl = countdown.perplexity(model, tok, texts=_texts(args.texts), max_tokens=args.max_tokens,
                               window=args.window)
    result = {"model": args.model, "method": method.name, "mode": args.mode, "scope": args.scope,
              "sparsity": None if method.is_dense else args.sparsity, "perplexity": ppl,
              "sparsity_real": None if method.is_dense else countdown.sparsity_real(model)["mean"],
              "tokens": args.max_tokens}
    if args.json:
        print(json.dumps(result))
    else:
        real = "" if method.is_dense else f"   Sparsity-Real {result['sparsity_real']:.3f}"
        print(f"{method.name} {args.mode} k={result['sparsity']} scope={args.scope}: perplexity {ppl:.3f}{real}")
    return 0


def cmd_generate(args) -> int:
    import countdown
    from .demo import chat_prompt

    model, tok = countdown.load_model(args.model, dtype=args.dtype, device=args.device)
    method = countdown.get_method(args.method)
    countdown.sparsify(model, method.name, None if method.is_dense else args.sparsity, mode=args.mode,
                       scope="decode", artifacts=args.artifacts,
                       path="gather" if args.device == "cpu" else "masked")
    ids = chat_prompt(tok, args.prompt).to(next(model.parameters()).device)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    out = model.generate(ids, attention_mask=ids.new_ones(ids.shape), max_new_tokens=args.max_new_tokens,
                         do_sample=args.temperature > 0, temperature=args.temperature or None, pad_token_id=pad)
    print(tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
    return 0


def cmd_demo(args) -> int:
    from .demo import run_demo

    run_demo(args.model, sparsities=_sparsities(args.sparsities), max_tokens=args.max_tokens, out_dir=args.out)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="countdown", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("methods", help="list the sparsification methods")
    p.set_defaults(func=cmd_methods)

    p = sub.add_parser("ppl", help="perplexity of a (sparsified) model on held-out text")
    _model_args(p)
    _sparse_args(p, default_scope="all")
    p.add_argument("--max-tokens", type=int, default=8192)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--texts", default=None, help="xsum (default), wiki, or a .txt/.jsonl file")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_ppl)

    p = sub.add_parser("generate", help="generate from a prompt, prompt dense and new tokens sparse")
    _model_args(p)
    _sparse_args(p)
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("demo", help="the main job: every method at several sparsities on the default model")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--sparsities", default="0.5,0.7,0.8,0.9")
    p.add_argument("--max-tokens", type=int, default=4096, help="tokens of XSum per perplexity")
    p.add_argument("--out", default="demo_out", help="folder for demo.md / demo.csv / demo.png")
    p.set_defaults(func=cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, RuntimeError, FileNotFoundError) as err:
        print(f"countdown {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
