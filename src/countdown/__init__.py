"""countdown: skip most of each Gated-MLP per token (M-/D-CountDown, CATS, Deja Vu), measured honestly.

Quick start::

    import countdown
    model, tok = countdown.load_model("smollm2-135m")
    countdown.sparsify(model, "mono", 0.8)          # SP-Ideal, prompt dense, generated tokens sparse
    # SP-Prac: a method spec names the kind, e.g. countdown.sparsify(model, "dual[shadow4]", 0.8,
    #          artifacts=countdown.prepare(model, tok, "dual[shadow4]", 0.8))
    print(countdown.perplexity(model, tok))
    countdown.unsparsify(model)

``__all__`` lists the supported names. Importable beside them, and not listed: the deprecated aliases
(``calibrate``, ``train_predictors``, ``ensure_artifacts``: of :func:`prepare`; ``generate_fast``: :func:`generate`
with the benchmarks' defaults) and the building blocks of extensions and the harness (``KINDS``, ``Method``,
``get_method``, ``kept_rows``, ``GatedMLP``, ``find_gated_mlps``, ``catalogue``, ``predictor_quality``,
``refine_cuts_on_decode``, ``ArtifactMismatchError``).
"""

from .artifacts.store import ArtifactError, ArtifactMismatchError, Artifacts, load_artifacts
from .data.snapshot import one_save
from .model.gated_mlp import GatedMLP, NoGatedMLPError, find_gated_mlps
from .sparse_methods.registry import Method, get_method, kept_rows, methods
from .patch.sparsify import sparsify, unsparsify
from .spec import Spec, parse_spec
from .patch.state import (AlreadySparsifiedError, NotSparsifiedError, dense_prefix, is_sparsified, reset_sparsity_stats, sparsity_real)
from .selectors.kinds import KINDS  # registers the SP-Prac selector kinds
from .artifacts.prepare import calibrate, ensure_artifacts, prepare, train_predictors  # the last three: deprecated aliases
from .selectors.quality import predictor_quality, refine_cuts_on_decode
from .decode.prepared import PreparedStep
from .model.hf_quantizer import register as _register_quantizer

_register_quantizer()  # AutoModelForCausalLM.from_pretrained rebuilds a saved countdown model (countdown.model.hf_quantizer)

__version__ = "0.1.0"


def catalogue() -> dict:
    """Model names ``load_model`` knows without a path: real models and paper-scale shapes."""
    from .data.models import catalogue as _catalogue

    return _catalogue()


def load_texts(source: str = "xsum", limit: int | None = None) -> list:
    """Held-out English text: "xsum" (evaluation), "wiki" (calibration), or a .txt/.jsonl file (a string is a
    source name if it is one, else a path). See :func:`countdown.data.texts.load_texts`."""
    from .data.texts import load_texts as _load_texts

    return _load_texts(source, limit=limit)


@one_save  # a saved folder is read as one save, even while another process saves over it
def load_model(name_or_path: str = "smollm2-135m", dtype="fp32", device="cpu", **kwargs):
    """Load ``(model, tokenizer)``: a catalogue name, a .gguf file, a local HF folder or a hub id (a string is a
    catalogue name if it is one, else a path if it exists, else a hub id: :func:`countdown.data.models.model_source`,
    the same rule as ``--model``). A folder written by :func:`save` (or ``save_pretrained`` of a sparsified or
    4-bit model, by this release or an earlier one) comes back sparsified and quantized as it was saved: it is
    ``AutoModelForCausalLM.from_pretrained`` through countdown's quantizer (:mod:`countdown.model.hf_quantizer`), onto
    ``device``. See :func:`countdown.data.models.load_model`."""
    from pathlib import Path

    from .data.models import load_model as _load, model_source, parse_device, parse_dtype
    from .model.hf_quantizer import load_saved
    from .model.saving import saved_config

    # the folder as load_model reads the string (a catalogue name is never a folder of that name)
    folder = None if kwargs.get("random_weights") or model_source(name_or_path)[0] != "folder" else \
        Path(model_source(name_or_path)[1])
    record = saved_config(folder) if folder is not None else None
    if record is None:
        return _load(name_or_path, dtype=dtype, device=device, **kwargs)
    if kwargs:
        raise ValueError(f"a saved countdown model takes no {', '.join(kwargs)}")
    device = parse_device(device)
    dtype = parse_dtype(("bf16" if device.type == "cuda" else "fp32") if dtype == "auto" else dtype)
    return load_saved(folder, record, dtype, device)


def quantize(model, group: int = 128, source: str = "rtn", **kwargs):
    """Replace every decoder Linear of ``model`` by a 4-bit one in place (round-to-nearest with groups of
    ``group``, or ``source="gguf"``: the GGUF file's own 4-bit blocks, exactly); returns the model.
    See :func:`countdown.int4.quantize.quantize` and docs/int4.md."""
    from .int4.quantize import quantize as _quantize

    return _quantize(model, group=group, source=source, **kwargs)


def save(model, folder, tokenizer=None, overwrite: bool = False, **kwargs):
    """Save a dense, sparsified or 4-bit model so that :func:`load_model` gives it back the same: its configuration
    (``Spec.of(model)``) goes into config.json as ``quantization_config``. See :mod:`countdown.model.saving`."""
    from .model.saving import save as _save

    return _save(model, folder, tokenizer=tokenizer, overwrite=overwrite, **kwargs)


def evaluate(model, tokenizer, tasks, **kwargs) -> dict:
    """Downstream accuracy through unmodified lm-evaluation-harness (prompt dense, continuation
    sparse). See :func:`countdown.eval.lmeval.evaluate`; needs the ``eval`` extra."""
    from .eval.lmeval import evaluate as _evaluate

    return _evaluate(model, tokenizer, tasks, **kwargs)


def generate(model, input_ids, max_new_tokens: int = 128, **kwargs):
    """Generate with the fastest decode step the library has, in one call (dense or sparsified; on CUDA the
    step is prepared (:class:`PreparedStep`) and compiled on the first call; its statistics with
    ``return_stats=True``). See :func:`countdown.decode.generate.generate`."""
    from .decode.generate import generate as _generate

    return _generate(model, input_ids, max_new_tokens, **kwargs)


def generate_fast(model, input_ids, max_new_tokens: int, **kwargs):
    """Alias kept for the benchmarks: :func:`generate` with their defaults (no step prepared, ``temperature`` 0 is
    greedy, no EOS unless given, tokens after a row's EOS left as generated, ``(tokens, stats)`` returned).
    See :func:`countdown.decode.generate.generate_fast`."""
    from .decode.generate import generate_fast as _generate_fast

    return _generate_fast(model, input_ids, max_new_tokens, **kwargs)


def perplexity(model, tokenizer, texts=None, max_tokens: int = 8192, **kwargs) -> float:
    """Perplexity on held-out text (XSum articles by default). See :func:`countdown.eval.perplexity.perplexity`."""
    from .eval.perplexity import perplexity as _ppl

    return _ppl(model, tokenizer, texts=texts, max_tokens=max_tokens, **kwargs)


__all__ = [
    "AlreadySparsifiedError", "ArtifactError", "Artifacts", "NoGatedMLPError", "NotSparsifiedError", "PreparedStep",
    "Spec", "dense_prefix", "evaluate", "generate", "is_sparsified", "load_artifacts", "load_model", "load_texts",
    "methods", "parse_spec", "perplexity", "prepare", "quantize", "reset_sparsity_stats", "save", "sparsify",
    "sparsity_real", "unsparsify",
]
