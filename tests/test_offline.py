"""Scoring the sweep elsewhere: export a job, score it with the lm-eval-free device module, replay it
through lm-eval; the CSV and per-document side file must equal the sweep computed on the CPU cell by
cell. And the weights pack: GGUF blocks that rebuild the reference fp32 tensors bit for bit."""

import csv
import json
import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

lm_eval = pytest.importorskip("lm_eval")
gguf = pytest.importorskip("gguf")
from conftest import tiny_model as arch_model  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402
from test_lmeval import WORDS, _write_tiny_task, tiny_model, tiny_tokenizer  # noqa: E402

from countdown.eval import sweep  # noqa: E402
from countdown.eval.offline import device, files, weights  # noqa: E402

GRID = dict(methods=("dense", "mono", "dual", "dual[hybrid]"), modes=("ideal", "prac"), sparsities=(0.5, 0.7),
            tasks=("tiny_mc",))
ATOL = 1e-4  # float32: the device pass batches prompts and continuations differently


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("offline")
    (root / "tasks").mkdir()
    manager = TaskManager(include_path=str(_write_tiny_task(root / "tasks")), include_defaults=False)
    tok = tiny_tokenizer()
    rng = random.Random(0)
    texts = [" ".join(rng.choice(WORDS) for _ in range(40)) for _ in range(6)]
    return SimpleNamespace(root=root, manager=manager, tok=tok, model=tiny_model(len(tok)), texts=texts)


def _run(setup, out_dir, **extra):
    return sweep.run_sweep("tiny", **GRID, out_dir=out_dir, ppl_tokens=0, agreement_prompts=0,
                           artifacts_dir=setup.root / "artifacts",
                           artifact_options={"texts": setup.texts, "num_tokens": 64, "window": 16},
                           model=setup.model, tokenizer=setup.tok, task_manager=setup.manager, batch_size=4,
                           progress=False, log=lambda line: None, **extra)


def _rows(path):
    with open(path, newline="") as fh:
        return {(r["method"], r["mode"], r["sparsity"], r["task"], r["metric"]): r for r in csv.DictReader(fh)}


def test_exported_scored_replayed_equals_the_cpu_sweep(setup, tmp_path):
    reference = _run(setup, tmp_path / "cpu")
    job = _run(setup, tmp_path / "gpu", export=tmp_path / "job")["job"]
    data = files.read_job(job)
    assert len(data["configs"]) == 1 + 2 * 2 * 2 + 2  # dense, mono and dual x 2 modes x 2 k, dual[hybrid] prac x 2
    # the device side: a model object and the job's files only (no lm-eval in countdown.eval.offline.device)
    configs = device.load_configs(data, job.parent, setup.model)
    scores = files.empty_scores(data)
    device.score_job(setup.model, data, configs, scores, tmp_path / "s.json.gz", chunk=3, batch_tokens=8,
                     stop_after=None, log=lambda line: None)
    out = _run(setup, tmp_path / "gpu", scores=[str(tmp_path / "s.json.gz")])
    ref, got = _rows(reference["csv"]), _rows(out["csv"])
    assert ref.keys() == got.keys()
    for key, r in ref.items():
        assert float(got[key]["value"]) == pytest.approx(float(r["value"]), abs=ATOL), key
        assert got[key]["n"] == r["n"]
        if r["sparsity_real"]:
            assert float(got[key]["sparsity_real"]) == pytest.approx(float(r["sparsity_real"]), abs=1e-12), key
    ref_docs, got_docs = _rows(reference["docs"]), _rows(out["docs"])
    assert {k: v["values"] for k, v in ref_docs.items()} == {k: v["values"] for k, v in got_docs.items()}
    # the sparse configurations are not dense in disguise (the comparison has something to compare)
    entries = scores["tasks"]["tiny_mc"]
    assert max(abs(a - b) for a, b in zip(entries["dense||"]["logp"], entries["mono|ideal|0.7"]["logp"])) > 1e-2


def test_replay_refuses_scores_of_other_requests(setup, tmp_path):
    job = _run(setup, tmp_path / "a", export=tmp_path / "job")["job"]
    data = files.read_job(job)
    scores = files.empty_scores(data)
    device.score_job(setup.model, data, device.load_configs(data, job.parent, setup.model), scores, tmp_path / "s.json.gz",
                     chunk=4, batch_tokens=64, stop_after=None, log=lambda line: None)
    scores["requests_sha256"]["tiny_mc"] = "0" * 64
    files.write_gz_json(tmp_path / "bad.json.gz", scores)
    with pytest.raises(ValueError, match="other tiny_mc requests"):
        _run(setup, tmp_path / "b", scores=[str(tmp_path / "bad.json.gz")])


def test_trimmed_artifacts_keep_the_selected_k(setup, tmp_path):
    import countdown

    art = countdown.calibrate(setup.model, setup.tok, "mono", [0.5, 0.6, 0.7], texts=setup.texts, num_tokens=64,
                              window=16, progress=False)
    trimmed = files.trim_artifacts(art, [0.7, 0.5])
    assert trimmed.sparsities == [0.7, 0.5]
    for k in (0.5, 0.7):
        assert torch.equal(trimmed.thresholds(k), art.thresholds(k))
    assert files.artifact_identity(art, [0.5, 0.7]) == files.artifact_identity(
        files.trim_artifacts(art, [0.5, 0.7]), [0.5, 0.7])
    assert files.artifact_identity(art, [0.5]) != files.artifact_identity(art, [0.7])


def _write_gguf(path, tensors):
    writer = gguf.GGUFWriter(str(path), "llama")
    for name, (array, qtype) in tensors.items():
        if qtype == "F32":
            writer.add_tensor(name, array.astype(np.float32))
        else:
            q = gguf.quants.quantize(array.astype(np.float32), gguf.GGMLQuantizationType[qtype])
            writer.add_tensor(name, q, raw_dtype=gguf.GGMLQuantizationType[qtype])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_weights_pack_rebuilds_the_model_bit_for_bit(tmp_path):
    model = arch_model("llama")
    rng = np.random.default_rng(0)
    tensors, reference = {}, {}
    for i, (name, p) in enumerate(model.state_dict().items()):
        array = p.numpy()
        if array.ndim == 2 and array.shape[1] % 32 == 0:
            # the GGUF holds the rows in another order (as Llama's Q/K are permuted in GGUF files)
            order = rng.permutation(array.shape[0]) if "q_proj" in name else np.arange(array.shape[0])
            tensors[f"t{i}"] = (array[order], "Q8_0")
            deq = gguf.quants.dequantize(gguf.quants.quantize(array[order], gguf.GGMLQuantizationType.Q8_0),
                                         gguf.GGMLQuantizationType.Q8_0)
            restored = np.empty_like(deq)
            restored[order] = deq
            reference[name] = torch.from_numpy(restored.astype(np.float32))
        else:  # an odd width (d_inter 97) or a norm: F32, shifted by 1 as transformers does Gemma's norms
            tensors[f"t{i}"] = (array, "F32")
            reference[name] = torch.from_numpy(array.copy() + (1.0 if "norm" in name else 0.0))
    _write_gguf(tmp_path / "m.gguf", tensors)
    header = weights.pack_gguf(tmp_path / "m.gguf", reference, tmp_path / "m.pack")
    assert any(e.get("rows_permuted") for e in header["tensors"].values())
    assert {e["qtype"] for e in header["tensors"].values()} == {"Q8_0", "F32"}
    model.config.save_pretrained(tmp_path / "cfg")
    rebuilt = weights.build_model(tmp_path / "cfg", tmp_path / "m.pack", device="cpu")
    state = rebuilt.state_dict()
    for name, t in reference.items():
        assert torch.equal(state[name], t), name
    # a damaged pack is refused, naming the tensor
    head, start = weights.read_header(tmp_path / "m.pack")
    name, entry = next((n, e) for n, e in head["tensors"].items() if e["qtype"] == "Q8_0")
    data = bytearray((tmp_path / "m.pack").read_bytes())
    data[start + entry["offset"] + 5] ^= 0xFF
    (tmp_path / "bad.pack").write_bytes(bytes(data))
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        weights.load_pack(tmp_path / "bad.pack")
    assert json.loads(json.dumps(head))["format"] == weights.FORMAT
