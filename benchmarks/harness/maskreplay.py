"""Does batch-1 speed depend on the kept fraction only, not on which rows (issue 15's assumption)?

The speed tables are measured at a paper-scale shape with random weights, where the kept rows of a
speed-only artifact fall without structure; a real model's masks may cluster (rows kept together,
layers keeping more than others, tokens that keep more) and the kernels read rows in chunks. So masks
recorded on a real model (:func:`record_masks`, saved by the quality grid) are
replayed at the large shape through the masked kernel (``countdown.kernels.masked_gated_mlp``: kept
rows of W_gate, W_up and W_down only) against

* ``random``: per (layer, token) the same number of kept rows at uniformly random positions;
* ``contiguous``: the same numbers as one block of rows (the most clustered case, for scale).

A real mask of width ``d_small`` is tiled across the large ``d_inter`` (row ``j`` reads real row
``j mod d_small``), which keeps its local structure and its kept fraction; its layers are cycled
over the large model's first layers. Times are the median per MLP call in one CUDA graph cycling
over layers x tokens (:func:`harness.timing.time_graph`).
"""

from __future__ import annotations

import glob
import os

import torch


@torch.no_grad()
def record_masks(model, held, n_tokens: int = 64) -> torch.Tensor:
    """Keep masks ``[layers, n_tokens, d_inter]`` (bool) that a sparsified ``model`` (``path="masked"``)
    picks on the first ``n_tokens`` sparse positions of the first window of ``held``
    (:class:`countdown.bench.quality.HeldOut`): real masks to replay at another shape."""
    from countdown.patch.state import dense_prefix, state_of

    layers = state_of(model).layers
    n = min(n_tokens, held.rows.shape[1] - held.prompt)
    masks: list[torch.Tensor | None] = [None] * len(layers)

    def hook(i):
        def fn(module, args, keep):
            if masks[i] is None:
                masks[i] = keep.reshape(-1, keep.shape[-1])[held.prompt:held.prompt + n].cpu().clone()
        return fn

    handles = [layer.selector.register_forward_hook(hook(i)) for i, layer in enumerate(layers)]
    try:
        with dense_prefix(model, held.prompt):
            model(held.rows[:1].to(next(model.parameters()).device))
    finally:
        for h in handles:
            h.remove()
    if any(m is None for m in masks):
        raise RuntimeError("a layer's selector did not run: record masks on a model patched with path='masked'")
    return torch.stack(masks)


def load_masks(path: str) -> tuple[torch.Tensor, dict]:
    """``(masks [layers, tokens, d_inter] bool, meta)`` from a file the quality grid saved."""
    import numpy as np

    saved = torch.load(path, map_location="cpu", weights_only=False)
    shape = saved["shape"]
    bits = np.unpackbits(saved["packed"].numpy(), axis=-1)[..., :shape[-1]]
    meta = {k: v for k, v in saved.items() if k not in ("packed", "shape")}
    return torch.from_numpy(bits.astype(bool)).reshape(shape), meta


def tile_masks(masks: torch.Tensor, layers: int, d_inter: int) -> torch.Tensor:
    """``[layers, tokens, d_inter]``: layer ``l`` of the result is real layer ``l mod L``, row ``j`` real
    row ``j mod d_small``."""
    n_layers, _, d_small = masks.shape
    cols = torch.arange(d_inter) % d_small
    return masks[torch.arange(layers) % n_layers][:, :, cols]


def random_like(masks: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """Masks with the same count of kept rows per (layer, token) at uniformly random rows."""
    gen = torch.Generator().manual_seed(seed)
    counts = masks.sum(-1, keepdim=True)
    ranks = torch.rand(masks.shape, generator=gen).argsort(-1).argsort(-1)
    return ranks < counts


def contiguous_like(masks: torch.Tensor) -> torch.Tensor:
    """Masks with the same counts, kept rows as one block starting at row 0."""
    counts = masks.sum(-1, keepdim=True)
    return torch.arange(masks.shape[-1]) < counts


def replay(weights: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], inputs: list[torch.Tensor],
           masks: torch.Tensor, activation: str, reps: int = 25) -> float:
    """Median microseconds per masked Gated-MLP call over layers x tokens of ``masks``."""
    from countdown.kernels import masked_gated_mlp
    from .timing import time_graph

    device = inputs[0].device
    keep = masks.to(device)
    calls = [lambda w=weights[layer], x=inputs[layer], m=keep[layer, t:t + 1]: masked_gated_mlp(x, *w, m, activation)
             for layer in range(masks.shape[0]) for t in range(masks.shape[1])]
    return time_graph(calls, reps=reps, device=device)


def replay_files(model, paths: list[str], copy_bps: float, layers: int = 8, tokens: int = 8, log=print) -> list[dict]:
    """Replay every mask file of ``paths`` (files or folders of ``*.pt``) on ``model``'s first ``layers``
    Gated-MLPs: one dict per file with the kept fraction and the three timings."""
    from countdown.eval.cost import mlp_weight_bytes
    from countdown.model.gated_mlp import require_gated_mlps

    files: list[str] = []
    for p in paths:
        files += sorted(glob.glob(os.path.join(p, "*.pt"))) if os.path.isdir(p) else [p]
    if not files:
        log(f"mask replay: no mask files in {paths}")
        return []
    mlps = require_gated_mlps(model)[:layers]
    act = mlps[0].act_name
    weights = [(m.w_gate, m.w_up, m.w_down.t().contiguous()) for m in mlps]
    d_model, d_inter = mlps[0].d_model, mlps[0].d_inter
    gen = torch.Generator().manual_seed(5)
    inputs = [torch.randn(1, d_model, generator=gen).to(mlps[0].w_up) for _ in mlps]
    out = []
    for path in files:
        masks, meta = load_masks(path)
        real = tile_masks(masks[:, :tokens], len(mlps), d_inter)
        kept = float(real.float().mean())
        times = {name: replay(weights, inputs, m, act)
                 for name, m in (("real", real), ("random", random_like(real)), ("contiguous", contiguous_like(real)))}
        roof = mlp_weight_bytes("dense", d_model, d_inter, 1.0, elem_bytes=mlps[0].w_up.element_size()) * kept / copy_bps
        row = {"file": os.path.basename(path), **{k: meta.get(k) for k in ("model", "method", "sparsity")},
               "source_shape": list(masks.shape), "kept": round(kept, 4),
               **{f"{name}_us": round(us, 2) for name, us in times.items()},
               "real_over_random": round(times["real"] / times["random"], 3), "roofline_us": round(1e6 * roof, 2)}
        out.append(row)
        log(f"mask replay {row['file']}: kept {kept:.3f}: real {row['real_us']} us, random {row['random_us']} us "
            f"(real/random {row['real_over_random']}), contiguous {row['contiguous_us']} us, roofline {row['roofline_us']} us")
    del weights
    return out
