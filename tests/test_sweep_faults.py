"""Faults around the sweep's files: two writers at once, kill -9 mid-write, Ctrl-C mid-sweep.

Each scenario runs real processes (``subprocess``) against one output folder: what must hold is
that no row is lost, the CSV is never torn, and an interrupted sweep says how to resume."""

import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from countdown.sweep import read_rows
from countdown.sweep.store import SweepStore

SRC = str(Path(__file__).resolve().parents[1] / "src")
TESTS = str(Path(__file__).resolve().parent)
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, TESTS, os.environ.get("PYTHONPATH", "")])}


def _row(method, i, value="0.5"):
    return {"model": "m", "method": method, "mode": "ideal", "sparsity": "0.8", "sparsity_real": "0.8",
            "task": f"t{i}", "metric": "acc", "value": value, "limit": "10", "n": "10", "setting": "limit=10",
            "artifacts": "", "seconds": "1.0", "date": "2026-11-23"}


WRITER = """
import sys, time
from countdown.sweep.store import SweepStore
out, method, n, pad = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
store = SweepStore(out, "m", wait=30)
print("ready", flush=True)
for i in range(n):
    row = {"model": "m", "method": method, "mode": "ideal", "sparsity": "0.8", "sparsity_real": "0.8",
           "task": f"t{i}", "metric": "acc", "value": "x" * pad, "limit": "10", "n": "10",
           "setting": "limit=10", "artifacts": "", "seconds": "1.0", "date": "2026-11-23"}
    store.add([row])
    print(i, flush=True)
"""


def _writer(out, method, n, pad=1):
    return subprocess.Popen([sys.executable, "-c", WRITER, str(out), method, str(n), str(pad)], env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_two_sweeps_into_one_folder_keep_all_their_rows(tmp_path):
    """Two runs with different methods merge into one CSV at the same time: every row of both stays."""
    SweepStore(tmp_path, "m").add([_row("seed", 0)])  # a row from an earlier run must survive too
    a, b = _writer(tmp_path, "dense", 40), _writer(tmp_path, "mono", 40)
    for proc in (a, b):
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
    rows = read_rows(tmp_path / "m.csv")
    assert len(rows) == 81
    for method in ("dense", "mono"):
        assert sorted(int(r["task"][1:]) for r in rows if r["method"] == method) == list(range(40))
    assert not list(tmp_path.glob("*countdown-tmp*"))


def test_kill_9_mid_write_leaves_the_previous_csv_intact(tmp_path):
    """A writer killed at a random moment leaves a CSV that parses and holds whole rows only; the
    next writer finishes and leaves no temporary file behind."""
    rng = random.Random(0)
    for attempt in range(2):
        out = tmp_path / f"run{attempt}"
        proc = _writer(out, "dense", 10_000, pad=20_000)  # 20 kB rows: each rewrite takes a while
        assert proc.stdout.readline().strip() == "ready"
        proc.stdout.readline()  # the first row is in
        time.sleep(rng.uniform(0.05, 0.6))
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        proc.stdout.close()
        proc.stderr.close()
        rows = read_rows(out / "m.csv")
        assert rows and all(r["value"] == "x" * 20_000 for r in rows)
        assert sorted(int(r["task"][1:]) for r in rows) == list(range(len(rows)))  # a prefix of the run
        SweepStore(out, "m").add([_row("mono", 0)])  # the next run merges on top
        assert len(read_rows(out / "m.csv")) == len(rows) + 1
        assert not list(out.glob("*countdown-tmp*"))


SWEEP = """
import functools, sys, time
from lm_eval.tasks import TaskManager
from test_lmeval import WORDS, _write_tiny_task, tiny_model, tiny_tokenizer
import countdown.cli, countdown.sweep.command as command, countdown.sweep.measure as measure
from countdown.sweep import run_sweep

root = sys.argv[1]
tok = tiny_tokenizer()
manager = TaskManager(include_path=str(_write_tiny_task(__import__("pathlib").Path(root))), include_defaults=False)
command.run_sweep = functools.partial(run_sweep, model=tiny_model(len(tok)), tokenizer=tok, task_manager=manager,
                                      ppl_texts=[" ".join(WORDS)] * 4, ppl_window=16, progress=False)
real_ppl = measure.measure_ppl
def slow_ppl(*args, **kwargs):
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
        if "[2]" in line:
            break
    time.sleep(1.0)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    said = "".join(seen) + out
    assert proc.returncode == 130, err[-2000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    assert "interrupted. 2 of 6 cells are saved" in said
    assert "Resume with the same command" in said and "countdown sweep --model tiny --methods dense,mono" in said
    rows = read_rows(tmp_path / "out" / "tiny.csv")
    assert {(r["method"], r["task"]) for r in rows} == {("dense", "tiny_mc"), ("mono", "tiny_mc")}
