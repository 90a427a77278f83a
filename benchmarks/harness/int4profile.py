"""Where a decode step's time goes, kernel by kernel, on the step's critical path (``benchmarks/int4_decode.py
--profile``).

With programmatic dependent launch (kernels/jit_helpers.py) a kernel starts before the one before it ends and waits at
its start, so the profiler's own durations overlap and add up to more than the step. Here each kernel is charged
the time from the end of the kernels before it (on the device's timeline) to its own end: its cost to the step.
Time with no kernel running is charged to ``<idle> before K``, K the kernel that ends the gap (what the device
waited to start: the host, a launch, a dependency). One ``generate_fast`` call is profiled (its prompt's kernels
included: they are charged once, the decode kernels once a step); per step = the call's total over its new tokens.
"""

from __future__ import annotations

import collections
import csv
import os

import torch

FIELDS = ["run", "device", "date", "weights", "method", "sparsity", "kernel", "calls_per_step", "us_per_step"]


def critical_path(run, steps: int) -> list[tuple[str, float, float]]:
    """(kernel, calls a step, microseconds a step on the critical path) of the CUDA kernels ``run()`` launches,
    the most costly first, the ``<idle> before K`` gaps among them (calls: gaps a step)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    return charge([(e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA], steps)


def charge(spans, steps: int) -> list[tuple[str, float, float]]:
    """:func:`critical_path`'s attribution of kernel spans (start, end, name) in microseconds: each kernel pays from
    the latest end before it (or its own start, if later) to its end; the time no kernel ran goes to ``<idle> before
    K``, K the kernel whose start ends the gap."""
    spans = sorted(spans)
    cost = collections.defaultdict(lambda: [0, 0.0])
    end = spans[0][0] if spans else 0.0
    for start, stop, name in spans:
        if start > end:
            gap = cost[f"<idle> before {name[:66]}"]
            gap[0] += 1
            gap[1] += start - end
        entry = cost[name[:80]]
        entry[0] += 1
        entry[1] += max(0.0, stop - max(start, end))
        end = max(end, stop)
    rows = [(name, calls / steps, us / steps) for name, (calls, us) in cost.items()]
    return sorted(rows, key=lambda r: -r[2])


def profile_step(model, ids, new_tokens: int, stamp: dict, what: dict, out: str, log) -> None:
    """Profile one compiled ``generate_fast`` call (the step already compiled by a timed call before it), append
    its kernels to ``<out>/step_kernels.csv`` and log the costliest ten."""
    from countdown.decode.generate import generate_fast

    rows = critical_path(lambda: generate_fast(model, ids, new_tokens, compile=True, eos_token_id=[]), new_tokens)
    path = os.path.join(out, "step_kernels.csv")
    new = not os.path.exists(path)
    with open(path, "a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        if new:
            writer.writeheader()
        for name, calls, us in rows:
            writer.writerow({**stamp, **what, "kernel": name, "calls_per_step": round(calls, 2),
                             "us_per_step": round(us, 2)})
    total = sum(r[2] for r in rows)
    idle = sum(r[2] for r in rows if r[0].startswith("<idle>"))
    log(f"  profile {what['weights']} {what['method']} {what['sparsity']}: {total:.0f} us a step on the critical "
        f"path (prompt included), {idle:.0f} of them with no kernel running")
    for name, calls, us in rows[:10]:
        log(f"    {us:8.1f} us a step  {calls:6.1f} calls  {us / max(calls, 1e-9):7.2f} us a call  {name[:60]}")
