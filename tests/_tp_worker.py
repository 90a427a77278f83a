"""One rank of the tensor-parallel test (tests/test_tp.py starts two of these, torchrun-style).

    python tests/_tp_worker.py <folder> <backend>      # env: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT

Loads the model saved in <folder> sharded by transformers' ``tp_plan="auto"`` (falling back to
``parallelize_module`` with the same colwise/rowwise layout if transformers refuses), runs every case
of <folder>/cases.pt and writes what it saw to <folder>/rank<r>.pt for the test to compare.
"""

from __future__ import annotations

import os
import sys
import time
import traceback

import torch
import torch.distributed as dist


def load_sharded(folder: str, device: torch.device):
    """``(model, how)``: transformers' own plan, or torch's parallelize_module (same layout)."""
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(folder, tp_plan="auto", dtype=torch.float32)
        return model.eval(), "transformers tp_plan=auto"
    except Exception as error:  # an older/newer transformers that refuses this backend
        first = f"{type(error).__name__}: {str(error)[:200]}"
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to(device).eval()
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    plan = {}
    for i in range(model.config.num_hidden_layers):
        plan.update({f"model.layers.{i}.mlp.gate_proj": ColwiseParallel(),
                     f"model.layers.{i}.mlp.up_proj": ColwiseParallel(),
                     f"model.layers.{i}.mlp.down_proj": RowwiseParallel()})
    parallelize_module(model, mesh, plan)
    return model, f"parallelize_module (tp_plan=auto failed: {first})"


def capture_masks(model):
    """Forward hooks on every selector: their keep masks, in layer order, per forward."""
    from countdown.patch.state import state_of

    masks, handles = [], []
    for layer in state_of(model).layers:
        if layer.selector is not None:
            handles.append(layer.selector.register_forward_hook(lambda m, a, out: masks.append(out.cpu())))
    return masks, handles


class IdTokenizer:
    """Text of space-separated token ids (what the test's calibration texts are)."""

    bos_token_id = None

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict:
        return {"input_ids": [int(t) for t in text.split()]}


def main() -> None:
    folder, backend = sys.argv[1], sys.argv[2]
    rank = int(os.environ["RANK"])
    device = torch.device(f"cuda:{rank}") if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    dist.init_process_group(backend)
    import countdown
    from countdown.artifacts.store import load_artifacts, model_fingerprint
    from countdown import calibrate, train_predictors
    from countdown.model.gated_mlp import require_gated_mlps
    from countdown.model.tensor_parallel import ShardingError

    out: dict = {"rank": rank}
    try:
        cases = torch.load(os.path.join(folder, "cases.pt"))
        model, how = load_sharded(folder, device)
        out["how"] = how
        ids = cases["ids"].to(device)
        mlps = require_gated_mlps(model)
        out["spec"] = [(m.tp.start, m.tp.stop, m.tp.d_inter) for m in mlps]
        out["fingerprint"] = model_fingerprint(mlps)
        with torch.no_grad():
            out["dense"] = model(ids).logits.cpu()
            for case in cases["cases"]:
                t0 = time.perf_counter()
                art = None if case["artifacts"] is None else load_artifacts(os.path.join(folder, case["artifacts"]))
                countdown.sparsify(model, case["method"], case["k"], mode=case["mode"], scope="all", artifacts=art,
                                   path=case["path"], tp_topk=case.get("tp_topk", "exact"))
                masks, handles = capture_masks(model)
                out[case["name"]] = {"logits": model(ids).logits.cpu(), "masks": masks}
                for h in handles:
                    h.remove()
                countdown.unsparsify(model)
                print(f"rank {rank} {case['name']}: {time.perf_counter() - t0:.1f} s", flush=True)
            out["restored"] = model(ids).logits.cpu()
        try:  # calibration reads whole layers: refused on a rank, with the fix in the message
            calibrate(model, IdTokenizer(), "mono", cases["k"], texts=cases["texts"], **cases["calibrate"],
                      progress=False)
            out["calibrate_refused"] = ""
        except ShardingError as error:
            out["calibrate_refused"] = str(error)
        try:
            train_predictors(model, IdTokenizer(), "dual", cases["k"], texts=cases["texts"], kind="lowrank",
                             **cases["calibrate"], progress=False)
            out["training_refused"] = ""
        except ShardingError as error:
            out["training_refused"] = str(error)
    except Exception:
        out["error"] = traceback.format_exc()
    torch.save(out, os.path.join(folder, f"rank{rank}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
