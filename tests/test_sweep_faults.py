"""Faults around the sweep's files: two writers at once, kill -9 mid-write, Ctrl-C mid-sweep.

Each scenario runs real processes against one output folder: what must hold is that no row is lost,
the CSV is never torn, and an interrupted sweep says how to resume. The writers of the first two are
forked from the test's own process (``multiprocessing``'s fork context), which has already imported
:mod:`countdown.eval.sweep.store`: a fresh interpreter would spend seconds importing torch before its
first row, and the writers touch no torch. The Ctrl-C scenario runs the command in a fresh
interpreter (``subprocess``), as a user does."""

import multiprocessing
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from countdown.eval.sweep import read_rows
from countdown.eval.sweep.store import SweepStore

SRC = str(Path(__file__).resolve().parents[1] / "src")
TESTS = str(Path(__file__).resolve().parent)
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, TESTS, os.environ.get("PYTHONPATH", "")])}
FORK = multiprocessing.get_context("fork")


def _row(method, i, value="0.5"):
    return {"model": "m", "method": method, "mode": "ideal", "sparsity": "0.8", "sparsity_real": "0.8",
            "task": f"t{i}", "metric": "acc", "value": value, "limit": "10", "n": "10", "setting": "limit=10",
            "artifacts": "", "seconds": "1.0", "date": "2026-11-23"}


class _StallingFile:
    """A file opened for writing whose first write, once ``stall`` is set, writes half of its data, flushes it
    to the disk, says "mid-write" and waits to be killed: a kill -9 that lands inside a write every time."""

    def __init__(self, f, stall, said):
        self._f, self._stall, self._said = f, stall, said

    def write(self, data):
        if self._stall.is_set():
            self._f.write(data[:len(data) // 2])
            self._f.flush()
            os.fsync(self._f.fileno())
            self._said.send("mid-write")
            time.sleep(120)
        return self._f.write(data)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return self._f.__exit__(*exc)

    def __getattr__(self, name):
        return getattr(self._f, name)


def _stall_writes_of(out, stall, said):
    """In a writer process: every file named m.csv* in ``out`` opened for writing (the CSV itself or a
    temporary file beside it or in a temporary folder beside it, whichever the store writes) stalls mid-write
    once ``stall`` is set, whether it is written through ``open()`` or through ``os.write``."""
    import builtins
    import io

    real_open, real_write = io.open, os.write

    def ours(name: Path) -> bool:
        return name.name.startswith("m.csv") and Path(out) in (name.parent, name.parent.parent)

    def stalling_open(file, mode="r", *args, **kwargs):
        f = real_open(file, mode, *args, **kwargs)
        name = Path(os.fsdecode(file)) if isinstance(file, (str, bytes, os.PathLike)) else None
        if name is not None and ours(name) and any(c in mode for c in "wax+"):
            return _StallingFile(f, stall, said)
        return f

    def stalling_write(fd, data):
        try:
            name = Path(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            name = None
        if name is not None and ours(name) and stall.is_set():
            real_write(fd, bytes(memoryview(data)[:len(data) // 2]))
            os.fsync(fd)
            said.send("mid-write")
            time.sleep(120)
        return real_write(fd, data)

    io.open = builtins.open = stalling_open
    os.write = stalling_write


def _write(out, method, n, pad, said, go, stall=None):
    """A writer process: says "ready", waits for ``go`` (when given), then adds ``n`` rows one at a time,
    saying the index of each once it is in (with ``stall``: see _stall_writes_of)."""
    if stall is not None:
        _stall_writes_of(out, stall, said)
    store = SweepStore(out, "m", wait=30)
    said.send("ready")
    if go is not None:
        assert go.wait(60)
    for i in range(n):
        store.add([_row(method, i, value="x" * pad)])
        said.send(i)


def _writer(out, method, n, pad=1, go=None, stall=None):
    """A forked writer process and the receiving end of what it says."""
    said, says = FORK.Pipe(duplex=False)
    proc = FORK.Process(target=_write, args=(out, method, n, pad, says, go, stall), daemon=True)
    proc.start()
    says.close()
    return proc, said


def test_two_sweeps_into_one_folder_keep_all_their_rows(tmp_path):
    """Two runs with different methods merge into one CSV at the same time: every row of both stays."""
    SweepStore(tmp_path, "m").add([_row("seed", 0)])  # a row from an earlier run must survive too
    go = FORK.Event()
    writers = [_writer(tmp_path, "dense", 40, go=go), _writer(tmp_path, "mono", 40, go=go)]
    for _, said in writers:
        assert said.poll(60) and said.recv() == "ready"
    go.set()  # both start adding at the same moment
    for proc, said in writers:
        proc.join(timeout=120)
        assert proc.exitcode == 0, "a writer failed (its traceback is in the captured stderr)"
        said.close()
    rows = read_rows(tmp_path / "m.csv")
    assert len(rows) == 81
    for method in ("dense", "mono"):
        assert sorted(int(r["task"][1:]) for r in rows if r["method"] == method) == list(range(40))
    assert not list(tmp_path.glob("*countdown-tmp*"))


def test_kill_9_mid_write_leaves_the_previous_csv_intact(tmp_path):
    """A writer killed inside a write, and at random moments, leaves a CSV that parses and holds whole rows
    only; the next writer finishes and leaves no temporary file behind."""
    rng = random.Random(0)
    for attempt in range(4):  # a fork is cheap: the first kill inside a write, then three random moments
        out = tmp_path / f"run{attempt}"
        stall = FORK.Event() if attempt == 0 else None
        proc, said = _writer(out, "dense", 10_000, pad=20_000, stall=stall)  # 20 kB rows: each rewrite takes a while
        assert said.poll(60) and said.recv() == "ready"
        assert said.poll(60) and said.recv() == 0  # the first row is in
        if attempt == 0:
            stall.set()  # the next write of the CSV (or of its temporary file) stops halfway
            while True:
                assert said.poll(60), "the writer never wrote again"
                if said.recv() == "mid-write":
                    break
        else:
            time.sleep(rng.uniform(0.05, 0.6))
        proc.kill()  # SIGKILL
        proc.join(timeout=30)
        assert proc.exitcode == -9
        said.close()
        rows = read_rows(out / "m.csv")
        assert rows and all(r["value"] == "x" * 20_000 for r in rows)
        assert sorted(int(r["task"][1:]) for r in rows) == list(range(len(rows)))  # a prefix of the run
        SweepStore(out, "m").add([_row("mono", 0)])  # the next run merges on top
        assert len(read_rows(out / "m.csv")) == len(rows) + 1
        assert not list(out.glob("*countdown-tmp*"))


SWEEP = """
import functools, signal, sys, time
# Ctrl-C as a terminal delivers it: a shell runs background jobs with SIGINT ignored, and Python then keeps it
# ignored (a `make test &` saw the child sleep through the signal)
signal.signal(signal.SIGINT, signal.default_int_handler)
from lm_eval.tasks import TaskManager
from test_lmeval import WORDS, _write_tiny_task, tiny_model, tiny_tokenizer
import countdown.cli, countdown.eval.sweep.command as command, countdown.eval.sweep.measure as measure
from countdown.eval.sweep import run_sweep

root = sys.argv[1]
tok = tiny_tokenizer()
manager = TaskManager(include_path=str(_write_tiny_task(__import__("pathlib").Path(root))), include_defaults=False)
command.run_sweep = functools.partial(run_sweep, model=tiny_model(len(tok)), tokenizer=tok, task_manager=manager,
                                      ppl_texts=[" ".join(WORDS)] * 4, ppl_window=16, progress=False)
real_ppl = measure.measure_ppl
def slow_ppl(*args, **kwargs):
    print("perplexity cell under way", flush=True)
    time.sleep(120)  # Ctrl-C arrives here, in the middle of a cell
    return real_ppl(*args, **kwargs)
measure.measure_ppl = slow_ppl
sys.exit(countdown.cli.main(["sweep", "--model", "tiny", "--methods", "dense,mono", "--modes", "ideal",
                             "--sparsity", "0.5", "--tasks", "tiny_mc", "--ppl-tokens", "60",
                             "--agreement-prompts", "0", "--out", root + "/out"]))
"""


def test_ctrl_c_prints_saved_cells_and_the_resume_command(tmp_path):
    proc = subprocess.Popen([sys.executable, "-u", "-c", SWEEP, str(tmp_path)], env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    seen = []
    for line in proc.stdout:  # wait until the lm-eval pass is saved and a perplexity cell is under way
        seen.append(line)
        if "perplexity cell under way" in line:
            break
    assert any("[2]" in line for line in seen), "".join(seen)[-2000:]
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    said = "".join(seen) + out
    assert proc.returncode == 130, err[-2000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    assert "interrupted. 2 of 6 cells are saved" in said
    assert "Resume with the same command" in said and "countdown sweep --model tiny --methods dense,mono" in said
    rows = read_rows(tmp_path / "out" / "tiny.csv")
    assert {(r["method"], r["task"]) for r in rows} == {("dense", "tiny_mc"), ("mono", "tiny_mc")}
