"""A folded decode layer's MLP half, h + mlp(RMSNorm(h)), by several routes, alternating:

    dual[lowrank] (rank-512 predictor):
    "norm kernel"  the norm on its own kernel (kernels/_block.py block_input), then dual_gated_mlp(residual=h):
                   the predictor's two GEMVs, the sparse kernel, the partials' sum with the add (five launches)
    "dual_block"   kernels/dual.py dual_block with NORM_IN_PREDICTOR: the norm folded into the predictor's first
                   GEMV and into the sparse kernel (four launches, no norm kernel; opt-in: it measured slower)
    "x from predictor"  dual_block with X_FROM_PREDICTOR: the norm folded into the predictor's first GEMV, which
                   also writes x for the sparse kernel (four launches, no norm kernel)
    "x from int8 predictor" (``--int8``): the same with A^T and B^T as int8 rows and their scales
                   (quant.quantize_rows_int8; a speed probe: the selectors do not hold int8 factors yet)
    dual[shadow4] (``--shadow``; 4-bit shadows of the set's W_gate and W_up, group 64):
    "shadow norm kernel"  the norm on its own kernel, then shadow_dual_gated_mlp(residual=h): x's int8 rounding,
                   the shadow GEMV, the sparse kernel, the partials' sum with the add (five launches)
    "shadow_block" kernels/shadow.py shadow_dual_block: the norm inside the x-prep launch (four launches)

    COUNTDOWN_PDL=1 PYTHONPATH=src python benchmarks/block_ab.py [--out DIR] [--ks 0.9] [--rounds 3] [--shadow] [--int8]

Llama-3.1-8B shape (d_model 4096, d_inter 14336), bf16, one token, random weights with a cut fitted so that each k
skips that share of rows on the inputs timed; CUDA-graph replays over 8 weight sets (more bytes than L2 holds),
median us a call, the routes alternated ``--rounds`` times. Each route is first checked against a float64 reference
with the same kept rows (the cut sits in a gap of the scores). Prints a table; ``--out`` writes block_ab.{csv,md}.
``--small`` runs a small shape on any device (a smoke test, not a timing).
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics

import torch

if not torch.cuda.is_available():  # --small on a CPU: the kernels on Triton's interpreter (set before its import)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import countdown.kernels as K  # noqa: E402
from countdown.bench import time_graph  # noqa: E402
from countdown.kernels import _onepass, _rmsnorm, _shadow_block, dual  # noqa: E402
from countdown.kernels.quant import shadow_score  # noqa: E402

COLUMNS = ["route", "k", "sparsity_real", "us", "us_min", "us_max", "max_err_vs_float64", "device", "date"]


def add_shadows(sets, group: int) -> None:
    """Each set's 4-bit shadows of W_gate and W_up in the kernels' layout (``prep``) and float64 copies."""
    for s in sets:
        qg, sg = K.quantize_rtn(s["wg"], 4, group)
        qu, su = K.quantize_rtn(s["wu"], 4, group)
        s["prep"] = K.prepare_shadow(qg, sg, qu, su, 4)
        s["deq"] = (K.dequantize(qg, sg).double(), K.dequantize(qu, su).double())


def problem(n_sets: int, d: int, di: int, rank: int, device: str, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator(device="cpu").manual_seed(seed)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dtype)

    sets = []
    for _ in range(n_sets):
        sets.append(dict(h=rnd(1, d, scale=3.0), g=(1 + 0.3 * torch.randn(d, generator=g)).to(device, dtype),
                         wg=rnd(di, d, scale=d**-0.5), wu=rnd(di, d, scale=d**-0.5), wdt=rnd(di, d, scale=di**-0.5),
                         a=rnd(rank, d, scale=d**-0.5).t(), b=rnd(di, rank, scale=rank**-0.5).t()))
    return sets


def exact_scores(s, eps: float, shadow: bool = False) -> torch.Tensor:
    """The predictor's scores (or, ``shadow``, |u~ act(g~)| of the shadows) [1, d_inter] in float64 from the
    unrounded RMSNorm(h)."""
    h = s["h"].double()
    x = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * s["g"].double()
    if shadow:
        return shadow_score(x @ s["deq"][1].t(), x @ s["deq"][0].t(), "silu").double()
    return (x @ s["a"].double()) @ s["b"].double()


def fit_cut(sets, k: float, eps: float, shadow: bool = False) -> torch.Tensor:
    """One cut for all sets, in a gap of their pooled scores near the k-quantile."""
    v = torch.sort(torch.cat([exact_scores(s, eps, shadow)[0] for s in sets])).values
    i = min(int(k * v.numel()), v.numel() - 2)
    w = max(1, min(64, v.numel() // 200))
    j = i + int(torch.argmax(v[i:i + w + 1].diff()))  # the widest gap among the next few values
    return torch.tensor(float(v[j] + v[j + 1]) / 2)


def reference(s, cut, eps: float, act: str, shadow: bool = False) -> tuple[torch.Tensor, float]:
    """float64 h + mlp(x), x = RMSNorm(h) as transformers rounds it, the rows kept by the exact scores; kept share."""
    x = _rmsnorm.rms_norm_ref(s["h"], s["g"], eps)
    keep = exact_scores(s, eps, shadow) > float(cut)
    y = K.gated_mlp_masked_ref(*(t.double() for t in (x, s["wg"], s["wu"], s["wdt"])), keep, act)
    return s["h"].double() + y, float(keep.float().mean())


def _served(out, name: str):
    if out is None:
        raise SystemExit(f"{name} did not serve this input (see its docstring)")
    return out


def add_int8_factors(sets) -> None:
    """Each set's predictor factors A^T [r, d] and B^T [d_inter, r] as int8 rows with float32 scales."""
    from countdown.kernels.quant import quantize_rows_int8

    for s in sets:
        s["aq"], s["as"] = quantize_rows_int8(s["a"].t())
        s["bq"], s["bs"] = quantize_rows_int8(s["b"].t())


def routes(cut_vec, eps: float, act: str, int8: bool = False):
    def norm_kernel(s):
        x = K.block_input(s["h"], s["g"], eps)
        return K.dual_gated_mlp(x, s["wg"], s["wu"], s["wdt"], s["a"], s["b"], cut_vec, act, residual=s["h"])

    def block(norm_in_predictor: bool):
        def run(s):  # the switches are read when the route runs (and a CUDA graph captures it)
            dual.NORM_IN_PREDICTOR, dual.X_FROM_PREDICTOR = norm_in_predictor, not norm_in_predictor
            return _served(K.dual_block(s["h"], s["g"], eps, s["wg"], s["wu"], s["wdt"], s["a"], s["b"], cut_vec,
                                        act), "dual_block")
        return run

    def int8_route(s):
        from countdown.kernels._common import split_threshold

        latent, x = torch.ops.countdown.decode_norm_linear_x_q(s["h"], s["g"], eps, s["aq"], s["as"])
        ind = torch.ops.countdown.decode_linear_q(latent, s["bq"], s["bs"])
        cut_t, cut_f = split_threshold(cut_vec)
        return _onepass.onepass_mlp(x, s["wg"], s["wu"], s["wdt"], cut_t, cut_f, "gt", act, gate=True, up=True,
                                    ind=ind, residual=s["h"])

    out = {"norm kernel": norm_kernel, "dual_block": block(True), "x from predictor": block(False)}
    if int8:
        out["x from int8 predictor"] = int8_route
    return out


def shadow_routes(cut, eps: float, act: str):
    cut_t = torch.tensor(float(cut), dtype=torch.float32, device="cuda" if torch.cuda.is_available() else "cpu")

    def norm_kernel(s):
        x = K.block_input(s["h"], s["g"], eps)
        return K.shadow_dual_gated_mlp(x, s["prep"], cut_t, s["wg"], s["wu"], s["wdt"], act, residual=s["h"])

    def block(s):
        _shadow_block.ENABLED = True
        return _served(K.shadow_dual_block(s["h"], s["g"], eps, s["prep"], cut_t, s["wg"], s["wu"], s["wdt"], act),
                       "shadow_dual_block")

    return {"shadow norm kernel": norm_kernel, "shadow_block": block}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None)
    ap.add_argument("--ks", default="0.9", help="comma-separated sparsities (default 0.9)")
    ap.add_argument("--rounds", type=int, default=3, help="times each route is timed, alternating (default 3)")
    ap.add_argument("--small", action="store_true", help="a small shape on any device: a smoke test, not a timing")
    ap.add_argument("--shadow", action="store_true", help="also dual[shadow4]'s two routes")
    ap.add_argument("--int8", action="store_true", help="also dual[lowrank] with int8 predictor factors (a probe)")
    args = ap.parse_args()
    ks = [float(k) for k in args.ks.split(",")]
    if any(not 0 < k < 1 for k in ks):
        raise SystemExit(f"--ks takes sparsities in (0, 1), got {args.ks}")
    if args.out:  # fail before the work, not after it
        os.makedirs(args.out, exist_ok=True)
        if not os.access(args.out, os.W_OK):
            raise SystemExit(f"--out {args.out} is not writable: give a folder you can write")
    cuda = torch.cuda.is_available()
    if not cuda and not args.small:
        raise SystemExit("benchmarks/block_ab.py times CUDA kernels: run it on a GPU machine (or --small to smoke-test)")
    if not cuda:
        _onepass.ONEPASS_OFF_CUDA = _onepass.IND_GEMV_OFF_CUDA = True
    device = "cuda" if cuda else "cpu"
    d, di, rank, n_sets = (64, 96, 16, 2) if args.small else (4096, 14336, 512, 8)
    eps, act = 1e-5, "silu"
    sets = problem(n_sets, d, di, rank, device, torch.bfloat16)
    if args.shadow:
        add_shadows(sets, 32 if args.small else 64)
    if args.int8:
        add_int8_factors(sets)
    name = torch.cuda.get_device_name() if cuda else "cpu"
    today = str(datetime.date.today())
    rows = []
    for k, shadow in [(k, sh) for k in ks for sh in ((False, True) if args.shadow else (False,))]:
        cut = fit_cut(sets, k, eps, shadow)
        cut_vec = torch.full((di,), float(cut), device=device)  # per row, as the low-rank selectors hold it
        refs = [reference(s, cut, eps, act, shadow) for s in sets]
        real = 1 - statistics.mean(r[1] for r in refs)
        fns = shadow_routes(cut, eps, act) if shadow else routes(cut_vec, eps, act, args.int8)
        errs = {}
        for rname, fn in fns.items():
            err = 0.0
            for s, (exact, _) in zip(sets, refs):
                got = fn(s).double()
                err = max(err, float((got - exact).abs().max() / exact.abs().max()))  # normwise
            errs[rname] = err
            if err > 0.02:
                raise SystemExit(f"{rname} at k={k}: max relative error {err:.3g} against float64: not timed")
        times = {r: [] for r in fns}
        for _ in range(args.rounds):
            for rname, fn in fns.items():
                times[rname].append(time_graph([lambda s=s, fn=fn: fn(s) for s in sets] * (4 if cuda else 1)))
        for rname, ts in times.items():
            rows.append(dict(route=rname, k=k, sparsity_real=round(real, 4), us=round(statistics.median(ts), 2),
                             us_min=round(min(ts), 2), us_max=round(max(ts), 2),
                             max_err_vs_float64=f"{errs[rname]:.2e}", device=name, date=today))
    lines = [f"# The MLP half of a folded layer with or without a norm kernel ({name}, {today})", "",
             "`COUNTDOWN_PDL=1 PYTHONPATH=src python benchmarks/block_ab.py" + (" --small" if args.small else "")
             + (" --shadow" if args.shadow else "") + (" --int8" if args.int8 else "") + f" --ks {args.ks} --rounds {args.rounds}`; one token, bf16, "
             f"d_model {d}, d_inter {di}, rank {rank}; CUDA-graph replays over {n_sets} weight sets, median us a call "
             f"(min-max over {args.rounds} alternating rounds).", "",
             "| route | k | Sparsity-Real | us (min-max) | vs its norm kernel route | max error / max value vs float64 |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        base_route = "shadow norm kernel" if r["route"].startswith("shadow") else "norm kernel"
        base = next(b["us"] for b in rows if b["k"] == r["k"] and b["route"] == base_route)
        lines.append(f"| {r['route']} | {r['k']} | {r['sparsity_real']} | {r['us']} ({r['us_min']}-{r['us_max']}) | "
                     f"{base / r['us']:.3f}x | {r['max_err_vs_float64']} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        from countdown.io import atomic_write

        csv = ",".join(COLUMNS) + "\n" + "".join(",".join(str(r[c]) for c in COLUMNS) + "\n" for r in rows)
        atomic_write(os.path.join(args.out, "block_ab.csv"), csv)
        atomic_write(os.path.join(args.out, "block_ab.md"), text)


if __name__ == "__main__":
    main()
