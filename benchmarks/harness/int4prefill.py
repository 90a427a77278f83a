"""The prompt of a 4-bit model (its calls of many tokens), the ``prefill`` part of ``benchmarks/int4_decode.py``: our
one-pass de-quantization then ``F.linear`` (``kernels/int4/dequant.py``, what ``Int4Linear`` runs on CUDA) against
the format's reference (``format.dequantize`` in eager PyTorch, then ``F.linear``) and the bf16 model, in one call.

``kernel_rows``: each weight shape of the Llama-3.1-8B decoder and lm_head (group 128, fp16 scales) de-quantized to
bf16 by each path, checked equal bit for bit, microseconds and TB/s of the bytes read and written (codes, scales and
offsets in, W~ out); ``prompt_rows``: one eager forward of a 64-token prompt through the model (the script's, bf16),
as ``countdown.generate`` runs a prompt, bf16 then 4-bit with each path, milliseconds, best of the repeats. Rows append,
under a lock, to ``<out>/prefill.csv`` (``run, device, date, part, weights, path, shape, ms, tb_s, vs_reference``:
the reference path's time over this row's).
"""

from __future__ import annotations

import contextlib
import csv
import io
import os
import sys
import time

import torch

from countdown.int4 import backends, linear
from countdown.int4.format import dequantize
from countdown.io.files import atomic_write
from countdown.io.locks import file_lock
from countdown.kernels import overrides
from countdown.kernels.common import available
from countdown.kernels.config import launch_config
from countdown.kernels.int4 import dequant as _int4_dequant

FIELDS = ["run", "device", "date", "part", "weights", "path", "shape", "ms", "tb_s", "vs_reference"]
SHAPES = {"q_proj": (4096, 4096), "k_proj": (1024, 4096), "gate_proj": (14336, 4096), "down_proj": (4096, 14336),
          "lm_head": (128256, 4096)}
SMOKE_SHAPES = {"q_proj": (64, 256), "down_proj": (128, 512)}
PROMPT = 64  # tokens, as the step part's prompt


def append(path: str, row: dict) -> None:
    """Add a row to the CSV: under the file's lock, the whole file rewritten atomically."""
    with file_lock(path, wait=60, what="the prefill results"):
        rows = []
        if os.path.exists(path):
            with open(path, newline="") as f:
                rows = list(csv.DictReader(f))
        text = io.StringIO()
        w = csv.DictWriter(text, fieldnames=FIELDS)
        w.writeheader()
        w.writerows(rows + [row])
        atomic_write(path, text.getvalue(), what="the prefill results")


def timed(fn, repeats: int, device: str, calls: int = 1) -> float:
    """Best wall time of ``fn()`` in ms, after one call (synchronized on CUDA); ``calls``: that many back to back
    a timing, the time divided by them (a kernel's own time, not the host's launch of one call)."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        if device == "cuda":
            torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t) / calls)
    return best * 1e3


@contextlib.contextmanager
def route(path: str):
    """4-bit Linears' calls of many tokens through ``ours`` (the one-pass kernel, on any device the kernel runs on)
    or the ``reference`` (format.dequantize): the registered kernels swapped for the block."""
    saved = list(linear._KERNELS)
    linear._KERNELS[:] = [e for e in saved if e[1] is not backends._run_many]
    if path == "ours":
        linear._KERNELS.append((lambda x, module: backends.backend_of(module) != "reference", backends._run_many))
    try:
        yield
    finally:
        linear._KERNELS[:] = saved


def kernel_rows(shapes: dict, device: str, repeats: int, stamp: dict, out: str, tiles: list) -> None:
    """Each weight shape de-quantized to bf16 by the reference and by our kernel at each of ``tiles`` (rows, bytes a
    program), checked equal bit for bit first; on CUDA each timing is of 20 calls back to back (the host's launch of
    one call would be most of a small shape's time)."""
    calls = 20 if device == "cuda" else 1
    g = torch.Generator(device=device).manual_seed(0)
    for name, (n, k) in shapes.items():
        q = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=device, generator=g)
        sc = (torch.rand(n, k // 128, device=device, generator=g) * 0.01 + 1e-4).half()
        of = (torch.randn(n, k // 128, device=device, generator=g) * 0.05).half()
        nbytes = n * k // 2 + 2 * sc.numel() * 2 + 2 * n * k
        want = dequantize(q, sc, of, torch.bfloat16)
        ref_ms = timed(lambda q=q, sc=sc, of=of: dequantize(q, sc, of, torch.bfloat16), repeats, device, calls)
        print(f"{name:10s} [{n} x {k}] reference {ref_ms * 1e3:9.1f} us  {nbytes / ref_ms / 1e9:5.2f} TB/s", flush=True)
        append(out, {**stamp, "part": "kernel", "weights": "int4", "path": "reference", "shape": name,
                     "ms": round(ref_ms, 4), "tb_s": round(nbytes / ref_ms / 1e9, 3), "vs_reference": 1.0})
        for bn, bb in tiles:
            with overrides(launch={"int4_dequant": dict(BN=bn, BB=bb)}):
                if not torch.equal(_int4_dequant.dequantize(q, sc, of, torch.bfloat16), want):
                    sys.exit(f"the one-pass de-quantization differs from format.dequantize at {name}, tile {bn}x{bb}")
                ms = timed(lambda q=q, sc=sc, of=of: _int4_dequant.dequantize(q, sc, of, torch.bfloat16), repeats,
                           device, calls)
            print(f"{'':10s} ours {bn}x{bb:<4d} {ms * 1e3:9.1f} us  {nbytes / ms / 1e9:5.2f} TB/s  "
                  f"{ref_ms / ms:5.1f}x the reference", flush=True)
            append(out, {**stamp, "part": "kernel", "weights": "int4", "path": f"ours {bn}x{bb}", "shape": name,
                         "ms": round(ms, 4), "tb_s": round(nbytes / ms / 1e9, 3),
                         "vs_reference": round(ref_ms / ms, 3)})


def prompt_rows(model, device: str, repeats: int, stamp: dict, out: str) -> None:
    """One eager forward of a 64-token prompt through ``model`` (bf16, as loaded), then through it in 4 bits with
    each path (the model is quantized in place)."""
    import countdown

    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (1, PROMPT), generator=torch.Generator().manual_seed(0)).to(device)
    with torch.no_grad():
        bf16_ms = timed(lambda: model(ids), repeats, device)
        countdown.quantize(model, group=128, lm_head=True)
        times, logits = {}, {}
        for path in ("reference", "ours"):
            with route(path):
                times[path] = timed(lambda: model(ids), repeats, device)
                logits[path] = model(ids).logits
    if not torch.equal(logits["ours"], logits["reference"]):
        sys.exit("the prompt's logits differ between the two 4-bit paths (they should be the same bits)")
    shape = f"{PROMPT} tokens"
    print(f"prompt of {PROMPT} tokens: bf16 {bf16_ms:.1f} ms, 4-bit reference {times['reference']:.1f} ms, "
          f"4-bit ours {times['ours']:.1f} ms ({times['reference'] / times['ours']:.2f}x the reference, "
          f"{times['ours'] / bf16_ms:.2f}x bf16's time)", flush=True)
    append(out, {**stamp, "part": "prompt", "weights": "bf16", "path": "-", "shape": shape, "ms": round(bf16_ms, 3),
                 "tb_s": "", "vs_reference": ""})
    for path, ms in times.items():
        append(out, {**stamp, "part": "prompt", "weights": "int4", "path": path, "shape": shape, "ms": round(ms, 3),
                     "tb_s": "", "vs_reference": round(times["reference"] / ms, 3)})


def run(model, device: str, out_dir: str, stamp: dict, tiles: str, repeats: int) -> None:
    """Both parts (``model``: the bf16 model the prompt part quantizes; on the CPU, small shapes and one repeat of
    the kernel part); ``tiles``: "8x256,16x128" (rows x bytes a program of our kernel), "" for the kernel's own."""
    if not available(torch.empty(0, device=device)):
        sys.exit("the prefill part runs our de-quantization kernel: on CUDA, or on the CPU under TRITON_INTERPRET=1")
    table = launch_config("int4_dequant")
    default = (table["BN"], table["BB"])
    chosen = [tuple(int(v) for v in t.split("x")) for t in tiles.split(",") if t] or [default]
    out = os.path.join(out_dir, "prefill.csv")
    cpu = device == "cpu"
    kernel_rows(SMOKE_SHAPES if cpu else SHAPES, device, 1 if cpu else repeats, stamp, out, chosen)
    prompt_rows(model, device, repeats, stamp, out)
