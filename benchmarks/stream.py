"""The streaming sparse phase (kernels/_stream.py) against _onepass.py's, on the shadow route.

    PYTHONPATH=src python benchmarks/stream.py --out DIR [--budget SECONDS] [--tiny]

Llama-3.1-8B's MLP shape (4096 x 14336, SiLU), bf16, batch 1, 4-bit shadows (group 64), CUDA graphs
over 4 rotating weight sets and 8 inputs (benchmarks/kernels.py's Problem; far past L2); roofline =
bytes read / the device-to-device copy bandwidth of the same run. Stages (each skipped once
--budget seconds have passed; results written after every stage):

1. check: at the real shape, k = 0.9 and 0.5, every input: the kept-row lists hold exactly the rows
   whose GEMV score is above the cut; the stream route against the float64 MLP on those rows.
2. sweep: the sparse phase alone (lists or indicator given) at k = 0.9 and 0.7: _onepass.py's
   default against _stream.py under each configuration of STREAM_SWEEP; the fastest kept.
3. mlp: the whole shadow MLP, eager, k = 0.5 ... 0.9: dense cuBLAS, route "onepass", route "stream".
4. compiled: x + mlp(x) under torch.compile(fullgraph=True): dense, onepass, stream, each k.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import sys
import time

import torch

import countdown.kernels as K
from countdown.bench import copy_bandwidth
from countdown.kernels import _common, _gemv, _onepass, _stream
from countdown.kernels.quant import shadow_bytes
from countdown.io import atomic_write

import shadow as sb  # noqa: E402  (benchmarks/shadow.py: shadows, cuts, kept rows)
from kernels import Problem, dense_chain, log, safe_time  # noqa: E402

ACT, BITS, GROUP, E = "silu", 4, 64, 2
KS = (0.5, 0.6, 0.7, 0.8, 0.9)
_C = ("BM", "num_warps", "PER_SM", "PREFETCH")
STREAM_SWEEP = [dict(zip(_C, c)) for c in [
    (2, 8, 2, True), (2, 4, 2, True), (1, 4, 4, True), (1, 4, 4, False), (2, 4, 4, False), (4, 8, 2, False),
    (4, 8, 1, True), (2, 8, 3, True), (1, 8, 4, True), (4, 4, 2, False), (1, 4, 6, False), (2, 8, 1, True)]]
T0 = time.time()


@contextlib.contextmanager
def stream_config(cfg: dict | None):
    old = dict(_stream.CONFIG)
    _stream.CONFIG.update(cfg or {})
    try:
        yield
    finally:
        _stream.CONFIG.clear()
        _stream.CONFIG.update(old)


def lists_for(p: Problem, c) -> list:
    return [_gemv.launch(x, p.w(i)["prep"]["q"], p.w(i)["prep"]["scale"], ACT, cut=c["shadow"])
            for i, x in enumerate(p.xs)]


def check(p: Problem) -> dict:
    res, ok = dict(list_mismatch=0, mlp_maxerr=0.0, kept_rows=0), True
    for k in (0.9, 0.5):
        c = sb.cuts(p, k)
        for i, x in enumerate(p.xs):
            w = p.w(i)
            score = _gemv.launch(x, w["prep"]["q"], w["prep"]["scale"], ACT)[0]
            _common.POISON_OUTPUTS = True
            lists, counts = _gemv.launch(x, w["prep"]["q"], w["prep"]["scale"], ACT, cut=c["shadow"])
            with sb.route("stream"):
                out = K.shadow_dual_gated_mlp(x, w["prep"], c["shadow"], w["wg"], w["wu"], w["wdt"], ACT)
            _common.POISON_OUTPUTS = False
            cap = lists.numel() // counts.numel()
            listed = torch.cat([lists[j * cap: j * cap + int(n)] for j, n in enumerate(counts.tolist())])
            want = torch.nonzero(score > c["shadow"]).flatten()
            res["list_mismatch"] += int(listed.numel() != want.numel() or not torch.equal(listed.sort().values.long(), want))
            keep = torch.zeros(1, p.d_inter, dtype=torch.bool, device=x.device)
            keep[0, want] = True
            res["kept_rows"] += int(keep.sum())
            ref64 = K.gated_mlp_masked_ref(*[t.double() for t in (x, w["wg"], w["wu"], w["wdt"])], keep, ACT)
            ref_t = K.gated_mlp_masked_ref(x, w["wg"], w["wu"], w["wdt"], keep, ACT)
            err = (out.double() - ref64).abs()
            ok &= bool(((err - 2 * (ref_t.double() - ref64).abs() - 1e-2 * ref64.abs().max()).max() <= 0).item())
            res["mlp_maxerr"] = max(res["mlp_maxerr"], err.max().item())
    res["ok"] = bool(ok and res["list_mismatch"] == 0)
    return res


def row(rows, kind, method, us, nbytes, bw, k=None, kept=None, dense_us=None, cfg=None):
    roof = nbytes / bw * 1e6
    rows.append(dict(kind=kind, method=method, k=k, us=us, kept=kept, mb=nbytes / 1e6, roofline_us=roof,
                     vs_roofline=us / roof, bw_share=roof / us, vs_dense=(dense_us / us) if dense_us else None,
                     config=json.dumps(cfg, sort_keys=True) if cfg else ""))
    log(f"{kind:10s} {method:28s} k={k} {us:8.2f} us  roofline {roof:6.2f} us ({roof / us:.0%})")


def onepass_alone(p: Problem, c, inds) -> float:
    """us of _onepass.py's sparse phase alone (indicator given), default configuration."""
    return safe_time("onepass", [(lambda x=x, w=p.w(i), ind=inds[i]: _onepass.onepass_mlp(
        x, w["wg"], w["wu"], w["wdt"], c["shadow"], 0.0, "gt", ACT, gate=True, up=True, ind=ind))
        for i, x in enumerate(p.xs)])


def stream_alone(p: Problem, lists, cfg=None) -> float:
    """us of _stream.py's sparse phase alone (lists given) under ``cfg`` (default: its CONFIG)."""
    return safe_time(f"stream {cfg}", [(lambda x=x, w=p.w(i), lc=lists[i]: _stream.stream_partials(
        x, lc[0], lc[1], lc[0].numel() // lc[1].numel(), w["wg"], w["wu"], w["wdt"], ACT, cfg).sum(
        0, keepdim=True).to(x.dtype)) for i, x in enumerate(p.xs)])


def sweep(p: Problem, bw, rows, meta) -> None:
    best = {}
    for k in (0.9, 0.7):
        c = sb.cuts(p, k)
        kept = sb.kept_union(p, "dual[shadow4]", c)
        nbytes = 3 * kept * p.d_inter * p.d_model * E
        lists = lists_for(p, c)
        inds = [_gemv.launch(x, p.w(i)["prep"]["q"], p.w(i)["prep"]["scale"], ACT) for i, x in enumerate(p.xs)]
        one, st = onepass_alone(p, c, inds), stream_alone(p, lists)
        row(rows, "sparse", "onepass (default)", one, nbytes, bw, k, kept, cfg=_onepass.CONFIGS["gt"])
        row(rows, "sparse", "stream (default)", st, nbytes, bw, k, kept, cfg=_stream.CONFIG)
        for cfg in STREAM_SWEEP:
            t = stream_alone(p, lists, {**_stream.CONFIG, **cfg})
            row(rows, "sparse", "stream (sweep)", t, nbytes, bw, k, kept, cfg=cfg)
            best.setdefault(json.dumps(cfg, sort_keys=True), []).append(t)
    valid = {key: sum(ts) for key, ts in best.items() if all(t == t for t in ts)}
    if valid:
        meta["best_stream"] = json.loads(min(valid, key=valid.get))
        _stream.CONFIG.update(meta["best_stream"])
        log(f"best stream config (sum over k = 0.9, 0.7): {meta['best_stream']}")


PROBE_KS = (0.0, 0.5, 0.9, 0.99, 1.0)
PROBE_CONFIGS = [dict(BM=4, num_warps=4, PER_SM=2, PREFETCH=False), dict(BM=2, num_warps=8, PER_SM=1, PREFETCH=True)]


def probe(p: Problem, bw, rows) -> None:
    """The sparse phase alone from nothing kept (k = 1: launch, partials and their sum only) to all
    kept (k = 0: the row-gather's own bandwidth), onepass and two stream configurations."""
    for k in PROBE_KS:
        c = sb.cuts(p, k)
        kept = sb.kept_union(p, "dual[shadow4]", c)
        nbytes = max(3 * kept * p.d_inter * p.d_model * E, 1.0)
        lists = lists_for(p, c)
        inds = [_gemv.launch(x, p.w(i)["prep"]["q"], p.w(i)["prep"]["scale"], ACT) for i, x in enumerate(p.xs)]
        one = onepass_alone(p, c, inds)
        row(rows, "probe", "onepass (default)", one, nbytes, bw, k, kept, cfg=_onepass.CONFIGS["gt"])
        for cfg in PROBE_CONFIGS:
            row(rows, "probe", "stream", stream_alone(p, lists, cfg), nbytes, bw, k, kept, cfg=cfg)


def pdl(p: Problem, bw, rows, meta) -> None:
    """Programmatic dependent launch (kernels/_pdl.py) off and on: the compiled x + mlp(x), both
    routes, k = 0.5 / 0.7 / 0.9; first the outputs with it on against off (same kernels: equal)."""
    from countdown.kernels import _pdl

    sh = shadow_bytes(p.d_inter, p.d_model, BITS, GROUP)
    diffs = []
    for route in ("onepass", "stream"):
        def f(x, q, sc, cut, wg, wu, wdt, route=route):
            with sb.route(route):
                return x + K.shadow_dual_gated_mlp(x, {"q": q, "scale": sc}, cut, wg, wu, wdt, ACT)
        fn = torch.compile(f, fullgraph=True)
        for k in (0.5, 0.7, 0.9):
            c = sb.cuts(p, k)
            kept = sb.kept_union(p, "dual[shadow4]", c)
            for on in (False, True):
                _pdl.ENABLED = on
                args = lambda i: (p.xs[i], p.w(i)["prep"]["q"], p.w(i)["prep"]["scale"], c["shadow"], p.w(i)["wg"],
                                  p.w(i)["wu"], p.w(i)["wdt"])
                if k == 0.9:
                    out = fn(*args(0))
                    torch.cuda.synchronize()
                    diffs.append((route, on, out.float()))
                t = safe_time(f"{route} pdl={on}", [(lambda i=i: fn(*args(i))) for i in range(len(p.xs))])
                row(rows, "pdl", f"dual[shadow4] {route} pdl={'on' if on else 'off'}", t,
                    sh + 3 * kept * p.d_inter * p.d_model * E, bw, k, kept)
            _pdl.ENABLED = False
    meta["pdl_max_abs_diff"] = max((a[2] - b[2]).abs().max().item() for a, b in zip(diffs[::2], diffs[1::2]))
    log(f"pdl on vs off, largest output difference: {meta['pdl_max_abs_diff']}")


def mlp(p: Problem, bw, rows, compiled: bool) -> None:
    kind = "compiled" if compiled else "mlp"
    dense = (torch.compile(lambda x, wg, wu, wd: x + dense_chain(x, wg, wu, wd, ACT), fullgraph=True) if compiled
             else lambda x, wg, wu, wd: dense_chain(x, wg, wu, wd, ACT))
    d_us = safe_time("dense", [(lambda x=x, w=p.w(i): dense(x, w["wg"], w["wu"], w["wd"])) for i, x in enumerate(p.xs)])
    row(rows, kind, "dense", d_us, 3 * p.d_inter * p.d_model * E, bw, kept=1.0, dense_us=d_us)
    sh = shadow_bytes(p.d_inter, p.d_model, BITS, GROUP)
    for route in ("onepass", "stream"):
        def f(x, q, sc, cut, wg, wu, wdt):
            y = K.shadow_dual_gated_mlp(x, {"q": q, "scale": sc}, cut, wg, wu, wdt, ACT)
            return x + y if compiled else y
        fn = torch.compile(f, fullgraph=True) if compiled else f
        for k in KS:
            c = sb.cuts(p, k)
            kept = sb.kept_union(p, "dual[shadow4]", c)

            def make(i, c=c, route=route):
                x, w = p.xs[i], p.w(i)

                def g():
                    with sb.route(route):
                        return fn(x, w["prep"]["q"], w["prep"]["scale"], c["shadow"], w["wg"], w["wu"], w["wdt"])
                return g
            row(rows, kind, f"dual[shadow4] {route}", safe_time(route, [make(i) for i in range(len(p.xs))]),
                sh + 3 * kept * p.d_inter * p.d_model * E, bw, k, kept, d_us,
                cfg=_stream.CONFIG if route == "stream" else None)


def write(rows, out, meta) -> list[str]:
    os.makedirs(out, exist_ok=True)
    keys = ["kind", "method", "k", "us", "kept", "mb", "roofline_us", "vs_roofline", "bw_share", "vs_dense", "config"]
    csv = [",".join(keys)] + [",".join("" if r.get(k) is None else (f"{r[k]:.4g}" if isinstance(r[k], float)
                                       else f'"{r[k]}"' if k == "config" else str(r[k])) for k in keys) for r in rows]
    atomic_write(os.path.join(out, "stream.csv"), "\n".join(csv) + "\n")
    atomic_write(os.path.join(out, "stream.json"), json.dumps(dict(meta=meta, rows=rows), indent=1, default=str))
    fmt = lambda v, s="{:.2f}": "" if v is None else s.format(v)
    lines = [f"# Streaming sparse phase vs one-pass ({meta['device']}, {meta['date']})", "", f"`{meta['command']}`", "",
             f"Copy bandwidth {meta['copy_bw_tbs']:.2f} TB/s. Check: {meta.get('checks')}. "
             f"Stream config: {meta.get('best_stream', _stream.CONFIG)}", "",
             "| kind | method | k | us | kept | MB | roofline us | share of copy bw | x dense | config |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['kind']} | {r['method']} | {fmt(r['k'], '{}')} | {r['us']:.1f} | {fmt(r.get('kept'), '{:.3f}')} | "
              f"{r['mb']:.1f} | {r['roofline_us']:.1f} | {r['bw_share']:.0%} | {fmt(r.get('vs_dense'))} | {r['config']} |"
              for r in rows]
    atomic_write(os.path.join(out, "stream.md"), "\n".join(lines) + "\n")
    try:
        plot(rows, os.path.join(out, "stream.png"))
    except Exception as e:  # noqa: BLE001
        log(f"plot failed: {e}")
    return lines


def plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for kind, ls in (("mlp", "-"), ("compiled", "--")):
        for r in [r for r in rows if r["kind"] == kind and r["method"] == "dense"]:
            ax.axhline(r["us"], color="gray", ls=ls, label=f"dense ({kind})")
        for m in ("dual[shadow4] onepass", "dual[shadow4] stream"):
            rs = [r for r in rows if r["kind"] == kind and r["method"] == m]
            if rs:
                ax.plot([r["k"] for r in rs], [r["us"] for r in rs], "o" + ls, label=f"{m} ({kind})")
    rs = [r for r in rows if r["kind"] == "mlp" and r["method"] == "dual[shadow4] stream"]
    ax.plot([r["k"] for r in rs], [r["roofline_us"] for r in rs], "k:", label="shadow4 roofline")
    ax.set_xlabel("k (fraction of rows skipped)")
    ax.set_ylabel("us per MLP (Llama-3.1-8B shape, bf16, batch 1)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--budget", type=float, default=300.0, help="seconds; later stages are skipped past it")
    ap.add_argument("--pdl", action="store_true", help="only the check and the PDL stage (off against on)")
    ap.add_argument("--probe", action="store_true", help="only the check and the probe stage (k = 0 ... 1)")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke test (TRITON_INTERPRET=1), small shapes")
    args = ap.parse_args()
    if args.tiny:
        sb.D_MODEL, sb.D_INTER = 128, 96
        bw, device = 1e12, "cpu (smoke test)"
        _onepass.ONEPASS_OFF_CUDA = True
        STREAM_SWEEP[2:] = []
    elif not torch.cuda.is_available():
        sys.exit("benchmarks/stream.py needs a CUDA GPU (or --tiny under TRITON_INTERPRET=1)")
    else:
        bw, device = copy_bandwidth(), torch.cuda.get_device_name()
    log(f"copy bandwidth {bw / 1e12:.2f} TB/s on {device}")
    meta = dict(device=device, date=datetime.date.today().isoformat(), copy_bw_tbs=bw / 1e12,
                command="PYTHONPATH=src python " + " ".join(sys.argv), torch=torch.__version__,
                gemv_config=dict(_gemv.CONFIG), onepass_config=dict(_onepass.CONFIGS["gt"]))
    p = Problem(sb.D_MODEL, sb.D_INTER, ACT, 1, 16)
    sb.add_shadows(p)
    meta["checks"] = check(p)
    log(f"check: {meta['checks']}")
    rows: list[dict] = []
    lines = write(rows, args.out, meta)
    stages = [("sweep", lambda: sweep(p, bw, rows, meta), 40), ("mlp", lambda: mlp(p, bw, rows, False), 30),
              ("compiled", lambda: mlp(p, bw, rows, True), 40)]
    if args.probe:
        stages = [("probe", lambda: probe(p, bw, rows), 20)]
    if args.pdl:
        stages = [("pdl", lambda: pdl(p, bw, rows, meta), 30)]
    for name, fn, need in stages:
        if not meta["checks"]["ok"]:
            log(f"{name} skipped: the check failed")
            continue
        if (name == "compiled" and args.tiny) or time.time() - T0 > args.budget - need:
            log(f"{name} skipped ({time.time() - T0:.0f} s used)")
            continue
        fn()
        meta["elapsed_s"] = round(time.time() - T0, 1)
        lines = write(rows, args.out, meta)
    print("\n".join(lines[-len(rows) - 2:]))


if __name__ == "__main__":
    main()
