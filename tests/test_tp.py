"""Sparse Gated-MLPs under tensor parallelism: two gloo ranks against one process.

The model is a tiny random Llama with d_inter = 97 (odd: the ranks hold 49 and 48 rows), saved and
loaded on two CPU ranks with transformers' ``tp_plan="auto"`` (tests/_tp_worker.py; it falls back to
``parallelize_module`` with the same colwise/rowwise layout and says so in ``how``). The reference
is the same model, the same artifacts, in this process. ``COUNTDOWN_TP_BACKEND=nccl`` runs the same
test on two GPUs (NCCL), with the reference on GPU 0.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import countdown
from countdown import calibrate, train_predictors
from countdown.artifacts.store import model_fingerprint
from countdown.model.gated_mlp import require_gated_mlps
from countdown.sparse_methods.registry import get_method, kept_rows
from countdown.patch.state import state_of
from countdown.model.tensor_parallel import (ShardingError, ShardSpec, chunk_range, exact_topk_keep, shard_spec, shard_topk_keep,
                          topk_gap)

from _tp_worker import IdTokenizer, capture_masks
from conftest import tiny_model

BACKEND = os.environ.get("COUNTDOWN_TP_BACKEND", "gloo")
WORLD = 2
K = 0.5
HERE = Path(__file__).resolve().parent

CASES = [
    {"name": "mono_prac", "method": "mono", "k": K, "mode": "prac", "artifacts": "mono.safetensors", "path": "masked"},
    {"name": "mono_prac_gather", "method": "mono", "k": K, "mode": "prac", "artifacts": "mono.safetensors",
     "path": "gather"},
    {"name": "dual_lowrank", "method": "dual", "k": K, "mode": "prac", "artifacts": "dual.safetensors",
     "path": "masked"},
    {"name": "dual_lowrank_kernel", "method": "dual", "k": K, "mode": "prac", "artifacts": "dual.safetensors",
     "path": "kernel"},
    {"name": "dual_hybrid", "method": "dual", "k": K, "mode": "prac", "artifacts": "hybrid.safetensors",
     "path": "masked"},
    {"name": "dual_shadow", "method": "dual", "k": K, "mode": "prac", "artifacts": "shadow.safetensors",
     "path": "masked"},
    {"name": "mono_ideal", "method": "mono", "k": K, "mode": "ideal", "artifacts": None, "path": "masked"},
    {"name": "dual_ideal", "method": "dual", "k": K, "mode": "ideal", "artifacts": None, "path": "masked"},
    {"name": "mono_ideal_shard", "method": "mono", "k": K, "mode": "ideal", "artifacts": None, "path": "masked",
     "tp_topk": "shard"},
]


def _backend_ok() -> str | None:
    if not dist.is_available():
        return "torch.distributed is not available in this build"
    if BACKEND == "gloo" and not dist.is_gloo_available():
        return "the gloo backend is not available in this torch build"
    if BACKEND == "nccl" and (not dist.is_nccl_available() or torch.cuda.device_count() < WORLD):
        return f"NCCL test needs NCCL and {WORLD} GPUs"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _simulate_shard_topk(model) -> None:
    """On a one-process model patched in SP-Ideal: each selector keeps the per-shard top-k of
    ``WORLD`` simulated shards (what tp_topk="shard" does on WORLD ranks)."""
    for layer in state_of(model).layers:
        sel, d = layer.selector, layer.mlp.d_inter

        def forward(x, u, h, sel=sel, d=d):
            score = sel.method.indicator(u, h)
            keep = torch.zeros_like(score, dtype=torch.bool)
            for r in range(WORLD):
                start, stop = chunk_range(d, WORLD, r)
                keep[:, start:stop] = shard_topk_keep(score[:, start:stop], sel.n_keep, ShardSpec(r, WORLD, start, stop, d))
            return keep

        sel.forward = forward


@pytest.fixture(scope="module")
def tp_run(tmp_path_factory):
    reason = _backend_ok()
    if reason:
        pytest.skip(reason)
    device = torch.device("cuda:0" if BACKEND == "nccl" else "cpu")
    folder = tmp_path_factory.mktemp("tp")
    model = tiny_model("llama")
    model.save_pretrained(folder)
    model.to(device)
    gen = torch.Generator().manual_seed(3)
    texts = [" ".join(str(int(t)) for t in torch.randint(3, 128, (600,), generator=gen))]
    calib = {"num_tokens": 256, "window": 32, "refine_tokens": 64}
    mono = calibrate(model, IdTokenizer(), "mono", K, texts=texts, **calib, progress=False)
    mono.save(folder / "mono.safetensors")
    train_predictors(model, IdTokenizer(), "dual", K, texts=texts, num_tokens=256, window=32, kind="lowrank",
                     d_rank=16, epochs=1, refine=False, progress=False).save(folder / "dual.safetensors")
    for kind in ("hybrid", "shadow"):  # per-row tensors of other shapes: B columns, quantized rows
        calibrate(model, IdTokenizer(), "dual", K, kind=kind, texts=texts, **calib, progress=False).save(
            folder / f"{kind}.safetensors")
    ids = torch.randint(3, 128, (2, 4), generator=gen)  # 8 tokens: the kernel path serves up to 8
    ref = {"fingerprint": model_fingerprint(require_gated_mlps(model))}
    with torch.no_grad():
        ref["dense"] = model(ids.to(device)).logits.cpu()
        for case in CASES:
            art = None if case["artifacts"] is None else str(folder / case["artifacts"])
            countdown.sparsify(model, case["method"], case["k"], mode=case["mode"], scope="all", artifacts=art,
                               path=case["path"])  # the kernel case too: same kernels, one process
            if case.get("tp_topk") == "shard":
                _simulate_shard_topk(model)
            masks, handles = capture_masks(model)
            ref[case["name"]] = {"logits": model(ids.to(device)).logits.cpu(), "masks": masks}
            for h in handles:
                h.remove()
            countdown.unsparsify(model)
    torch.save({"ids": ids, "cases": CASES, "k": K, "texts": texts, "calibrate": calib}, folder / "cases.pt")

    port = str(_free_port())
    procs = []
    for rank in range(WORLD):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD),
                   LOCAL_WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1", MASTER_PORT=port, OMP_NUM_THREADS="1",
                   PYTHONPATH=os.pathsep.join([str(HERE.parent / "src"), os.environ.get("PYTHONPATH", "")]))
        procs.append(subprocess.Popen([sys.executable, str(HERE / "_tp_worker.py"), str(folder), BACKEND],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    logs, limit = [], float(os.environ.get("COUNTDOWN_TP_TIMEOUT", 240))
    for p in procs:
        try:
            logs.append(p.communicate(timeout=limit)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"the tensor-parallel ranks did not finish in {limit:.0f} s")

    outs = []
    for rank in range(WORLD):
        path = folder / f"rank{rank}.pt"
        assert path.exists(), f"rank {rank} wrote no result; its log:\n{logs[rank][-3000:]}"
        out = torch.load(path)
        assert "error" not in out, f"rank {rank} failed:\n{out['error']}"
        outs.append(out)
    return ref, outs


def _close(a, b, what):
    assert torch.allclose(a, b, rtol=1e-4, atol=1e-5), f"{what}: max |diff| {(a - b).abs().max():.3g}"


def test_sharded_as_planned(tp_run):
    ref, outs = tp_run
    print("sharded with", outs[0]["how"])
    for rank, out in enumerate(outs):
        assert out["spec"] == [(*chunk_range(97, WORLD, rank), 97)] * 2  # 49 + 48 rows, both layers
        assert out["fingerprint"] == ref["fingerprint"]  # artifacts made on one process fit the ranks
        _close(out["dense"], ref["dense"], f"rank {rank} dense")


@pytest.mark.parametrize("name", [c["name"] for c in CASES if c.get("tp_topk") != "shard"])
def test_sparse_logits_and_masks_equal_one_process(tp_run, name):
    ref, outs = tp_run
    for rank, out in enumerate(outs):
        _close(out[name]["logits"], ref[name]["logits"], f"{name} rank {rank}")
    # each rank's masks are its columns of the one-process mask; together, exactly that mask
    local = [out[name]["masks"] for out in outs]
    if name.endswith("_kernel"):  # the fused kernel keeps its mask to itself
        return
    assert len(local[0]) == len(ref[name]["masks"])
    for layer, want in enumerate(ref[name]["masks"]):
        assert torch.equal(torch.cat([m[layer] for m in local], dim=-1), want), f"{name} layer {layer} mask"
    if "ideal" in name:  # exactly n_keep rows per token in all
        for want in ref[name]["masks"]:
            assert (want.sum(-1) == kept_rows(97, K)).all()
    assert not torch.allclose(ref[name]["logits"], ref["dense"], atol=1e-3)  # sparsity did something


def test_shard_topk_is_a_different_mask(tp_run):
    ref, outs = tp_run
    name = "mono_ideal_shard"
    for rank, out in enumerate(outs):
        _close(out[name]["logits"], ref[name]["logits"], f"{name} rank {rank}")
        start, stop = chunk_range(97, WORLD, rank)
        n_local = round(kept_rows(97, K) * (stop - start) / 97)
        for m in out[name]["masks"]:
            assert (m.sum(-1) == n_local).all()  # each shard keeps its share, whatever the others hold
    # layer 0 sees the same input in both modes: the masks differ there only by the top-k rule
    exact = ref["mono_ideal"]["masks"][0]
    shard = torch.cat([out[name]["masks"][0] for out in outs], dim=-1)
    assert not torch.equal(exact, shard)
    assert (exact & shard).sum() >= 0.5 * exact.sum()


def test_unsparsify_restores_the_sharded_model(tp_run):
    _, outs = tp_run
    for out in outs:
        assert torch.equal(out["restored"], out["dense"])


def test_calibration_and_training_on_a_sharded_model_are_refused(tp_run):
    _, outs = tp_run
    for out in outs:  # with the fix: build on one process, load on the ranks
        assert "unsharded model" in out["calibrate_refused"] and "sparsify on every rank" in out["calibrate_refused"]
        assert "unsharded model" in out["training_refused"]


@pytest.fixture
def one_rank():
    """A gloo process group of this process alone."""
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("gloo is not available in this torch build")
    store = dist.TCPStore("127.0.0.1", _free_port(), 1, True)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_exact_topk_ties(one_rank):
    """exact_topk_keep against a hand-worked tie case."""
    spec = ShardSpec(0, 1, 0, 5, 5, dist.group.WORLD)
    score = torch.tensor([[1.0, 3.0, 2.0, 2.0, 2.0], [5.0, 4.0, 3.0, 2.0, 1.0]])
    keep = exact_topk_keep(score, 3, spec)
    # token 0: the 3.0 and the two lowest-index 2.0 ties; token 1: the three largest
    assert keep.tolist() == [[False, True, True, True, False], [True, True, True, False, False]]


def test_layouts(one_rank):
    """colwise gate/up + rowwise down is understood; any other layout is refused by name."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    w, d = torch.randn(6, 4), torch.randn(4, 6)
    spec = shard_spec(distribute_tensor(w, mesh, [Shard(0)]), distribute_tensor(w, mesh, [Shard(0)]),
                      distribute_tensor(d, mesh, [Shard(1)]))
    assert (spec.rank, spec.world, spec.start, spec.stop, spec.d_inter) == (0, 1, 0, 6, 6)
    assert shard_spec(w, w, d) is None  # plain tensors: not tensor parallel
    with pytest.raises(ShardingError, match="colwise/rowwise"):
        shard_spec(distribute_tensor(w, mesh, [Replicate()]), distribute_tensor(w, mesh, [Shard(0)]),
                   distribute_tensor(d, mesh, [Shard(1)]))


def test_topk_gap_reports_distance():
    model = tiny_model("llama")
    mlp = require_gated_mlps(model)[0]
    x = torch.randn(16, mlp.d_model, generator=torch.Generator().manual_seed(0))
    one = topk_gap(mlp, get_method("mono"), x, K, 1)
    assert one["mask_differs"] == 0 and one["output_rel_err"] == 0  # one shard: the same top-k
    two = topk_gap(mlp, get_method("mono"), x, K, 2)
    assert 0 < two["mask_differs"] < 0.5 and 0 < two["output_rel_err"] < two["dense_rel_err"] * 2
    assert 0.5 < two["recall"] < 1
