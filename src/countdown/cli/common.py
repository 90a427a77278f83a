"""Arguments and parsing shared by the command-line commands."""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import sys
import warnings

from ..options import add_device_arg, add_number


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m",
                   help="catalogue name, .gguf file, Hugging Face folder or hub id: a catalogue name if it is one, "
                        "else a path if it exists, else a hub id org/name (default: smollm2-135m)")
    p.add_argument("--dtype", default="auto", help="fp32, bf16, fp16 or auto: bf16 on cuda, fp32 on cpu (default auto)")
    add_device_arg(p)


AS_SAVED = ("a folder saved sparsified (countdown.save) runs as saved unless --method is given: its spec, k, scope "
            "and artifact fill the options not given; --method sparsifies its saved weights as the options say")


def add_sparse_args(p: argparse.ArgumentParser, default_scope: str | None = "decode", method: str = "mono",
                    sparsity: float = 0.8, built_artifacts: bool = False) -> None:
    """--method, --sparsity, --mode (deprecated), --artifacts, and --scope unless ``default_scope`` is None; ``method``
    and ``sparsity`` are the defaults (a folder saved sparsified given as --model fills them instead:
    :func:`fill_sparse_args`, :data:`AS_SAVED`). ``built_artifacts``: a spec naming its SP-Prac kind without
    --artifacts builds the artifact once and caches it (``args.build_artifacts``), as ``countdown demo`` and
    ``countdown bench`` do."""
    p.set_defaults(default_method=method, default_sparsity=sparsity, default_scope=default_scope)
    p.add_argument("--method", default=None,
                   help="a method spec: dense, cats, mono, dual, dejavu, teal (or m-countdown, d-countdown) for SP-Ideal, "
                        "or a method and its SP-Prac kind, e.g. 'dual[shadow4]', 'mono[threshold]', 'dual[lowrank]' "
                        f"(SP-Prac, with --artifacts; `countdown methods` lists them; default {method}; {AS_SAVED})")
    add_number(p, "--sparsity", "-k", range="sparsity", default=None,
               help=f"fraction of rows skipped per token (teal: of the entries of x and of s; default {sparsity:g})")
    p.add_argument("--mode", default=None, choices=["ideal", "prac"],
                   help="deprecated: the spec says it (a plain method is SP-Ideal, a kind in brackets SP-Prac); "
                        "prac with a plain method takes the artifact's kind (default none)")
    if default_scope is not None:
        p.add_argument("--scope", default=None, choices=["decode", "all"],
                       help=f"decode: prompt dense, generated tokens sparse; all: every position sparse "
                            f"(default {default_scope})")
    if built_artifacts:
        p.set_defaults(build_artifacts=True)
        p.add_argument("--artifacts", default=None,
                       help="the SP-Prac spec's thresholds/predictors file, a path (default: for a spec naming its "
                            "SP-Prac kind, e.g. 'dual[shadow4]', built on first use from the library's calibration "
                            "text and cached; else none)")
        return
    p.add_argument("--artifacts", default=None,
                   help="the SP-Prac spec's thresholds/predictors file, a path (default none; needed by a spec "
                        "with a kind)")


def fill_sparse_args(args) -> None:
    """--method, --sparsity, --scope and --artifacts as the command runs them (:data:`AS_SAVED`): a folder saved
    sparsified given as --model, without --method, fills the options not given with its saved configuration;
    otherwise the command's defaults do. With --method, a note on stderr says that the saved sparsity is replaced."""
    saved = _saved_sparsity(args.model)
    if saved is not None and args.method is None:
        label, k, scope, artifact = saved
        args.method = label
        args.sparsity = k if args.sparsity is None else args.sparsity
        args.artifacts = artifact if args.artifacts is None else args.artifacts
        if getattr(args, "scope", None) is None and args.default_scope is not None:
            args.scope = scope
        return
    if saved is not None:
        print(f"countdown {args.command}: {args.model} was saved sparsified ({saved[0]}, k={saved[1]:g}); --method "
              "replaces that: its saved weights are sparsified as the options say", file=sys.stderr)
    args.method = args.default_method if args.method is None else args.method
    args.sparsity = args.default_sparsity if args.sparsity is None else args.sparsity
    if getattr(args, "scope", None) is None and args.default_scope is not None:
        args.scope = args.default_scope


def _saved_sparsity(model: str) -> tuple[str, float, str, str | None] | None:
    """(spec, k, scope, artifact path) of a folder saved sparsified, or None (not a folder, or not sparsified)."""
    from pathlib import Path

    from ..data.models import model_source
    from ..model.saving import saved_config
    from ..patch.sparsify import with_mode

    try:
        kind, where = model_source(model)
    except (ValueError, FileNotFoundError, TypeError):
        return None  # load_model says what is wrong with it, after the other checks
    record = saved_config(where) if kind == "folder" else None
    if record is None or record.get("spec") is None:
        return None
    artifact = str(Path(where) / record["artifacts"]) if record.get("artifacts") else None
    return with_mode(record["spec"], record.get("mode"), artifact).label, record["k"], record["scope"], artifact


def load_saved_weights(args):
    """``(model, tokenizer)`` of --model with its saved weights alone: a folder saved sparsified comes un-sparsified
    (the command sparsifies it as its options say, :func:`fill_sparse_args`)."""
    import countdown

    model, tok = countdown.load_model(args.model, dtype=args.dtype, device=args.device)
    if countdown.is_sparsified(model):
        countdown.unsparsify(model)
    return model, tok


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


@contextlib.contextmanager
def warnings_as_lines(command: str):
    """While a command runs, countdown's own warnings (a text shorter than asked for, ...) print as one line,
    ``countdown <command>: warning: ...``, not as Python's ``file:line: Category: ...`` with a source line; other
    libraries' warnings print as they always do."""
    with warnings.catch_warnings():
        shown = warnings.showwarning
        package = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep

        def show(message, category, filename, lineno, file=None, line=None):
            if not os.path.abspath(filename).startswith(package):
                return shown(message, category, filename, lineno, file, line)
            print(f"countdown {command}: warning: {' '.join(str(message).split())}", file=file or sys.stderr)

        warnings.showwarning = show
        yield


_SPARSIFIED = ("--model names a model saved sparsified (countdown.save keeps its sparsity); this command needs it "
               "dense: give the dense model (its catalogue name, .gguf file or folder) as --model")
_TOKENIZER = "(tokenizer.json, tokenizer_config.json, ... from the model it came from)"

# The API's Python advice, and what the same error says on the command line (the model there is --model's, the
# options are flags). Each pattern replaces the clause it matches, or the whole message where it says so.
SHELL_ADVICE: list[tuple[re.Pattern, str]] = [
    (re.compile(r".*call countdown\.unsparsify\(model\)[^;:]*|.*\(countdown\.unsparsify first\).*"
                r"|.*or countdown\.unsparsify\(model\) first.*", re.S), _SPARSIFIED),
    (re.compile(r" \(force=True\)"), ""),
    (re.compile(r"pass (\S+) \(([a-z_]+)=\.\.\.\)"), r"pass \1"),
    (re.compile(r"\(tokenizer\.save_pretrained\(folder\)\), or pass the tokenizer"), _TOKENIZER),
    (re.compile(r"pass --checkpoint DIR \(checkpoint=\.\.\.\)"), "pass --checkpoint DIR"),
]


def shell_advice(message: str) -> str:
    """``message`` (an error of the Python API) with its Python advice replaced by the command line's: what a
    command prints, so that no shell user is told to call ``countdown.unsparsify(model)``."""
    for pattern, replacement in SHELL_ADVICE:
        message = pattern.sub(replacement, message)
    return message
