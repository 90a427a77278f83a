"""The valid range of every numeric argument, in one table shared by the command line and the Python API.

:data:`RANGES` names each range once (``"max_tokens"``: an integer >= 2, ``"sparsity"``: a number in (0, 1),
...). The command line takes it as an argparse ``type`` (:func:`add_number`, :func:`number`): a value out of
range stops the parse, before any model is loaded, with one line naming the option and the range, and the
option's ``--help`` states the range. The API functions call :func:`check` on the same names, so
``countdown.perplexity(..., max_tokens=-5)`` and ``countdown ppl --max-tokens -5`` say the same thing.
Ranges that depend on the model (a window no longer than its positions, a ``top_k`` within its vocabulary,
token ids within it, a ``group`` that divides ``d_model``) are checked where the model is known, before the work
(:func:`check_token_ids`, :func:`check_sampling`, :func:`check_at_most`). An integer too large for a float
(``10**400``) is out of range, never an OverflowError. Text shorter than a token count asks for is judged by one
rule, :func:`check_found`: below the range's minimum refused, below the request a :class:`ShortInputWarning`.

This module imports nothing from countdown (every layer may use it).
"""

from __future__ import annotations

import argparse
import math
import numbers
import sys
import warnings
from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class Range:
    """Integers (``integer=True``) or finite real numbers between ``low`` and ``high`` (None: unbounded),
    ends excluded where ``open_low`` / ``open_high``; or one of ``choices``. ``off``: one more value outside
    the interval that switches the thing off (``0`` for "skip"). ``fraction``: an integer >= 1 *or* a number
    in (0, 1) (lm-eval's ``limit``)."""

    integer: bool
    low: float | None = None
    high: float | None = None
    open_low: bool = False
    open_high: bool = False
    choices: tuple = ()
    off: Any = None
    off_means: str = ""
    fraction: bool = False

    @property
    def text(self) -> str:
        """The range in words: ``an integer >= 2``, ``a number in (0, 1)``, ``0 (off) or an integer >= 1``."""
        if self.choices:
            return "one of " + ", ".join(str(c) for c in self.choices)
        if self.fraction:
            return "an integer >= 1 or a fraction in (0, 1)"
        what = "an integer" if self.integer else "a number"
        if self.low is not None and self.high is not None:
            if self.integer and not self.open_low and not self.open_high:
                body = f"{what} from {_fmt(self.low)} to {_fmt(self.high)}"
            else:
                body = (f"{what} in {'(' if self.open_low else '['}{_fmt(self.low)}, {_fmt(self.high)}"
                        f"{')' if self.open_high else ']'}")
        elif self.low is not None:
            what = what if self.integer else "a finite number"
            body = f"{what} {'>' if self.open_low else '>='} {_fmt(self.low)}"
        elif self.high is not None:
            body = f"{what} {'<' if self.open_high else '<='} {_fmt(self.high)}"
        else:
            body = f"a finite {what[2:]}" if not self.integer else what
        if self.off is not None:
            return f"{_fmt(self.off)} ({self.off_means}) or {body}"
        return body

    def holds(self, value: float) -> bool:
        if self.off is not None and value == self.off:
            return True
        if self.choices:
            return value in self.choices
        if self.fraction:
            return value >= 1 and (isinstance(value, int) or float(value).is_integer()) or 0 < value < 1
        if self.low is not None and (value < self.low or self.open_low and value == self.low):
            return False
        return not (self.high is not None and (value > self.high or self.open_high and value == self.high))

    def check(self, value: Any, name: str) -> Any:
        """``value`` as an int (integer ranges) or a float; a TypeError for what is no number of the kind,
        a ValueError naming ``name`` and the range for a number outside it."""
        if isinstance(value, (str, bytes)) or isinstance(value, bool) or not isinstance(value, numbers.Real):
            hint = " (parse it first)" if isinstance(value, (str, bytes)) else ""
            raise TypeError(f"{name} must be {self.text}, got {type(value).__name__} {shown(value)}{hint}")
        if self.integer and not self.fraction and not isinstance(value, numbers.Integral):
            raise ValueError(f"{name} must be {self.text}, got {type(value).__name__} {shown(value)}")
        if isinstance(value, numbers.Integral) and self.integer:
            number = int(value)
        else:
            number = real(value)  # an integer too large for a float is +-inf here, not an OverflowError
        if not finite(number) or not self.holds(number):
            raise ValueError(f"{name} must be {self.text}, got {shown(value)}")
        if isinstance(number, int) and abs(number) > INT64_MAX:  # torch takes 64-bit integers at most
            raise ValueError(f"{name} must be {self.text} of at most 2^63 - 1, got {shown(value)}")
        if self.fraction and number >= 1:
            number = int(number)
        return number

    def parse(self, text: str) -> Any:
        """A command-line string as a number of this range (ValueError naming the range otherwise)."""
        try:
            value = int(text) if self.integer and not self.fraction else float(text)
        except ValueError:
            try:
                as_float = float(text)
            except ValueError:
                raise ValueError(f"must be {self.text}, got {text!r}") from None
            if self.integer and not as_float.is_integer():
                raise ValueError(f"must be {self.text}, got {text!r}") from None
            value = int(as_float) if self.integer else as_float
        if self.fraction and isinstance(value, float) and value >= 1 and value.is_integer():
            value = int(value)
        try:
            return self.check(value, "it")
        except (TypeError, ValueError):
            raise ValueError(f"must be {self.text}, got {text!r}") from None


def real(value: Any) -> float:
    """``float(value)``, with an integer beyond the floats' range as +-inf (``float(10**400)`` raises
    OverflowError): the range check then names the argument."""
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf


def finite(number: float) -> bool:
    return isinstance(number, int) or math.isfinite(number)


def shown(value: Any) -> str:
    """``repr(value)``, a huge integer as its first digits and length (``10**400`` is 401 digits)."""
    text = repr(value)
    return f"{text[:12]}... ({len(text)} digits)" if isinstance(value, int) and len(text) > 40 else text[:200]


def check_token_ids(ids: Any, model_or_vocab: Any, name: str = "input_ids") -> None:
    """Every token id in ``ids`` (a tensor or a sequence of ints) is in ``[0, vocab)``, the vocabulary of the
    model's input embeddings (or the int given): a ValueError naming ``name``, the id and the vocabulary, not an
    IndexError from inside the embedding. One host read of the ids' minimum and maximum."""
    vocab = model_or_vocab if isinstance(model_or_vocab, int) else _vocab(model_or_vocab)
    if vocab is None:
        return
    values = ids.reshape(-1) if hasattr(ids, "reshape") and hasattr(ids, "numel") else list(ids)
    if (values.numel() if hasattr(values, "numel") else len(values)) == 0:
        return
    low, high = int(min(values) if isinstance(values, list) else values.min()), \
        int(max(values) if isinstance(values, list) else values.max())
    if low < 0 or high >= vocab:
        bad = low if low < 0 else high
        raise ValueError(f"{name} holds token id {bad}, outside the model's vocabulary of {vocab} (ids 0 to "
                         f"{vocab - 1}): encode the text with this model's own tokenizer")


def _vocab(model: Any) -> int | None:
    embeddings = getattr(model, "get_input_embeddings", lambda: None)()
    size = getattr(embeddings, "num_embeddings", None)
    return size if isinstance(size, int) else getattr(getattr(model, "config", None), "vocab_size", None)


def check_sampling(top_k: Any = None, top_p: Any = None, seed: Any = None, model_or_vocab: Any = None) -> None:
    """The sampling arguments of a generate call, checked whether or not it samples (greedy decoding ignores
    them, but ``top_p=1.5`` is a mistake either way, as ``temperature=0`` is): ranges of :data:`RANGES`, and
    ``top_k`` at most the vocabulary of ``model_or_vocab`` (a model, or the vocabulary's size) where given."""
    check_all(top_p=top_p, seed=seed)
    vocab = model_or_vocab if isinstance(model_or_vocab, int) or model_or_vocab is None else _vocab(model_or_vocab)
    if top_k is not None and check("top_k", top_k) > (vocab if vocab is not None else math.inf):
        raise ValueError(f"top_k must be {RANGES['top_k'].text} and at most the vocabulary ({vocab}), got {top_k}")


def check_at_most(name: str, value: Any, bound_name: str, bound: int, why: str = "") -> None:
    """``value`` (of the argument ``name``) no larger than ``bound`` (the argument or quantity ``bound_name``)."""
    if value is not None and bound is not None and value > bound:
        raise ValueError(f"{name} must be at most {bound_name} ({bound}), got {shown(value)}" + (f": {why}" if why else ""))


class ShortInputWarning(UserWarning):
    """The text held fewer tokens than asked for (but at least the documented minimum): the run used them all and
    reports how many it used."""


def check_found(range_name: str, found: int, requested: int, name: str | None = None,
                what: str = "the texts") -> int:
    """Tokens ``found`` in the text against ``requested`` (the argument ``name``, of the range ``range_name``),
    the one rule of every function that reads a number of tokens of text and of the command line that calls it:
    fewer than the range's minimum (:data:`RANGES`: 2 for perplexity, 64 for calibration) is a ValueError; fewer
    than asked, a :class:`ShortInputWarning` (once per call), and the run goes on with what there is. Returns
    ``found``, the count the caller reports."""
    name = name or range_name
    low = RANGES[range_name].low
    if low is not None and found < low:
        raise ValueError(f"{what} hold {found} tokens, fewer than the {_fmt(low)} that {name} needs at least "
                         f"({RANGES[range_name].text}): give more text")
    if found < requested:
        warnings.warn(f"{what} hold {found} tokens, fewer than {name}={requested}: using those {found}",
                      ShortInputWarning, stacklevel=3)
    return found


def _fmt(value: float) -> str:
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    if isinstance(value, int) and value >= 2 ** 20 and (value + 1) & value == 0:
        return f"2^{(value + 1).bit_length() - 1} - 1"
    return str(value)


def _int(low=None, high=None, **kw) -> Range:
    return Range(True, low, high, **kw)


def _real(low=None, high=None, **kw) -> Range:
    return Range(False, low, high, **kw)


SEED_MAX = 2 ** 32 - 1
INT64_MAX = 2 ** 63 - 1

# name -> range. The names are the API's parameter names where one range serves one parameter.
RANGES: dict[str, Range] = {
    # what to sparsify
    "sparsity": _real(0, 1, open_low=True, open_high=True),
    # perplexity: tokens of held-out text and the window (at most the model's positions: checked with the model)
    "max_tokens": _int(2),
    "window": _int(4),
    "prompt_fraction": _real(0, 1, open_high=True),
    # calibration / training (prepare, calibrate, train_predictors) and mask quality
    "num_tokens": _int(64),
    "calib_window": _int(2),
    "refine_tokens": _int(1),
    "d_rank": _int(1),
    "epochs": _int(1),
    "pos_weight": _real(0, open_low=True),
    "bits": Range(True, choices=(2, 3, 4, 8)),
    "group": _int(1),
    "seed": _int(0, SEED_MAX),
    "lr": _real(0, open_low=True),
    "weight_decay": _real(0),
    "max_activation_gb": _real(0, open_low=True),
    "teal_step": _real(0, 0.25, open_low=True),
    "refine_on_decode": _int(1, off=0, off_means="off"),
    "rounds": _int(1),
    # generation
    "max_new_tokens": _int(1),
    "temperature": _real(0),
    "sample_temperature": _real(0, open_low=True),
    "top_k": _int(1),
    "top_p": _real(0, 1, open_low=True),
    # lm-eval, agreement, sweep
    "limit": Range(True, fraction=True),
    "limit_docs": _int(1),
    "batch_size": _int(1),
    "num_fewshot": _int(0),
    "bootstrap_iters": _int(0),
    "ppl_tokens": _int(2, off=0, off_means="skip"),
    "agreement_prompts": _int(0, 20),
    "chunk": _int(1),
    "batch_tokens": _int(1),
    "pass_configs": _int(1),
    "threads": _int(1),
    "wait": _real(0),
    # bench and demo
    "batch": _int(1),
    "prompt": _int(1),
    "samples": _int(1),
    "max_ppl_increase": _real(0),
    "analysis_tokens": _int(1),
    # serve
    "port": _int(0, 65535),
    # cost
    "d_model": _int(1),
    "d_inter": _int(1),
    "c_act": _real(0),
    "dtype_bytes": _int(1, 8),
}


def check(range_name: str, value: Any, name: str | None = None) -> Any:
    """``value`` checked against ``RANGES[range_name]`` (int or float); errors name ``name`` (default the
    range's own name) and the range."""
    return RANGES[range_name].check(value, name or range_name)


def check_optional(range_name: str, value: Any, name: str | None = None) -> Any:
    """As :func:`check`, None passing through (an option left to its default)."""
    return None if value is None else check(range_name, value, name)


def check_all(**values: Any) -> dict[str, Any]:
    """Every ``name=value`` checked against the range of that name (None passes); returns them converted."""
    return {name: check_optional(name, value) for name, value in values.items()}


# --------------------------------------------------------------------------------------------
# The command line
# --------------------------------------------------------------------------------------------


def number(range_name: str) -> Callable[[str], Any]:
    """An argparse ``type``: the string parsed and checked against the range (argparse then exits 2 with
    ``argument --option: must be <range>, got '<text>'``)."""
    r = RANGES[range_name]

    def parse(text: str) -> Any:
        try:
            return r.parse(text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None

    parse.__name__ = range_name
    parse.range_text = r.text  # type: ignore[attr-defined]
    return parse


def path_option(text: str) -> str:
    """An argparse ``type`` for a path option: an empty (or blank) string is refused at the parse, never read
    as "the default" or as the current folder."""
    if not str(text).strip():
        raise argparse.ArgumentTypeError(f"must be a path, got {text!r}")
    return text


def sparsities(text: str) -> list[float]:
    """An argparse ``type`` for comma-separated k: each a number in (0, 1), distinct, at least one."""
    r = RANGES["sparsity"]
    values = []
    for part in str(text).split(","):
        if part.strip():
            try:
                values.append(r.parse(part.strip()))
            except ValueError:
                raise argparse.ArgumentTypeError(f"must be {SPARSITIES_TEXT}, got {part.strip()!r}") from None
    if not values:
        raise argparse.ArgumentTypeError(f"must be {SPARSITIES_TEXT}, got {text!r}")
    if len({round(k, 6) for k in values}) != len(values):
        raise argparse.ArgumentTypeError(f"must be {SPARSITIES_TEXT}, got {text!r} (a k twice)")
    return values


SPARSITIES_TEXT = "distinct numbers in (0, 1) separated by commas"
sparsities.range_text = SPARSITIES_TEXT  # type: ignore[attr-defined]


def with_range(help_text: str, range_text: str) -> str:
    """``help_text`` with the range in it: ``"tokens (default 8192)"`` -> ``"tokens (an integer >= 2;
    default 8192)"``; without a stated default, ``"tokens (an integer >= 2)"``."""
    at = help_text.rfind("(default")
    if at >= 0:
        return f"{help_text[:at + 1]}{range_text}; {help_text[at + 1:]}"
    return f"{help_text} ({range_text})"


def add_number(parser: argparse.ArgumentParser, *flags: str, range: str, help: str, **kwargs: Any):
    """``parser.add_argument(*flags, ...)`` for a number of ``RANGES[range]`` (``range="sparsities"``: a
    comma-separated list of k); its help states the range and the default."""
    kind = sparsities if range == "sparsities" else number(range)
    default = kwargs.get("default")
    if "default" not in help.lower() and default is not None and default is not argparse.SUPPRESS:
        shown = ",".join(str(v) for v in default) if isinstance(default, (list, tuple)) else str(default)
        help = f"{help} (default {shown})"
    return parser.add_argument(*flags, type=kind, help=with_range(help, kind.range_text), **kwargs)


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line, ``<prog>: error: <what>; <prog> --help lists the
    options``, exit status 2 (argparse's own prints the whole usage first)."""

    def error(self, message: str):  # noqa: D401 - argparse's interface
        self.exit(2, f"{self.prog}: error: {message} (`{self.prog} --help` lists the options)\n")


def die(prog: str, message: str) -> None:
    """One error line on stderr and exit status 2 (for checks across options, after the parse)."""
    print(f"{prog}: error: {message}", file=sys.stderr)
    raise SystemExit(2)


DEVICE_RULE = "auto: cuda when PyTorch sees a GPU, else cpu"


def device_arg(value: str) -> str:
    """``--device``: ``auto`` (every command's default) is cuda when PyTorch sees a GPU, else cpu; any other value
    is passed on as given (checked where the model loads)."""
    if value != "auto":
        return value
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def add_device_arg(p: argparse.ArgumentParser) -> None:
    """The one ``--device`` option of every command that loads a model (:data:`DEVICE_RULE`): its value is
    resolved when the command line is parsed."""
    p.add_argument("--device", default="auto", type=device_arg,
                   help=f"auto, cpu, cuda or cuda:N ({DEVICE_RULE}; default auto)")
