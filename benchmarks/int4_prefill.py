"""The prompt of a 4-bit model (its calls of many tokens): our one-pass de-quantization then ``F.linear``
(``kernels/_int4_dequant.py``, what ``Int4Linear`` runs on CUDA) against the format's reference
(``format.dequantize`` in eager PyTorch, then ``F.linear``) and the bf16 model, in one call.

    PYTHONPATH=src python benchmarks/int4_prefill.py --out results/int4 --run P1
    PYTHONPATH=src python benchmarks/int4_prefill.py --tiles 8x256,16x128,8x512 --out /tmp/p   # the kernel's tiles
    PYTHONPATH=src python benchmarks/int4_prefill.py --smoke --out /tmp/p                       # this script, CPU

Parts: ``kernel``: each weight shape of the Llama-3.1-8B decoder and lm_head (group 128, fp16 scales) de-quantized
to bf16 by each path, checked equal bit for bit, microseconds and TB/s of the bytes read and written (codes, scales
and offsets in, W~ out); ``prompt``: one eager forward of a ``--prompt``-token prompt through the model (random
weights, bf16), as ``countdown.generate`` runs a prompt, bf16 then 4-bit with each path: milliseconds, best of
``--repeats``. Rows append, under a lock, to ``<out>/prefill.csv`` (``run, device, date, part, weights, path,
shape, ms, tb_s, vs_reference``: the reference path's time over this row's).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import datetime
import io
import os
import sys
import time

FIELDS = ["run", "device", "date", "part", "weights", "path", "shape", "ms", "tb_s", "vs_reference"]
SHAPES = {"q_proj": (4096, 4096), "k_proj": (1024, 4096), "gate_proj": (14336, 4096), "down_proj": (4096, 14336),
          "lm_head": (128256, 4096)}
SMOKE_SHAPES = {"q_proj": (64, 256), "down_proj": (128, 512)}
SMOKE = {"num_hidden_layers": 2, "hidden_size": 128, "intermediate_size": 512, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 1000}


def append(path: str, row: dict) -> None:
    """Add a row to the CSV: under the file's lock, the whole file rewritten atomically."""
    from countdown.io.files import atomic_write
    from countdown.io.locks import file_lock

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


def timed(fn, repeats: int, device: str) -> float:
    """Best wall time of ``fn()`` in ms, after one call (synchronized on CUDA)."""
    import torch

    fn()
    best = float("inf")
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return best * 1e3


@contextlib.contextmanager
def route(path: str):
    """4-bit Linears' calls of many tokens through ``ours`` (the one-pass kernel, on any device the kernel runs on)
    or the ``reference`` (format.dequantize): the registered kernels swapped for the block."""
    from countdown.int4 import backends, linear

    saved = list(linear._KERNELS)
    linear._KERNELS[:] = [e for e in saved if e[1] is not backends._run_many]
    if path == "ours":
        linear._KERNELS.append((lambda x, module: backends.backend_of(module) != "reference", backends._run_many))
    try:
        yield
    finally:
        linear._KERNELS[:] = saved


def kernel_rows(shapes: dict, device: str, repeats: int, stamp: dict, out: str, tiles: list) -> None:
    import torch

    from countdown.int4.format import dequantize
    from countdown.kernels import _int4_dequant

    g = torch.Generator(device=device).manual_seed(0)
    for name, (n, k) in shapes.items():
        q = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=device, generator=g)
        sc = (torch.rand(n, k // 128, device=device, generator=g) * 0.01 + 1e-4).half()
        of = (torch.randn(n, k // 128, device=device, generator=g) * 0.05).half()
        nbytes = n * k // 2 + 2 * sc.numel() * 2 + 2 * n * k
        want = dequantize(q, sc, of, torch.bfloat16)
        ref_ms = timed(lambda q=q, sc=sc, of=of: dequantize(q, sc, of, torch.bfloat16), repeats, device)
        print(f"{name:10s} [{n} x {k}] reference {ref_ms * 1e3:9.1f} us  {nbytes / ref_ms / 1e9:5.2f} TB/s", flush=True)
        append(out, {**stamp, "part": "kernel", "weights": "int4", "path": "reference", "shape": name,
                     "ms": round(ref_ms, 4), "tb_s": round(nbytes / ref_ms / 1e9, 3), "vs_reference": 1.0})
        for bn, bb in tiles:
            _int4_dequant.BN, _int4_dequant.BB = bn, bb
            if not torch.equal(_int4_dequant.dequantize(q, sc, of, torch.bfloat16), want):
                sys.exit(f"the one-pass de-quantization differs from format.dequantize at {name}, tile {bn}x{bb}")
            ms = timed(lambda q=q, sc=sc, of=of: _int4_dequant.dequantize(q, sc, of, torch.bfloat16), repeats, device)
            print(f"{'':10s} ours {bn}x{bb:<4d} {ms * 1e3:9.1f} us  {nbytes / ms / 1e9:5.2f} TB/s  "
                  f"{ref_ms / ms:5.1f}x the reference", flush=True)
            append(out, {**stamp, "part": "kernel", "weights": "int4", "path": f"ours {bn}x{bb}", "shape": name,
                         "ms": round(ms, 4), "tb_s": round(nbytes / ms / 1e9, 3),
                         "vs_reference": round(ref_ms / ms, 3)})


def prompt_rows(device: str, args, stamp: dict, out: str) -> None:
    import torch

    import countdown

    if args.smoke:
        from transformers import LlamaConfig, LlamaForCausalLM

        model = LlamaForCausalLM(LlamaConfig(**SMOKE)).eval()
    else:
        model, _ = countdown.load_model("llama-3.1-8b-shape", dtype="bf16", device=device, random_weights=True)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (1, args.prompt), device=device, generator=torch.Generator(device).manual_seed(0))
    with torch.no_grad():
        bf16_ms = timed(lambda: model(ids), args.repeats, device)
        countdown.quantize(model, group=32 if args.smoke else 128, lm_head=True)
        times, logits = {}, {}
        for path in ("reference", "ours"):
            with route(path):
                times[path] = timed(lambda: model(ids), args.repeats, device)
                logits[path] = model(ids).logits
    if not torch.equal(logits["ours"], logits["reference"]):
        sys.exit("the prompt's logits differ between the two 4-bit paths (they should be the same bits)")
    shape = f"{args.prompt} tokens"
    print(f"prompt of {args.prompt} tokens: bf16 {bf16_ms:.1f} ms, 4-bit reference {times['reference']:.1f} ms, "
          f"4-bit ours {times['ours']:.1f} ms ({times['reference'] / times['ours']:.2f}x the reference, "
          f"{times['ours'] / bf16_ms:.2f}x bf16's time)", flush=True)
    append(out, {**stamp, "part": "prompt", "weights": "bf16", "path": "-", "shape": shape, "ms": round(bf16_ms, 3),
                 "tb_s": "", "vs_reference": ""})
    for path, ms in times.items():
        append(out, {**stamp, "part": "prompt", "weights": "int4", "path": path, "shape": shape, "ms": round(ms, 3),
                     "tb_s": "", "vs_reference": round(times["reference"] / ms, 3)})


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="results/int4")
    ap.add_argument("--run", default=datetime.datetime.now().strftime("%H%M"), help="the run column (groups a call)")
    ap.add_argument("--parts", default="kernel,prompt", help="any of kernel, prompt")
    ap.add_argument("--tiles", default="", help="the kernel's tiles to time, rows x bytes (e.g. 8x256,16x128); "
                    "default: the kernel's own")
    ap.add_argument("--prompt", type=int, default=64, help="prompt tokens")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU, Triton's interpreter")
    args = ap.parse_args(argv)
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before Triton is imported
    import torch

    from countdown.kernels import _int4_dequant

    device = "cpu" if args.smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        sys.exit("this benchmark times the GPU path: run it on a machine with CUDA (or --smoke on the CPU)")
    tiles = [tuple(int(v) for v in t.split("x")) for t in args.tiles.split(",") if t] or \
        [(_int4_dequant.BN, _int4_dequant.BB)]
    os.makedirs(args.out, exist_ok=True)
    out = os.path.join(args.out, "prefill.csv")
    stamp = {"run": args.run, "device": "CPU" if args.smoke else torch.cuda.get_device_name(),
             "date": datetime.date.today().isoformat()}
    parts = set(args.parts.split(","))
    default = (_int4_dequant.BN, _int4_dequant.BB)
    if "kernel" in parts:
        kernel_rows(SMOKE_SHAPES if args.smoke else SHAPES, device, 1 if args.smoke else args.repeats, stamp, out,
                    tiles)
        _int4_dequant.BN, _int4_dequant.BB = default
    if "prompt" in parts:
        prompt_rows(device, args, stamp, out)


if __name__ == "__main__":
    main()
