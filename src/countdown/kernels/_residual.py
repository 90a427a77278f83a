"""A decoder layer's residual handed to the last kernel of its MLP, so that the add needs no launch of its own.

A folded decode layer (countdown.fused_layer) computes ``out = h + mlp(x)``. The MLP's last kernel is the
sum of a sparse kernel's fp32 partials (kernels/_psum.py) or, dense, the down projection on the fixed GEMV
(countdown.decode_gemv, kernels/_linear.py's ``residual``); either can add ``h`` while it writes its output.
The layer opens a slot with ``h`` around its MLP call; the first of those two kernels that serves the call
takes it (:func:`take`), and the layer reads :attr:`Slot.used` to know that the MLP's output already holds
``h``. Only the MLP's last kernel may take it: the sum of partials is the last thing every sparse route
returns, and only a linear routed as the down projection asks. Nothing takes a slot that is not open, one
that is taken already, or one whose ``h`` does not match the output's shape, dtype and device.

Plain Python state, read while Dynamo traces: a compiled step records the op that took the slot.
"""

from __future__ import annotations

import os

import torch

# COUNTDOWN_SUM_ADD=0: the layer's own add, as before (for A/B runs).
ENABLED = os.environ.get("COUNTDOWN_SUM_ADD", "1") not in ("", "0")
_OPEN: list = []


class Slot:
    """One MLP call's residual ``h`` [tokens, d_model] and whether a kernel added it (``used``)."""

    def __init__(self, h: torch.Tensor):
        self.h, self.used = h, False


def open_slot(h: torch.Tensor) -> Slot:
    slot = Slot(h)
    _OPEN.append(slot)
    return slot


def close_slot(slot: Slot) -> None:
    if not _OPEN or _OPEN[-1] is not slot:
        raise RuntimeError("residual slots must be closed in the order they were opened")
    _OPEN.pop()


def take(rows: int, width: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
    """The open slot's ``h`` as [rows, width], marked used, if it is open, untaken and matches; else None."""
    if not _OPEN:
        return None
    slot = _OPEN[-1]
    h = slot.h
    if slot.used or h.numel() != rows * width or h.shape[-1] != width or h.dtype != dtype or h.device != device:
        return None
    slot.used = True
    return h.reshape(rows, width)
