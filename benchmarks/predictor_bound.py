"""How fast could dual[lowrank] decode if its predictor cost nothing in the MLP's chain? A speed-only bound.

Runs benchmarks/decode.py with ``countdown.kernels.dual_block`` (the route of dual[lowrank]'s MLP half in a folded
layer) replaced by one that skips the predictor's two GEMVs: each layer's scores are the ones its real predictor
gave on the layer's first call (computed then with the real kernels and kept; the cut is applied in the sparse
kernel, so the cuts fitted on decode steps still set the kept fraction), and the same rows are read every step.
What is left in the chain is the norm kernel, the sparse kernel and its partials' sum with the add: three launches,
what a dual route whose predictor ran elsewhere (e.g. beside the attention, from the layer's input: Deja Vu's
look-ahead) would keep. (Dropping the norm too, x = h, is not a bound: the un-normalised hidden states move the
cuts fitted on the model's own decode steps, and the step then kept 3.7 % of the rows instead of 10 %.)

The tokens are wrong (the mask does not follow the token): the harness checks are skipped, and the rows measure
time only; the kept fraction of the stand-in's eager calls is printed at the end. Everything else (the dense
baseline, the floor, mono, ...) is the real benchmark. Usage (a GPU): ``PYTHONPATH=src python
benchmarks/predictor_bound.py --methods "dual[lowrank]" --ks 0.9 --out DIR`` (every argument goes to decode.py;
``--skip-checks`` is added).
"""

from __future__ import annotations

import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
KEPT: list = []  # the kept fraction of each eager call (the last ones: the timed k's cut)
CALLS: list = []  # one entry per call of the stand-in (printed at the end: a row that never took it measured nothing)


def bounded_dual_block():
    """A stand-in for kernels.dual_block with the predictor's launches gone (see the module's docstring)."""
    from countdown import kernels
    from countdown.kernels import _onepass
    from countdown.kernels.dual import dual_block as real_block
    from countdown.kernels._common import split_threshold

    cache: dict = {}

    def block(h, norm_w, eps, w_gate, w_up, w_down_t, pred_a, pred_b, cut, activation="silu"):
        h2 = h.reshape(-1, h.shape[-1])
        if h2.shape[0] != 1:
            return real_block(h, norm_w, eps, w_gate, w_up, w_down_t, pred_a, pred_b, cut, activation)
        key = pred_b.data_ptr()
        capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
        if key not in cache:  # the real predictor's scores for this layer, once (the cut is applied in the kernel)
            if capturing:
                raise RuntimeError("predictor_bound: a layer's first call is inside a CUDA graph capture; its "
                                   "predictor's launches would be captured and the bound would measure them")
            from countdown.kernels import _linear  # noqa: F401  (registers the GEMV ops)

            latent = torch.ops.countdown.decode_norm_linear(h2, norm_w, float(eps), pred_a.t(), None)
            cache[key] = torch.ops.countdown.decode_linear(latent, pred_b.t(), None, None).clone()
        ind = cache[key]
        CALLS.append(1)
        x2 = kernels.block_input(h2, norm_w, eps)
        cut_t, cut_f = split_threshold(cut)
        if not capturing:
            KEPT.append(float((ind > (cut_f if cut_t is None else cut_t)).float().mean()))
        return _onepass.onepass_mlp(x2, w_gate, w_up, w_down_t, cut_t, cut_f, "gt", activation, gate=True, up=True,
                                    ind=ind, residual=h2).reshape(h.shape)

    return block


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] in (["-h"], ["--help"]):
        print(__doc__)
        return 0
    if not torch.cuda.is_available() and "--smoke" not in argv:
        print("benchmarks/predictor_bound.py needs a CUDA GPU (it times the decode step; --smoke runs on CPU)")
        return 2
    from countdown import kernels

    kernels.dual_block = bounded_dual_block()
    sys.path.insert(0, HERE)
    import decode

    rc = decode.main(argv + ["--skip-checks"])
    last = KEPT[-64:]
    print(f"predictor_bound: the stand-in served {len(CALLS)} MLP calls; kept fraction of its last {len(last)} "
          f"eager calls {sum(last) / max(len(last), 1):.4f}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
