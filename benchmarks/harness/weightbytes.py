"""Weight bytes: what one decode step reads (the roofline's numerator) and what a model holds.

The bytes one decode step reads are every parameter outside the Gated-MLPs (attention, norms,
lm_head; of the embedding only the looked-up rows, unless it is tied to lm_head) plus, per Gated-MLP,
:func:`countdown.eval.cost.mlp_weight_bytes` of the configuration at its measured kept fraction (per token
at batch 1, the union over the batch's tokens above). Achieved bandwidth = those bytes x steps/s.
"""

from __future__ import annotations

from countdown.eval.cost import mlp_weight_bytes


def non_mlp_weight_bytes(model, batch: int = 1) -> int:
    """Bytes of every parameter outside the Gated-MLPs that one decode step of ``batch`` rows reads."""
    from countdown.model.gated_mlp import require_gated_mlps

    mlp_params = {id(p) for mlp in require_gated_mlps(model) for p in mlp.module.parameters()}
    emb = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    tied = head is not None and head.weight is emb
    total = 0
    for p in model.parameters():  # a tied tensor is yielded once
        if id(p) in mlp_params:
            continue
        if p is emb and not tied:
            total += batch * p.shape[1] * p.element_size()  # only the looked-up rows
        else:
            total += p.numel() * p.element_size()
    return total


def step_weight_bytes(model, kind: str, kept: float, batch: int = 1, **options) -> int:
    """Weight bytes one decode step reads with every Gated-MLP read as ``kind``
    (:func:`countdown.eval.cost.mlp_weight_bytes`) at kept fraction ``kept``; ``options``: d_rank, bits, group."""
    from countdown.model.gated_mlp import require_gated_mlps

    total = float(non_mlp_weight_bytes(model, batch))
    for mlp in require_gated_mlps(model):
        total += mlp_weight_bytes(kind, mlp.d_model, mlp.d_inter, 1.0 if kind == "dense" else kept,
                                  elem_bytes=mlp.w_up.element_size(), **options)
    return int(total)


def model_bytes(model) -> int:
    """Bytes of the model's parameters and buffers (a patched model's selectors included), each
    storage counted once: views into one storage (tied weights, fuse_attention's q/k/v) count as
    their storage, whatever their offsets."""
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        storage = t.untyped_storage()
        key = (storage.device, storage.data_ptr())
        if key in seen:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total
