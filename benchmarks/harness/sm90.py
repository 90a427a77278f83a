"""Triton kernels compiled for sm_90 (H100 / H200) on a machine without a GPU: registers, spills, shared memory.

:class:`Compile` stands in for a ``@triton.jit`` kernel: ``kernel[grid](...)`` then compiles with the launch's
own arguments through Triton's own ptxas and logs the resource usage (``cuobjdump -res-usage``), so the real
compiler's type and layout errors (which the CPU interpreter cannot see) show up before device time is
spent. :func:`compile_check` does it for every variant of ``sparse_mlp/chain.py`` / ``down.py`` the kernel table
runs (``benchmarks/mlp_kernels.py --compile-check``); ``benchmarks/few.py --compile-check`` wraps ``few_tokens.py``'s
kernel (each through :func:`harness.launches.stand_in`, for the block of the check only).
"""

from __future__ import annotations

import os

import torch

from countdown.kernels.sparse_mlp import chain, down

from .launches import stand_in
from .mlpbench import DOWN_SWEEP, DTYPE, GLU_SWEEP, MAIN, SHAPES, log


class Compile:
    """Stands in for ``kernel[grid](...)``: compiles for sm_90 with the launch's own arguments (no GPU
    needed: Triton's own ptxas) and logs registers, spills and shared memory; failures are appended
    to ``failures``."""

    TYS = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int32: "i32",
           torch.uint8: "u8", torch.int64: "i64", torch.float64: "fp64"}  # fp64: the Sparsity-Real counter
    TAG_KEYS = ("MODE", "GATE", "UP", "BP", "CHUNK", "BLOCK_M", "BLOCK_K", "BLOCK_N", "USE_DOT", "DENSE",
                "REDUCE", "HAS_KEEP", "BLOCK_I")

    def __init__(self, jit, failures: list):
        self.jit, self.failures = jit, failures

    def __getitem__(self, grid):
        def run(*args, **kw):
            import inspect
            import subprocess
            import tempfile

            import triton
            import triton.language as tl
            from triton.backends.compiler import GPUTarget
            from triton.compiler import ASTSource

            cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
            opts = {k: kw.pop(k) for k in ("num_warps", "num_stages", "enable_fp_fusion") if k in kw}
            kw.pop("launch_pdl", None)  # a launch attribute, not a kernel argument
            params = inspect.signature(self.jit.fn).parameters
            binding = inspect.signature(self.jit.fn).bind(*args, **kw)
            binding.apply_defaults()
            bound = binding.arguments
            sig, const, attrs = {}, {}, {}
            for i, (name, prm) in enumerate(params.items()):
                v = bound[name]
                if prm.annotation is tl.constexpr or "constexpr" in str(prm.annotation):
                    sig[name], const[(i,)] = "constexpr", v
                elif isinstance(v, torch.Tensor):
                    sig[name], attrs[(i,)] = "*" + self.TYS[v.dtype], [["tt.divisibility", 16]]
                elif isinstance(v, int) and v == 1:  # Triton specialises ints equal to 1
                    sig[name], const[(i,)] = "constexpr", 1
                elif isinstance(v, int):
                    sig[name] = "i32"
                    if v % 16 == 0:
                        attrs[(i,)] = [["tt.divisibility", 16]]
                else:
                    sig[name] = "fp32"
            tag = f"{self.jit.fn.__name__} {grid} {opts} " + " ".join(
                f"{k}={bound[k]}" for k in self.TAG_KEYS if k in bound)
            try:
                c = triton.compile(ASTSource(self.jit, sig, const, attrs), target=GPUTarget("cuda", 90, 32),
                                   options=opts)
                with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
                    f.write(c.asm["cubin"])
                    f.flush()
                    res = subprocess.run([cuobjdump, "-res-usage", f.name], capture_output=True, text=True).stdout
                use = " ".join(w for l in res.splitlines() if "REG:" in l for w in l.split()
                               if w.split(":")[0] in ("REG", "STACK", "SHARED", "LOCAL"))
                ptx = c.asm.get("ptx", "")
                use += f" DYN_SHARED:{c.metadata.shared}" + "".join(  # what the loop became on sm_90
                    f" {name}" for name, key in (("MMA", "mma."), ("ASYNC", "cp.async")) if key in ptx)
                log(f"ok   {use:40s} {tag}")
            except Exception as e:  # noqa: BLE001
                self.failures.append(tag)
                log(f"FAIL {tag}: {str(e).splitlines()[-1][:300]}")
        return run


def compile_check(shapes, only_defaults=False) -> bool:
    """Compile every kernel variant for sm_90 on this machine (no GPU needed: Triton's own ptxas) and
    print registers, spills and shared memory; False if any fails to compile. Catches what the CPU
    interpreter cannot (type and layout errors of the real compiler) before spending device time."""
    failures = []
    with stand_in(["chain_gate_up", "chain_down"], lambda name, jit: Compile(jit, failures)):
        for name in shapes:
            d_model, d_inter, act = SHAPES[name]
            for batch in (1, 8):
                b = 1 if batch == 1 else 8
                glu_cfgs = [None] + (GLU_SWEEP[b] if name == MAIN and not only_defaults else [])
                down_cfgs = [None] + (DOWN_SWEEP[b] if name == MAIN and not only_defaults else [])
                dtypes = (DTYPE, torch.float16, torch.float32) if name == MAIN else (DTYPE,)
                for dt in dtypes:
                    e = lambda *shape, d=dt: torch.empty(shape, dtype=d)
                    x, w, ind = e(batch, d_model), e(d_inter, d_model), e(batch, d_inter)
                    mask = torch.empty(batch, d_inter, dtype=torch.uint8)
                    plan = down.DownPlan(batch, d_inter, d_model)
                    work = plan.workspace("cpu", zeroed=False)
                    thr_t = torch.empty((), dtype=torch.float32)
                    for cfg in glu_cfgs if dt == DTYPE else [None]:
                        for mode, gate, up in (("abs", True, False), ("abs_act", False, True), ("gt", True, True),
                                               ("mask", True, True)):
                            src = mask if mode == "mask" else ind
                            chain.gate_up(x, w, w, src, thr_t if mode == "abs" else None, 0.5, mode, act, gate, up,
                                          config=cfg, zero=work)
                        if cfg is None and batch > 1:
                            chain.gate_up(x, w, w, ind, None, 0.5, "gt", act, True, True, per_token=True)
                    for cfg in down_cfgs if dt == DTYPE else [None]:
                        down.sparse_down(ind, None, w, plan=down.DownPlan(batch, d_inter, d_model, config=cfg))
                        if cfg is None:
                            down.sparse_down(ind, mask.bool(), w, plan=plan, workspace=work)
                            if batch > 1:
                                pl = down.DownPlan(batch, d_inter, d_model, per_token=True)
                                down.sparse_down(ind, None, w, per_token=True, plan=pl)
    log(f"compile check: {len(failures)} failures")
    return not failures

