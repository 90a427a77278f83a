"""One compiled decode step for every configuration: each Gated-MLP behind an opaque custom op.

A full-graph compile of the Llama-3.1-8B decoder takes 40-70 s, and a change of method (another
selector, another kernel) changes the graph, so timing dense and six methods compiled one by one
does not fit a 10-minute device call. Here every Gated-MLP module of the model is replaced by a
:class:`SlotMLP` whose forward is one custom op, ``countdown_bench::mlp_slot(x, slot)``: to Dynamo
and Inductor it is an opaque call that returns a tensor shaped like ``x``, and at run time it calls
whatever sits in the slot, the original MLP module, patched by ``countdown.sparsify`` or not. So:

* the step (attention, norms, projections, lm_head, argmax) is compiled ONCE (Inductor, gpt-fast's
  coordinate-descent tuning, no CUDA graphs of its own) and serves dense and every method;
* per configuration the compiled step is captured in a CUDA graph of ours (about a second), which
  records the kernels the slot's module launched (the methods' Triton kernels and their few PyTorch
  ops, eager: a method's kernels are custom ops that Inductor would not fuse anyway);
* per k the selectors' thresholds / cuts are copied into their device buffers in place
  (:func:`countdown.bench.speedonly.retarget`), so the same CUDA graph replays at every k.

``countdown.sparsify`` cannot find the MLPs behind the slots: it patches :attr:`SlotModel.holder`, a
module holding the original MLP modules, and everything that takes a patched model (``retarget``,
``dense_prefix``, ``state_of``) takes the holder.

A folded decoder layer (``countdown.decode.layer``) computes its MLP half, ``h + mlp(RMSNorm(h))``, by
``countdown.decode.layer.mlp_half``, where a sparsified module may take the norm and the add into its own launches
(its block route). While slots are in, :class:`SlotModel` wraps that function (:data:`FOLDED_HALF` names it) so that
a slot's whole half goes behind a second opaque op and the module in the slot takes its block route as it would in
a full-graph compile; every other module is served by the function as it was.
"""

from __future__ import annotations

import contextlib
import importlib
import itertools
import time

import torch
from torch import nn

from countdown.decode.cache import cache_kwargs

SLOTS: dict[int, nn.Module] = {}
_NEXT = itertools.count()
# (module, function) of a folded layer's MLP half, h + mlp(RMSNorm(h)), as the folded forward looks it up
FOLDED_HALF = ("countdown.decode.layer", "mlp_half")
_HALF_MODULE = importlib.import_module(FOLDED_HALF[0])
_LIBRARY_HALF = getattr(_HALF_MODULE, FOLDED_HALF[1])
_wrapping = 0  # SlotModels alive: the folded layers' MLP half stays wrapped while any is


@torch.library.custom_op("countdown_bench::mlp_slot", mutates_args=())
def mlp_slot(x: torch.Tensor, slot: int) -> torch.Tensor:
    """The module in ``SLOTS[slot]`` applied to ``x`` (opaque to torch.compile)."""
    return SLOTS[slot](x)


@mlp_slot.register_fake
def _(x, slot):
    return torch.empty_like(x)


@torch.library.custom_op("countdown_bench::mlp_half_slot", mutates_args=())
def mlp_half_slot(h: torch.Tensor, norm_w: torch.Tensor, eps: float, slot: int) -> torch.Tensor:
    """A folded layer's ``h + module(RMSNorm(h))`` with the module in ``SLOTS[slot]`` (opaque to torch.compile):
    the library's own MLP half (:data:`FOLDED_HALF`), so a sparsified module's block route (norm and add with its
    kernels) runs here as it runs in a full-graph compile."""
    return _LIBRARY_HALF(SLOTS[slot], h, norm_w, eps)


@mlp_half_slot.register_fake
def _(h, norm_w, eps, slot):
    return torch.empty_like(h)


class SlotMLP(nn.Module):
    """Stands where a Gated-MLP module stood; its forward is the opaque slot op. In a folded layer its whole
    MLP half goes behind the opaque half op instead (:func:`_slot_half`)."""

    def __init__(self, slot: int):
        super().__init__()
        self.slot = slot

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.countdown_bench.mlp_slot(x, self.slot)


def _slot_half(mlp: nn.Module, h: torch.Tensor, norm_w: torch.Tensor, eps: float) -> torch.Tensor:
    """The library's MLP half while slots are in: a slot's behind the opaque half op, any other module's as before."""
    if isinstance(mlp, SlotMLP):
        return torch.ops.countdown_bench.mlp_half_slot(h, norm_w, eps, mlp.slot)
    return _LIBRARY_HALF(mlp, h, norm_w, eps)


def _wrap_folded_half(on: bool) -> None:
    """Count a SlotModel in (``on``) or out: from the first in to the last out, the folded layers find
    :func:`_slot_half` where they look their MLP half up."""
    global _wrapping
    _wrapping += 1 if on else -1
    setattr(_HALF_MODULE, FOLDED_HALF[1], _slot_half if _wrapping > 0 else _LIBRARY_HALF)


class ZeroMLP(nn.Module):
    """A Gated-MLP that costs one fill kernel: its output is zero (the step's floor, see
    :meth:`SlotModel.replaced`; the decoded tokens mean nothing, the step's other work is unchanged)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(x)


class _Holder(nn.Module):
    def __init__(self, modules: list[nn.Module]):
        super().__init__()
        self.mlps = nn.ModuleList(modules)


class SlotModel:
    """``model``'s Gated-MLP modules moved behind slots until :meth:`restore` (also on ``with`` exit).

    ``holder``: an ``nn.Module`` holding the original MLP modules, for ``countdown.sparsify`` /
    ``unsparsify`` / ``retarget``; ``mlps``: their ``GatedMLP`` views (taken before the move)."""

    def __init__(self, model: nn.Module):
        from countdown.model.gated_mlp import require_gated_mlps

        self.model = model
        self.mlps = require_gated_mlps(model)
        by_id = {id(g.module): g.module for g in self.mlps}
        self.places = []  # (parent, attribute name, original module, slot module)
        for parent in model.modules():
            for name, child in list(parent.named_children()):
                if id(child) in by_id:
                    slot = next(_NEXT)
                    SLOTS[slot] = child
                    self.places.append((parent, name, child, SlotMLP(slot)))
        if len(self.places) != len(self.mlps):
            raise RuntimeError(f"found {len(self.places)} of the {len(self.mlps)} Gated-MLP modules as children")
        order = {id(g.module): i for i, g in enumerate(self.mlps)}
        self.places.sort(key=lambda p: order[id(p[2])])
        self.holder = _Holder([p[2] for p in self.places])
        for parent, name, _, slot_module in self.places:
            setattr(parent, name, slot_module)
        _wrap_folded_half(True)

    @contextlib.contextmanager
    def replaced(self, make):
        """Inside: every slot holds ``make(original module)`` instead (e.g. ``lambda m: ZeroMLP()``);
        the originals are back on exit. Capture the step again inside (and after)."""
        before = {p[3].slot: SLOTS[p[3].slot] for p in self.places}
        try:
            for slot, original in before.items():
                SLOTS[slot] = make(original)
            yield self
        finally:
            SLOTS.update(before)

    def restore(self) -> None:
        if not self.places:  # restored already
            return
        for parent, name, original, slot_module in self.places:
            setattr(parent, name, original)
            SLOTS.pop(slot_module.slot, None)
        self.places = []
        _wrap_folded_half(False)

    def __enter__(self) -> "SlotModel":
        return self

    def __exit__(self, *exc) -> None:
        self.restore()


def _sparse_scope(holder: nn.Module, n_dense: int):
    """Inside: the first ``n_dense`` positions dense, the rest sparse, if ``holder`` is patched."""
    import contextlib

    from countdown.patch.state import dense_prefix, is_sparsified

    return dense_prefix(holder, n_dense) if is_sparsified(holder) else contextlib.nullcontext()


class CapturedDecoder:
    """Greedy decoding of ``model`` (its MLPs behind slots) with one compiled step, captured per configuration.

    ``compile``: ``"inductor"`` (CUDA: Inductor with ``options``), ``"eager-backend"`` (Dynamo only:
    checks guards and recompiles on a CPU) or None (the eager step). :meth:`capture` records the step in
    a CUDA graph (CUDA only); :meth:`run` then replays it once per new token."""

    def __init__(self, model, holder, batch: int, max_cache_len: int, compile: str | None = "inductor",
                 options: dict | None = None):
        from transformers import StaticCache

        self.model, self.holder, self.batch, self.max_cache_len = model, holder, batch, max_cache_len
        self.cache = StaticCache(config=model.config, max_cache_len=max_cache_len)
        if compile == "inductor":
            self.step = torch.compile(self._step, fullgraph=True, options=dict(options or {}))
        elif compile == "eager-backend":
            self.step = torch.compile(self._step, fullgraph=True, backend="eager")
        else:
            self.step = self._step
        self.graph = None
        self.buffers: dict = {}
        self.device = next(model.parameters()).device

    def _step(self, token: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        out = self.model.forward(input_ids=token, position_ids=position, **cache_kwargs(self.cache), use_cache=True)
        return out.logits[:, -1, :].argmax(dim=-1)[:, None]

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The prompt, dense, through the eager model; the first new token ``[batch, 1]``."""
        self.cache.reset()
        n = input_ids.shape[1]
        position_ids = torch.arange(n, device=input_ids.device)[None].expand(input_ids.shape[0], n)
        with _sparse_scope(self.holder, n):
            out = self.model(input_ids=input_ids, position_ids=position_ids, **cache_kwargs(self.cache), use_cache=True)
        return out.logits[:, -1, :].argmax(dim=-1)[:, None]

    @torch.no_grad()
    def capture(self, input_ids: torch.Tensor, warmup: int = 3) -> float:
        """Warm the compiled step up on ``input_ids`` (compiles on first use, tunes) and record it in a
        CUDA graph over static buffers (on a CPU: the warm-up only); returns the seconds it took. Call again after any change of
        what sits in the slots (another method, patched or not); a change of k needs no new capture."""
        start = time.perf_counter()
        self.release()
        first = self.prefill(input_ids)
        token, position = first.clone(), torch.full_like(first, input_ids.shape[1])
        if self.device.type != "cuda":  # no CUDA graphs: warm the step up (compiles) and run it step by step
            with _sparse_scope(self.holder, 0):
                for _ in range(warmup):
                    token = self.step(token, position).clone()
                    position = position + 1
            self.cache.reset()
            return time.perf_counter() - start
        with _sparse_scope(self.holder, 0):
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(warmup):
                    token = self.step(token, position).clone()
                    position = position + 1
            torch.cuda.current_stream().wait_stream(stream)
            b = self.buffers
            b["token"], b["position"] = token.clone(), position.clone()
            b["seq"] = torch.zeros(self.batch, self.max_cache_len + 1, dtype=torch.long, device=token.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                nxt = self.step(b["token"], b["position"])
                b["seq"].scatter_(1, b["position"] + 1, nxt)
                b["token"].copy_(nxt)
                b["position"].add_(1)
        self.graph = graph
        torch.cuda.synchronize()
        self.cache.reset()
        return time.perf_counter() - start

    def release(self) -> None:
        self.graph = None
        self.buffers = {}

    @torch.no_grad()
    def run(self, input_ids: torch.Tensor, new_tokens: int, prefills: int = 1) -> tuple[torch.Tensor, float, float]:
        """``new_tokens`` greedy tokens after ``input_ids``: ``(tokens [batch, new_tokens], prefill_s,
        decode_s)``, on the captured graph if there is one, else step by step. ``prefills`` > 1: the prompt
        is run that many times (the decode follows the last) and ``prefill_s`` is their median (the eager
        prefill is host-bound and varies from row to row)."""
        cuda = self.device.type == "cuda"
        marks = []

        def mark():
            if cuda:
                event = torch.cuda.Event(enable_timing=True)
                event.record()
                marks.append(event)
            else:
                marks.append(time.perf_counter())

        n = input_ids.shape[1]
        for _ in range(max(1, prefills)):
            mark()
            first = self.prefill(input_ids)
            mark()
        with _sparse_scope(self.holder, 0):
            if self.graph is not None:
                b = self.buffers
                b["token"].copy_(first)
                b["position"].fill_(n)
                b["seq"].zero_()
                for _ in range(new_tokens - 1):
                    self.graph.replay()
                mark()
                new = torch.cat([first, b["seq"][:, n + 1:n + new_tokens]], dim=1)
            else:
                out, token, position = [first], first, torch.full_like(first, n)
                for _ in range(new_tokens - 1):
                    token = self.step(token, position).clone()
                    position = position + 1
                    out.append(token)
                mark()
                new = torch.cat(out, dim=1)
        if cuda:
            torch.cuda.synchronize()
            times = [a.elapsed_time(b) / 1e3 for a, b in zip(marks, marks[1:])]
        else:
            times = [b - a for a, b in zip(marks, marks[1:])]
        self.cache.reset()
        prefill_s = sorted(times[0:-1:2])  # every other interval is a prefill; the last one the decode
        return new, prefill_s[len(prefill_s) // 2], times[-1]
