"""A model's fp32 weights as their GGUF quantized blocks: small enough to travel, rebuilt bit for bit.

countdown's real models are GGUF files that transformers de-quantizes to fp32 once (the cache of
:mod:`countdown.data.model_cache`). A GPU machine that has no GGUF reader, no network and a 64 MiB limit
per upload cannot do that, and reading a whole GGUF file (its tokenizer metadata included) is slow.
A *weights pack* keeps only what the fp32 tensors are made of:

* for each parameter of the cached (reference) model, the quantized blocks of the GGUF tensor it
  came from, rows already in the order transformers puts them (the Q/K row permutation of Llama
  GGUF files is a permutation of whole rows, so it applies to the blocks), and the quantization type;
* parameters that no GGUF tensor reproduces bit for bit after de-quantization (the norms that
  transformers shifts by 1 for Gemma, any F32 tensor) stored as their fp32 values;
* the sha256 of every reference tensor's fp32 bytes.

:func:`pack_gguf` builds it here from the GGUF file and the cached fp32 model (checking that every
tensor it writes de-quantizes to the reference bit for bit); :func:`load_pack` rebuilds the state dict
there with ``gguf.quants.dequantize`` (the de-quantizer transformers itself uses) and checks every
tensor against its sha256, so the model on the GPU is exactly the model the CPU reference uses.
File: 8 bytes little-endian header length, the JSON header, then the raw blocks.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

FORMAT = "countdown-weights-pack"


def _digest(array: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(array, dtype=np.float32).tobytes()).hexdigest()


def _rows_order(target: np.ndarray, source: np.ndarray) -> np.ndarray | None:
    """``order`` with ``source[order] == target`` row for row (bit for bit), or None."""
    if target.shape != source.shape or target.ndim != 2:
        return None
    where: dict[bytes, list[int]] = {}
    for i, row in enumerate(source):
        where.setdefault(row.tobytes(), []).append(i)
    order = []
    for row in target:
        hits = where.get(row.tobytes())
        if not hits:
            return None
        order.append(hits.pop() if len(hits) > 1 else hits[0])
    return np.asarray(order)


def pack_gguf(gguf_path: str | os.PathLike, reference: dict, out_path: str | os.PathLike) -> dict:
    """Write the weights pack of ``reference`` (``{name: fp32 tensor}``, the cached model's state
    dict) from the GGUF file it was de-quantized from; returns the header."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    from ...io import atomic_path

    reader = GGUFReader(str(gguf_path))
    sources = []
    for t in reader.tensors:
        raw = np.asarray(t.data)
        deq = np.asarray(dequantize(raw, t.tensor_type), dtype=np.float32)
        rows = deq.reshape(-1, deq.shape[-1]) if deq.ndim >= 2 else deq.reshape(1, -1)
        sources.append((t, raw.reshape(rows.shape[0], -1), rows))
    by_size: dict[int, list] = {}
    for s in sources:
        by_size.setdefault(s[2].size, []).append(s)
    entries, blobs, offset = {}, [], 0
    for name, tensor in reference.items():
        ref = tensor.detach().to("cpu").float().numpy()
        ref2 = ref.reshape(-1, ref.shape[-1]) if ref.ndim >= 2 else ref.reshape(1, -1)
        entry, blob = None, None
        for t, raw, deq in by_size.get(ref.size, []):
            if t.tensor_type.name in ("F32",):
                continue
            if deq.shape == ref2.shape and np.array_equal(deq, ref2):
                entry, blob = {"qtype": t.tensor_type.name, "gguf": t.name}, raw
            else:
                order = _rows_order(ref2, deq)
                if order is not None:
                    entry, blob = {"qtype": t.tensor_type.name, "gguf": t.name, "rows_permuted": True}, raw[order]
            if entry is not None:
                break
        if entry is None:  # F32 in the GGUF, or changed by transformers (Gemma's norms): the values themselves
            entry, blob = {"qtype": "F32"}, np.ascontiguousarray(ref, dtype=np.float32).view(np.uint8)
        else:
            check = np.asarray(dequantize(np.ascontiguousarray(blob), _qtype(entry["qtype"])), dtype=np.float32)
            if not np.array_equal(check.reshape(ref.shape), ref):
                raise ValueError(f"{name}: the packed blocks do not de-quantize to the reference tensor")
        data = np.ascontiguousarray(blob).tobytes()
        entry.update(shape=list(ref.shape), offset=offset, nbytes=len(data), sha256=_digest(ref))
        entries[name] = entry
        blobs.append(data)
        offset += len(data)
    header = {"format": FORMAT, "version": 1, "gguf": Path(gguf_path).name, "tensors": entries}
    text = json.dumps(header, sort_keys=True).encode()
    with atomic_path(Path(out_path), suffix=".pack") as tmp:
        with open(tmp, "wb") as fh:
            fh.write(struct.pack("<Q", len(text)))
            fh.write(text)
            for data in blobs:
                fh.write(data)
    return header


def _qtype(name: str):
    from gguf import GGMLQuantizationType

    return GGMLQuantizationType[name]


def read_header(path: str | os.PathLike) -> tuple[dict, int]:
    """``(header, offset of the data)`` of a weights pack; a clear error for anything else."""
    with open(path, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise ValueError(f"{path} is not a countdown weights pack (too short)")
        (n,) = struct.unpack("<Q", head)
        try:
            header = json.loads(fh.read(n))
        except (ValueError, UnicodeDecodeError):
            header = None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise ValueError(f"{path} is not a countdown weights pack: make one with countdown.eval.offline.weights.pack_gguf")
    return header, 8 + n


def load_pack(path: str | os.PathLike, threads: int = 8) -> dict:
    """The state dict ``{name: fp32 torch tensor}`` of a weights pack, each tensor checked against
    its sha256 (a ValueError names every tensor that differs)."""
    import torch
    from gguf.quants import dequantize

    header, start = read_header(path)
    blob = np.memmap(path, dtype=np.uint8, mode="r")

    def one(item):
        name, e = item
        raw = np.asarray(blob[start + e["offset"]: start + e["offset"] + e["nbytes"]])
        if e["qtype"] == "F32":
            arr = raw.view(np.float32).reshape(e["shape"])
        else:
            rows = int(np.prod(e["shape"][:-1])) if len(e["shape"]) > 1 else 1
            arr = np.asarray(dequantize(raw.reshape(rows, -1), _qtype(e["qtype"])), dtype=np.float32).reshape(e["shape"])
        return name, arr, _digest(arr) == e["sha256"]

    with ThreadPoolExecutor(max(1, threads)) as pool:
        done = list(pool.map(one, header["tensors"].items()))
    bad = [name for name, _, ok in done if not ok]
    if bad:
        raise ValueError(f"weights pack {path}: {len(bad)} tensor(s) differ from the reference: {', '.join(bad[:5])}")
    return {name: torch.from_numpy(np.array(arr)) for name, arr, _ in done}


def build_model(config_dir: str | os.PathLike, pack: str | os.PathLike, device: str = "cuda", threads: int = 8):
    """The fp32 model of ``config_dir/config.json`` with the weights of ``pack`` on ``device``: every
    parameter loaded and checked (tied output embeddings tied), nothing left at its random init."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    state = load_pack(pack, threads)
    config = AutoConfig.from_pretrained(str(config_dir))
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    if unexpected or set(missing) - tied:
        raise ValueError(f"weights pack {pack} does not fit {config_dir}: missing {sorted(set(missing) - tied)[:5]}, "
                         f"unexpected {sorted(unexpected)[:5]}")
    model.tie_weights()
    return model.eval()


def main(argv: list[str] | None = None) -> int:
    """``python -m countdown.eval.offline.weights --model NAME --out FILE``: the weights pack of a catalogue model
    (its GGUF assembled and sha256-checked again, the cached fp32 model as the reference)."""
    import argparse
    import tempfile

    from safetensors.torch import load_file

    from ...data import models
    from ...options import path_option

    p = argparse.ArgumentParser(prog="python -m countdown.eval.offline.weights", description=main.__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help=f"catalogue model ({', '.join(models.CATALOGUE)})")
    p.add_argument("--out", required=True, type=path_option, help="the .pack file to write")
    args = p.parse_args(argv)
    if args.model not in models.CATALOGUE:
        p.error(f"--model {args.model!r} is not a catalogue model: choose from {', '.join(models.CATALOGUE)}")
    entry = models.CATALOGUE[args.model]
    folder = models._catalogue_folder(entry)  # the cached fp32 model (built on first use)
    reference = {}
    for f in sorted(folder.glob("*.safetensors")):
        reference.update(load_file(str(f)))
    with tempfile.TemporaryDirectory() as tmp:
        gguf_path = models.fetch_gguf(entry, Path(tmp))
        models.verify_sha256(gguf_path, entry.sha256)
        header = pack_gguf(gguf_path, reference, args.out)
    print(f"wrote {args.out}: {len(header['tensors'])} tensors, {Path(args.out).stat().st_size:,} bytes")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
