"""Arguments and parsing shared by the command-line commands."""

from __future__ import annotations

import argparse

from ..options import add_number


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m",
                   help="catalogue name, .gguf file, Hugging Face folder or hub id: a catalogue name if it is one, "
                        "else a path if it exists, else a hub id org/name (default: smollm2-135m)")
    p.add_argument("--dtype", default="auto", help="fp32, bf16, fp16 or auto: bf16 on cuda, fp32 on cpu (default auto)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")


def add_sparse_args(p: argparse.ArgumentParser, default_scope: str | None = "decode") -> None:
    """--method, --sparsity, --mode (deprecated), --artifacts, and --scope unless ``default_scope`` is None."""
    p.add_argument("--method", default="mono",
                   help="a method spec: dense, cats, mono, dual, dejavu, teal (or m-countdown, d-countdown) for SP-Ideal, "
                        "or a method and its SP-Prac kind, e.g. 'dual[shadow4]', 'mono[threshold]', 'dual[lowrank]' "
                        "(SP-Prac, with --artifacts; `countdown methods` lists them; default mono)")
    add_number(p, "--sparsity", "-k", range="sparsity", default=0.8,
               help="fraction of rows skipped per token (teal: of the entries of x and of s; default 0.8)")
    p.add_argument("--mode", default=None, choices=["ideal", "prac"],
                   help="deprecated: the spec says it (a plain method is SP-Ideal, a kind in brackets SP-Prac); "
                        "prac with a plain method takes the artifact's kind (default none)")
    if default_scope is not None:
        p.add_argument("--scope", default=default_scope, choices=["decode", "all"],
                       help=f"decode: prompt dense, generated tokens sparse; all: every position sparse "
                            f"(default {default_scope})")
    p.add_argument("--artifacts", default=None,
                   help="the SP-Prac spec's thresholds/predictors file, a path (default none; needed by a spec "
                        "with a kind)")


def load_text_arg(source: str | None):
    """``--texts``: None (the command's default text), else the texts of a source name or a .txt / .jsonl file,
    read now, before the model load (the rule of countdown.data.texts.as_texts)."""
    if source is None:
        return None
    from ..data.texts import load_texts

    return load_texts(source)


def check_model_arg(name: str) -> None:
    """Before the load: a ``--model`` folder without a tokenizer (or a random-weights shape) stops here, for the
    commands that tokenize text. What is no model at all is load_model's first answer (model_source), before
    anything slow, and is left to it."""
    from ..data.models import NoTokenizerError, check_tokenizer_source

    try:
        check_tokenizer_source(name)
    except NoTokenizerError:
        raise
    except (ValueError, FileNotFoundError):
        pass
