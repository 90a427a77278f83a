"""Timing on the device: copy bandwidth, CUDA-graph timing over rotating inputs, peak memory.

Every speed figure of the benchmarks is a ratio taken in one run, next to the device's own
device-to-device copy bandwidth measured in that run (bytes read + written): the practical roofline.
"""

from __future__ import annotations

import gc
import statistics
import time
from typing import Callable, Sequence

import torch


def copy_bandwidth(nbytes: int = 2 << 30, reps: int = 20, device: str | torch.device = "cuda") -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written (median of
    ``reps`` copies of ``nbytes`` bytes after 3 warm-up copies). Needs a CUDA device."""
    if torch.device(device).type != "cuda":
        raise ValueError("copy_bandwidth times a CUDA device-to-device copy: give a CUDA device")
    a = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 255)
    b = torch.empty_like(a)
    times = []
    for _ in range(reps + 3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        b.copy_(a)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del a, b
    torch.cuda.empty_cache()
    return 2 * nbytes / statistics.median(times[3:])


def time_graph(calls: Sequence[Callable[[], object]], reps: int = 25, device: str | torch.device | None = None) -> float:
    """Median microseconds per call of ``calls`` run back to back.

    On CUDA: the calls are warmed up on a side stream (compiles, allocations), captured in ONE CUDA
    graph and the graph replayed ``reps`` times; the median replay over ``len(calls)``. Give calls
    that cycle through several weight sets and inputs (more bytes than the L2 cache holds) so that no
    call finds its weights cached by the previous one. On CPU (smoke tests): one host-timed pass.
    """
    if not calls:
        raise ValueError("time_graph needs at least one call")
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if torch.device(device).type != "cuda":
        start = time.perf_counter()
        for call in calls:
            call()
        return (time.perf_counter() - start) * 1e6 / len(calls)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    for _ in range(3):
        graph.replay()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for start, end in events:
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    us = statistics.median(s.elapsed_time(e) for s, e in events) * 1e3 / len(calls)
    del graph
    return us


def free_memory() -> None:
    """Collect garbage and return cached CUDA blocks, so the next measurement starts clean."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


class PeakMemory:
    """``with PeakMemory() as peak: ...; peak.bytes``: the peak CUDA memory allocated inside the block
    (None on a machine without CUDA)."""

    def __enter__(self) -> "PeakMemory":
        free_memory()
        self.bytes = None
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        return self

    def __exit__(self, *exc) -> None:
        if torch.cuda.is_available():
            self.bytes = torch.cuda.max_memory_allocated()


class Budget:
    """Seconds left of a wall-clock budget that started when this object was made."""

    def __init__(self, seconds: float):
        self.deadline = time.perf_counter() + seconds

    def left(self) -> float:
        return self.deadline - time.perf_counter()


def spread(values: Sequence[float]) -> dict:
    """``{"min", "median", "max", "n"}`` of a list of timings (NaN entries dropped)."""
    seen = sorted(v for v in values if v == v)
    if not seen:
        return {"min": float("nan"), "median": float("nan"), "max": float("nan"), "n": 0}
    return {"min": seen[0], "median": statistics.median(seen), "max": seen[-1], "n": len(seen)}
