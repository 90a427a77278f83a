"""Which model an artifact was made for: a fingerprint of its weights, and a probe that tells the same model in
another dtype (fp32 / bf16 / fp16) from another checkpoint.

The fingerprint hashes three rows of every Gated-MLP's W_gate, W_up and W_down rounded to bf16, so an fp32 model and
its bf16 copy share it. An fp16 copy rounds the weights elsewhere, so artifacts also keep a few of those weights as
the model held them (the probe) and the dtype: a model whose fingerprint differs still fits when every probed weight
lies within the two dtypes' rounding of the recorded one (:func:`other_weights`).
"""

from __future__ import annotations

import hashlib
import math

import torch

from .gated_mlp import GatedMLP


def _slice_bytes(mlp: GatedMLP, which: str) -> bytes:
    """Rows 0, middle and last of the (global) weight ``which``, rounded to bfloat16 so that an fp32
    model and its bf16 copy share one fingerprint (the artifact is valid for both). On a
    tensor-parallel model the rows are gathered across ranks: the fingerprint is the one-process one."""
    n = mlp.weight_shape(which)[0]
    rows = sorted({0, n // 2, n - 1})
    part = mlp.weight_rows(which, rows).to(device="cpu", dtype=torch.bfloat16).contiguous()
    return part.view(torch.int16).numpy().tobytes()


def model_fingerprint(mlps: list[GatedMLP]) -> str:
    """sha256 over every Gated-MLP's weight shapes and three fixed rows of W_gate, W_up, W_down.

    Cheap (reads ~9 rows per layer) and enough to tell models apart: two checkpoints of one
    architecture differ in these rows, a different architecture differs in shapes or layer count.
    """
    h = hashlib.sha256()
    h.update(f"layers={len(mlps)}".encode())
    for m in mlps:
        for name in ("gate", "up", "down"):
            h.update(f"{name}{m.weight_shape(name)}".encode())
            h.update(_slice_bytes(m, name))
    return h.hexdigest()


# The half-ulp of each dtype relative to a value (round to nearest): how far a weight moves when the model is cast
ROUNDING = {"fp32": 2.0 ** -24, "bf16": 2.0 ** -8, "fp16": 2.0 ** -11}
DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
PROBE_COLUMNS = 4


def dtype_name(mlps: list[GatedMLP]) -> str:
    dtype = mlps[0].w_down.dtype if mlps else torch.float32
    return DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))


def model_probe(mlps: list[GatedMLP]) -> list[float]:
    """The fingerprint's rows' first :data:`PROBE_COLUMNS` weights of every Gated-MLP, exactly as this model holds
    them: an artifact keeps them so that the same model in another dtype (fp16, whose rounding the bf16-rounded
    fingerprint does not survive) is told from another checkpoint by the dtypes' own rounding error."""
    values: list[float] = []
    for m in mlps:
        for name in ("gate", "up", "down"):
            n = m.weight_shape(name)[0]
            rows = m.weight_rows(name, sorted({0, n // 2, n - 1}))[:, :PROBE_COLUMNS]
            values.extend(rows.detach().to("cpu", torch.float64).reshape(-1).tolist())
    return values


def model_meta(mlps: list[GatedMLP]) -> dict:
    """What an artifact records about the model it was made for."""
    return {
        "fingerprint": model_fingerprint(mlps),
        "n_layers": len(mlps),
        "d_model": mlps[0].d_model if mlps else None,
        "d_inter": [m.d_inter for m in mlps],
        "act": mlps[0].act_name if mlps else None,
        "layers": [m.name for m in mlps],
        "dtype": dtype_name(mlps),
        "probe": model_probe(mlps),
    }


def other_weights(want: dict, mlps: list[GatedMLP]) -> str | None:
    """Why the model of ``mlps`` is not the one an artifact's ``model`` metadata ``want`` was made for, or None
    where it is (the same fingerprint, or the same weights in another dtype: within both dtypes' rounding)."""
    have = model_fingerprint(mlps)
    if have == want.get("fingerprint"):
        return None
    dtype, built, probe = dtype_name(mlps), want.get("dtype"), want.get("probe")
    head = (f"these artifacts were made for a model with other weights (fingerprint {str(want.get('fingerprint'))[:12]}"
            f"{f', {built} weights' if built else ''}; this model {have[:12]}, {dtype}")
    if not isinstance(probe, list):  # written before artifacts kept a probe: the fingerprint alone decides
        hint = ("" if dtype != "fp16" else "; if it is the same model: these artifacts predate the dtype check, and "
                "an fp16 copy rounds its weights off the bf16 values the fingerprint keeps: load the model in bf16 "
                "or fp32 (--dtype bf16) to use them, or build them again on this model")
        return f"{head}; same shapes, so probably another checkpoint or a fine-tune): build artifacts for this model{hint}"
    mine = model_probe(mlps)
    slack = ROUNDING.get(built, 2.0 ** -8) + ROUNDING.get(dtype, 2.0 ** -8)
    tiny = 2.0 ** -24 if "fp16" in (built, dtype) else 0.0  # fp16's subnormals
    for i, (a, b) in enumerate(zip(probe, mine)):
        if not math.isfinite(b) and dtype == "fp16":
            return (f"this model in fp16 does not hold its weights (a weight is {b} in fp16, {a:.6g} in the {built} "
                    "model the artifacts were made for): load it in bf16 or fp32 (--dtype bf16)")
        if abs(a - b) > slack * max(abs(a), abs(b)) * 1.01 + tiny:
            return (f"{head}; probed weight {i} is {b:.6g} here and {a:.6g} there, further apart than {built} and "
                    f"{dtype} rounding allow: another checkpoint or a fine-tune): build artifacts for this model")
    if len(probe) != len(mine):
        return f"{head}): build artifacts for this model"
    return None


