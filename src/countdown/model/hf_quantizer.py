"""countdown's transformers quantizer: ``from_pretrained`` rebuilds a model :func:`countdown.save` wrote.

    import countdown                                   # registers the two classes below with transformers
    model = AutoModelForCausalLM.from_pretrained("my-model")   # sparsified and / or 4-bit, as saved

A saved folder's config.json carries the model's configuration as ``quantization_config`` (``quant_method``
"countdown", :func:`countdown.model.saving.quantization_config`). :class:`CountdownConfig` is that record as transformers
holds it (its fields are the record's, ``to_dict`` gives the record back); :class:`CountdownHfQuantizer` is the
quantizer transformers runs for it, through its lifecycle hooks:

``validate_environment``
    the record is one this release rebuilds (its version, spec, scope, path, weight format), before anything loads;
``_process_model_before_weight_loading``
    on the meta skeleton: each 4-bit Linear becomes an ``Int4Linear`` with the saved shapes and scale dtypes, read
    from the safetensors headers (:mod:`countdown.int4.loading`), so the codes load straight into it and no float
    copy is allocated; the SP-Prac artifact is found (:func:`artifact_file`), or its absence refused, before the load;
``_process_model_after_weight_loading``
    :func:`countdown.sparsify` with the saved spec, k, scope, path and the artifact; the record made current
    (a record of an earlier release is written back in this release's form);
``get_state_dict_and_metadata``
    at ``save_pretrained``: the record written again from the model as it is then (sparsified, un-sparsified, 4-bit),
    the sparse patch's own buffers left out of the weights;
``is_serializable`` True; ``is_trainable`` False; ``is_compileable`` True (the patched forward has no graph break).

Side effects, as for every transformers quantizer: the loaded model has ``hf_quantizer`` and ``is_quantized``, so
``.half()`` / ``.float()`` raise transformers' ValueError (load with ``dtype=`` instead: the selectors are then built
at that dtype, which a cast after sparsifying does not reproduce bit for bit; ``.to(dtype)``, which transformers
checks only for other methods, casts as it does on any sparsified model, 4-bit scales keeping their dtype).
``countdown.unsparsify`` of a model with float weights removes the quantizer (a plain model again); of a 4-bit one,
it keeps it with the record updated. Without ``import countdown`` transformers logs "Unknown quantization type, got
countdown ... we will skip the quantization" and loads the weights alone: a sparsified folder dense, a 4-bit one with
random Linears.
"""

from __future__ import annotations

import warnings
from pathlib import Path

from torch import nn
from transformers.quantizers import HfQuantizer, register_quantization_config, register_quantizer
from transformers.utils.quantization_config import QuantizationConfigMixin

from .saving import ARTIFACTS_NAME, QUANT_METHOD, RECORD_VERSION, quantization_config, weights_to_save

FIELDS = ("quant_method", "format_version", "countdown", "spec", "method", "kind", "options", "mode", "k", "scope",
          "path", "artifacts", "weights", "nested")


class CountdownConfig(QuantizationConfigMixin):
    """config.json's ``quantization_config`` of a countdown model (:func:`countdown.model.saving.quantization_config`):
    one attribute per field of the record; fields a later release adds are kept as they are."""

    def __init__(self, spec=None, method=None, kind=None, options=None, mode=None, k=None, scope=None, path=None,
                 artifacts=None, weights=None, nested=None, format_version=RECORD_VERSION, countdown=None, quant_method=QUANT_METHOD,
                 **more):
        if quant_method != QUANT_METHOD:
            raise ValueError(f"a CountdownConfig has quant_method {QUANT_METHOD!r}, not {quant_method!r}")
        self.quant_method, self.format_version, self.countdown = QUANT_METHOD, format_version, countdown
        self.spec, self.method, self.kind, self.options, self.mode = spec, method, kind, options, mode
        self.k, self.scope, self.path, self.artifacts, self.weights = k, scope, path, artifacts, weights
        self.nested = nested
        self.__dict__.update(more)

    def to_dict(self) -> dict:
        """The record, as config.json holds it."""
        import copy

        record = {name: getattr(self, name) for name in FIELDS}
        record.update({name: value for name, value in self.__dict__.items() if name not in FIELDS})
        return copy.deepcopy(record)

    def to_diff_dict(self) -> dict:
        return self.to_dict()


def quantized_records(record: dict) -> tuple[dict | None, dict | None]:
    """The 4-bit record (``weights.record``) and the nested 8-bit record (``nested``) of a saved record, each None
    where the model has no such weights."""
    return (record.get("weights") or {}).get("record"), record.get("nested")


def check_record(record: dict) -> None:
    """A record this release rebuilds, else a ValueError saying what to do (before anything is loaded)."""
    from ..int4.loading import check_int4_record
    from ..patch.sparsify import PATHS
    from ..spec import SCOPES, parse_spec

    version = record.get("format_version", RECORD_VERSION)
    if not isinstance(version, int) or version > RECORD_VERSION:
        raise ValueError(f"this countdown model was saved by a newer countdown (record version {version}, this "
                         f"release reads up to {RECORD_VERSION}): upgrade countdown (pip install -U countdown)")
    if record.get("spec") is not None:
        spec = parse_spec(record["spec"])
        if record.get("scope") not in SCOPES or record.get("path") not in PATHS:
            raise ValueError(f"the saved record's scope {record.get('scope')!r} / path {record.get('path')!r} is not "
                             f"one of {SCOPES} / {PATHS}: save the model again with countdown.save")
        if (spec.kind is not None or record.get("mode") == "prac") and not record.get("artifacts"):
            raise ValueError(f"the saved SP-Prac model ({record['spec']}) names no artifact file: save it again "
                             "with countdown.save")
    weights = record.get("weights")
    if weights is not None:
        if weights.get("bits") != 4:
            raise ValueError(f"the saved weights are {weights.get('bits')}-bit, which this release cannot rebuild: "
                             "upgrade countdown")
        check_int4_record(weights.get("record"), "config.json")
    if record.get("nested") is not None:
        from ..int4.nested_model import check_nested_record

        check_nested_record(record["nested"], "config.json")


def artifact_file(name_or_path: str, checkpoint_files: list[str]) -> Path:
    """The SP-Prac artifact of a saved model: the file beside its weights (a local folder, or the hub snapshot
    its weights were fetched into, where it was fetched before), else fetched from the hub into that snapshot, as
    transformers fetches a model's files (the same repository, revision, subfolder and cache; the token and the
    offline setting of the environment)."""
    weights = Path(checkpoint_files[0])
    beside = weights.parent / ARTIFACTS_NAME
    if beside.is_file():
        return beside
    parts = weights.parts
    if "snapshots" in parts[:-1] and any(p.startswith("models--") for p in parts):  # a hub cache's snapshot
        from transformers.utils import cached_file

        at = len(parts) - 1 - parts[::-1].index("snapshots")
        repo = next(i for i in range(at) if parts[i].startswith("models--"))
        found = cached_file(str(name_or_path), ARTIFACTS_NAME, cache_dir=str(Path(*parts[:repo])),
                            revision=parts[at + 1], subfolder="/".join(parts[at + 2:-1]),
                            _raise_exceptions_for_missing_entries=False)
        if found is not None:
            return Path(found)
    raise FileNotFoundError(f"{name_or_path} is a saved SP-Prac model whose selectors are the file {ARTIFACTS_NAME} "
                            f"beside its weights, and it is not there ({beside}): copy the whole folder that "
                            "countdown.save wrote (or upload it whole to the hub)")


class CountdownHfQuantizer(HfQuantizer):
    """The quantizer transformers runs for a countdown record (see the module docstring for each hook)."""

    requires_calibration = False

    def __init__(self, quantization_config: CountdownConfig, **kwargs):
        super().__init__(quantization_config, **kwargs)
        self.artifact: Path | None = None

    def validate_environment(self, device_map=None, **kwargs) -> None:
        check_record(self.quantization_config.to_dict())
        if isinstance(device_map, dict) and {"disk", "meta"} & {str(v) for v in device_map.values()}:
            raise ValueError("a countdown model is sparsified and / or 4-bit in memory: it cannot be offloaded to "
                             "disk; give a device_map without 'disk' (or none)")

    def _process_model_before_weight_loading(self, model: nn.Module, checkpoint_files=None, **kwargs):
        record = self.quantization_config.to_dict()
        if not checkpoint_files:
            raise ValueError("a countdown model loads from its saved folder's safetensors files, not from a "
                             "state_dict: give from_pretrained the folder")
        if record.get("artifacts"):
            self.artifact = artifact_file(getattr(model.config, "name_or_path", ""), checkpoint_files)
        int4, nested = quantized_records(record)
        if int4 is not None or nested is not None:
            from ..int4.loading import build_int4_modules

            build_int4_modules(model, checkpoint_files, int4, nested)
        return model

    def _process_model_after_weight_loading(self, model: nn.Module, **kwargs):
        record = self.quantization_config.to_dict()
        int4, nested = quantized_records(record)
        if int4 is not None or nested is not None:
            from ..int4.loading import finish_int4_modules
            from .saving import save_pretrained_method

            finish_int4_modules(model, int4, nested)
            if "save_pretrained" not in model.__dict__:  # as countdown.quantize leaves a 4-bit model: one save path
                object.__setattr__(model, "save_pretrained", save_pretrained_method(model))
        if record.get("spec") is not None:
            from ..patch.sparsify import sparsify, with_mode

            artifacts = str(self.artifact) if self.artifact is not None else None
            spec = with_mode(record["spec"], record.get("mode"), artifacts)  # an earlier release's mode folded in
            sparsify(model, spec, record.get("k"), scope=record.get("scope"), artifacts=artifacts,
                     path=record.get("path") or "auto")
        self.follow_state(model)
        return model

    def follow_state(self, model: nn.Module) -> None:
        """The record on the model (``config.quantization_config``, this quantizer's) made what the model is now;
        a model with nothing of countdown left (un-sparsified float weights) loses the quantizer: a plain model.
        Called by sparsify and unsparsify; a configuration that cannot be saved keeps the last record (a save
        refuses it)."""
        try:
            record = quantization_config(model)
        except ValueError:
            return
        if record is None:
            self.remove_quantization_config(model)
            model.config.__dict__.pop("_is_quantized", None)
            return
        self.quantization_config = model.config.quantization_config = CountdownConfig(**record)

    def get_state_dict_and_metadata(self, model: nn.Module, *args, **kwargs):
        """At ``save_pretrained``: the record written from the model as it is (refusing what cannot round-trip), and
        the weights without the sparse patch's buffers."""
        record = quantization_config(model)
        if record is None:
            self.remove_quantization_config(model)
        else:
            self.quantization_config = model.config.quantization_config = CountdownConfig(**record)
        return weights_to_save(model), {}

    def is_serializable(self, *args, **kwargs) -> bool:
        return True

    @property
    def is_trainable(self) -> bool:
        return False

    @property
    def is_compileable(self) -> bool:
        return True


def register() -> None:
    """Register :class:`CountdownConfig` and :class:`CountdownHfQuantizer` for ``quant_method`` "countdown" (once:
    transformers refuses a second registration; a re-import of this module puts its new classes in place; another
    package's "countdown" is left as it is, with a warning)."""
    from transformers.quantizers import auto

    for mapping, cls, add in ((auto.AUTO_QUANTIZATION_CONFIG_MAPPING, CountdownConfig, register_quantization_config),
                              (auto.AUTO_QUANTIZER_MAPPING, CountdownHfQuantizer, register_quantizer)):
        held = mapping.get(QUANT_METHOD)
        if held is None:
            add(QUANT_METHOD)(cls)
        elif (held.__module__, held.__qualname__) == (cls.__module__, cls.__qualname__):
            mapping[QUANT_METHOD] = cls
        elif held is not cls:
            warnings.warn(f"transformers has a quantization method 'countdown' from {held.__module__} already; "
                          "countdown's own is not registered, so from_pretrained will not rebuild countdown models",
                          stacklevel=2)


def load_saved(folder: Path, record: dict, dtype, device):
    """``(model, tokenizer)`` of a folder :func:`countdown.save` wrote (``record``:
    :func:`countdown.model.saving.saved_config`), through ``from_pretrained`` and this quantizer, with the weights loaded
    onto ``device`` (so that the patch lays them out for the kernels there). A folder of an earlier release, whose
    config.json names no ``quantization_config``, is handed its record."""
    import json

    from ..data.models import _load_folder

    config = json.loads((folder / "config.json").read_text())
    named = (config.get("quantization_config") or {}).get("quant_method") == QUANT_METHOD
    given = {} if named else {"quantization_config": CountdownConfig(**record)}
    if device.type != "cpu":
        given["device_map"] = {"": device}
    model, tokenizer = _load_folder(folder, dtype, device, **given)
    return model.eval(), tokenizer
