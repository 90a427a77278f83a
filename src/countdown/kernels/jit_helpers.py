"""The ``@triton.jit`` helpers that kernels of more than one family call, and programmatic dependent launch's wait
and signal.

* Activations, the keep rules (:data:`KEEP_RULES`, the one table of their codes), loads, rounding, the partial
  sums' store, an RMSNorm row, a sum of fp32 partials.
* Sparsity-Real counted inside the sparse kernels (:func:`add_count`). A patched Gated-MLP (countdown.patch.patched_mlp)
  counts ``1 - kept / rows`` in two device tensors, ``kept`` ([1] float64) and ``rows`` (one int64); the kernel
  that decides the rows adds them itself, so the count costs no launch and no host sync: every program adds the
  kept entries it decided (each token's own rows, never the batch's union) with one float64 atomic (integers:
  exact in any order), and one program of the grid (``lead``) the rows of the whole call. The ops declare both
  tensors mutated, so torch.compile keeps the updates and a CUDA graph replays the atomics with the kernel.
* Programmatic dependent launch (PDL, Hopper and later) between consecutive kernels of a decode step: every
  program of a kernel of ours signals at its start that the next grid may launch (``gdc_launch_dependents``), and
  the next grid's programs do what depends on no earlier output (pointers, set-up, a GEMV's first weight tile)
  before they wait for the previous grid (``gdc_wait``). The wait makes it correct wherever the signal is placed;
  what it saves is the launch gap and each kernel's prologue. It is on while some decoder layer is folded
  (``config.FOLDED``), where each layer's step is a chain of our kernels only; behind an Inductor kernel it has
  nothing to overlap and only holds SM slots while it waits. Whether a launch uses it, and its launch arguments:
  config.pdl_mode and config.launch_kwargs.
"""

from __future__ import annotations

import triton
import triton.language as tl

# The keep rules' codes (the kernels' MODE): each row i of an indicator ``ind`` is kept where
#   mask     ind != 0                 (a keep mask given)
#   gt       ind > thr                (a predictor's or the shadows' scores and a cut)
#   abs      |ind| > thr              (mono: ind = u)
#   abs_act  |act(ind)| > thr         (cats: ind = g)
#   dual     |act(g) u| > thr         (the 4-bit kept rows: g and u both the indicator, int4/rows.py)
KEEP_RULES = {"mask": 0, "gt": 1, "abs": 2, "abs_act": 3, "dual": 4, "error": 5}


@triton.jit
def act(g, ACT: tl.constexpr):
    """fp32 in, fp32 out: 0 SiLU, g * sigmoid(g); 1 GELU-tanh, g * sigmoid(2c (g + 0.044715 g^3))."""
    if ACT == 0:
        return g / (1.0 + tl.exp(-g))
    else:
        z = 1.5957691216057308 * (g + 0.044715 * g * g * g)
        return g / (1.0 + tl.exp(-z))


@triton.jit
def act_grad(g, ACT: tl.constexpr):
    """fp32 in, fp32 out: the derivative of :func:`act`, sig(z) + g sig(z) (1 - sig(z)) z' with z = g (SiLU) or
    2c (g + 0.044715 g^3) (GELU-tanh)."""
    if ACT == 0:
        z = g
        dz = 1.0
    else:
        z = 1.5957691216057308 * (g + 0.044715 * g * g * g)
        dz = 1.5957691216057308 * (1.0 + 0.134145 * g * g)
    sig = 1.0 / (1.0 + tl.exp(-z))
    return sig + g * sig * (1.0 - sig) * dz


@triton.jit
def keep(ind, thr, MODE: tl.constexpr, ACT: tl.constexpr):
    """Whether rows are kept, by their indicator ``ind`` and threshold (the rules mask, gt, abs, abs_act)."""
    v = ind.to(tl.float32)
    if MODE == 0:
        k = v != 0.0
    elif MODE == 1:
        k = v > thr
    elif MODE == 2:
        k = tl.abs(v) > thr
    else:
        k = tl.abs(act(v, ACT)) > thr
    return k


@triton.jit
def load_vec(X, kd, n, EVEN: tl.constexpr):
    """X[kd] in fp32, zero past n (EVEN: kd covers exactly n, no mask)."""
    if EVEN:
        v = tl.load(X + kd).to(tl.float32)
    else:
        v = tl.load(X + kd, mask=kd < n, other=0.0).to(tl.float32)
    return v


@triton.jit
def round_to(v, DT: tl.constexpr):
    """fp32 v rounded to DT's precision (round to nearest even), kept in fp32. For bf16 this is done on
    the bits, because the interpreter's fp32 -> bf16 cast truncates."""
    if DT == tl.bfloat16:
        bits = v.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    elif DT == tl.float16:
        return v.to(tl.float16).to(tl.float32)
    else:
        return v


@triton.jit
def store_partial(P, pid, yacc, kd, d_model, BIG: tl.constexpr, EVEN_D: tl.constexpr):
    """Program ``pid``'s fp32 partial sum [d_model] into row ``pid`` of P (the one-token sparse kernels:
    sparse_mlp/one_token.py, sparse_mlp/select.py)."""
    if BIG:
        off = pid.to(tl.int64) * d_model + kd
    else:
        off = pid * d_model + kd
    if EVEN_D:
        tl.store(P + off, yacc)
    else:
        tl.store(P + off, yacc, mask=kd < d_model)


@triton.jit
def add_count(KEPT, ROWS, kept, rows, lead):
    """KEPT[0] += kept (as float64) in the calling program; ROWS[0] += rows (as int64) where ``lead``."""
    tl.atomic_add(KEPT, tl.cast(kept, tl.float64), sem="relaxed")
    if lead:
        tl.atomic_add(ROWS, tl.cast(rows, tl.int64), sem="relaxed")


@triton.jit
def rms_norm_row(X, G, eps, k, d, EVEN: tl.constexpr, DT: tl.constexpr):
    """RMSNorm of the row X[k] with weight G[k] (k covers d; EVEN: exactly), in fp32 rounded as transformers
    rounds to DT (decode_step/rmsnorm.py; the one-token kernel that normalises its own input)."""
    if EVEN:
        x = tl.load(X + k).to(tl.float32)
        g = tl.load(G + k).to(tl.float32)
    else:
        x = tl.load(X + k, mask=k < d, other=0.0).to(tl.float32)
        g = tl.load(G + k, mask=k < d, other=0.0).to(tl.float32)
    r = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / d + eps)
    return round_to(g * round_to(x * r, DT), DT)


@triton.jit
def partial_sum(P, B, i, n, S: tl.constexpr, HAS_B: tl.constexpr, CG: tl.constexpr = False):
    """Entries ``i`` of the sum over S of fp32 partials [S, n] (plus the bias B[i] where HAS_B), in fp32, in order.
    CG: the partials from L2, not L1 (written by other programs of the same launch: int4/rows_down.py)."""
    cm: tl.constexpr = ".cg" if CG else ""
    m = tl.load(P + i, mask=i < n, other=0.0, cache_modifier=cm)
    for j in tl.static_range(1, S):
        m += tl.load(P + j * n + i, mask=i < n, other=0.0, cache_modifier=cm)
    if HAS_B:
        m += tl.load(B + i, mask=i < n, other=0.0).to(tl.float32)
    return m


# ------------------------------------------------------------------------- programmatic dependent launch
# (whether a launch uses it, and its launch arguments: config.pdl_mode, config.pdl_launch)
try:  # Triton >= 3.3 (the device image has 3.6)
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: F401
    HAVE_GDC = True
except ImportError:  # pragma: no cover - older Triton
    gdc_launch_dependents = gdc_wait = None
    HAVE_GDC = False


@triton.jit
def gdc_enter(LATE: tl.constexpr):
    """A PDL-launched program's start: signal that the next grid may launch, then wait for the previous one; LATE:
    wait first, so the next grid launches only once every program here is past its wait (the kernels before this
    one have then finished, and the next grid may read their outputs before its own wait)."""
    if LATE:
        gdc_wait()
        gdc_launch_dependents()
    else:
        gdc_launch_dependents()
        gdc_wait()
