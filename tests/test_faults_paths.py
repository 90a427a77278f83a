"""Fault injection, third round (issue 59): written paths that are no regular file, an empty path, a read-only file
system told from a file's mode, lock files that no longer stay, and bench runs into one folder that keep every
run's rows.

Each test names what c16ac8c did: a FIFO as ``--out`` blocked in ``open()``; a character device with ``--force``
was replaced by a regular file; ``--out ""`` wrote a default-named file into the current folder; a file on a
read-only mount was "read-only (mode 0644); chmod u+w"; every output kept a ``.<name>.lock`` beside it; a second
``countdown bench`` into a folder replaced the first run's table.
"""

import csv
import errno
import os
import re
import socket
import stat
from pathlib import Path

import pytest

import countdown
from countdown.cli import commands as cli
from countdown.io import LockedError, UnwritableError, atomic_write, check_writable, check_writable_dir, file_lock
from conftest import tiny_model
from test_faults import (calib, calibrate_argv, in_child, loads, model, two_k, wait_child)  # noqa: F401
from test_faults_os import one_error_line


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("COUNTDOWN_CACHE", str(tmp_path / "countdown-cache"))


def _fifo(path: Path) -> Path:
    os.mkfifo(path)
    return path


def _char_device(path: Path) -> Path:
    """A character device node like /dev/null (1, 3), made in the test's own folder (the tests run as root)."""
    if os.geteuid() != 0:
        pytest.skip("making a device node needs root")
    os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    return path


def _socket(path: Path) -> Path:
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(path))
    server.close()
    return path


SPECIAL = {"fifo": (_fifo, "a FIFO (named pipe)"), "char device": (_char_device, "a character device"),
           "socket": (_socket, "a socket")}


@pytest.mark.parametrize("force", [False, True], ids=["plain", "--force"])
@pytest.mark.parametrize("kind", list(SPECIAL))
def test_an_out_that_is_no_regular_file_is_refused_before_the_work(kind, force, calib, tmp_path, loads):
    """c16ac8c: a FIFO blocked forever in open() (the run is made in a child, killed if it hangs); a device with
    --force was replaced by a regular file."""
    make, words = SPECIAL[kind]
    out = make(tmp_path / "out.safetensors")
    result = tmp_path / "child.json"
    argv = calibrate_argv(calib, out, *(["--force"] if force else []))
    done = wait_child(in_child(lambda: cli.main(argv), result), result, timeout=30)
    assert done["rc"] == 2, done
    one_error_line(done["err"], str(out), f"it is {words}, not a regular file", "(--out)")
    mode = os.lstat(out).st_mode
    assert not stat.S_ISREG(mode) and stat.S_IFMT(mode) == {"fifo": stat.S_IFIFO, "char device": stat.S_IFCHR,
                                                             "socket": stat.S_IFSOCK}[kind]
    assert loads == []  # refused before the model load (in this process: the child's calls are its own)


@pytest.mark.parametrize("kind", list(SPECIAL))
def test_the_api_refuses_them_too_whatever_force_says(kind, two_k, tmp_path):
    """In a child process, killed if it hangs: c16ac8c's Artifacts.save blocked on a FIFO (its check for a foreign
    file opened it)."""
    make, words = SPECIAL[kind]
    out = make(tmp_path / "out.safetensors")
    link = tmp_path / "link.safetensors"
    link.symlink_to(out)

    def calls():
        for target in (out, link):
            for force in (False, True):
                with pytest.raises(UnwritableError, match=re.escape(f"it is {words}, not a regular file")):
                    two_k.save(target, force=force)
            with pytest.raises(UnwritableError, match=re.escape(words)):
                check_writable(target)
            with pytest.raises(UnwritableError, match=re.escape(words)):
                atomic_write(target, "text")
        with pytest.raises(UnwritableError, match=re.escape(f"it is {words}, not a folder")):
            check_writable_dir(out)
        with pytest.raises(countdown.ArtifactError, match=re.escape(f"is {words}, not an artifact file")):
            countdown.load_artifacts(out)
        return 0

    result = tmp_path / "child.json"
    assert wait_child(in_child(calls, result), result, timeout=30)["rc"] == 0
    assert not stat.S_ISREG(os.lstat(out).st_mode)


def test_a_model_saved_over_a_fifo_is_refused_before_the_serialization(tmp_path):
    target = _fifo(tmp_path / "saved")
    with pytest.raises(UnwritableError, match="is a FIFO"):
        countdown.save(tiny_model("llama"), target, overwrite=True)
    assert stat.S_ISFIFO(os.lstat(target).st_mode)


@pytest.mark.parametrize("option", ["--out", "--checkpoint"])
def test_an_empty_path_is_refused_at_the_parse(option, calib, tmp_path, loads, capsys, monkeypatch):
    """c16ac8c: ``--out ""`` wrote mono-<model>-k0.7_0.8.safetensors into the current folder."""
    monkeypatch.chdir(tmp_path)
    argv = ["train", "--method", "dual", "-k", "0.7", "--kind", "lowrank", "--texts", calib, "--num-tokens", "256",
            "--out", str(tmp_path / "a.safetensors"), option, ""]
    assert cli.main(argv) == 2
    assert f"argument {option}: must be a path, got ''" in capsys.readouterr().err
    assert loads == [] and list(tmp_path.iterdir()) == [Path(calib)] * (Path(calib).parent == tmp_path)


def test_an_empty_path_is_refused_by_the_api(two_k):
    for call in (lambda: two_k.save(""), lambda: check_writable(""), lambda: check_writable_dir(""),
                 lambda: atomic_write("", "x")):
        with pytest.raises(UnwritableError, match="the path is empty"):
            call()


def test_a_read_only_mount_is_named_not_the_files_mode(two_k, tmp_path, monkeypatch, capsys, calib, loads):
    """c16ac8c: "it is read-only (mode 0644); make it writable (chmod u+w ...)", which cannot help on a read-only
    file system. The mount is simulated: access(W_OK) fails and statvfs says ST_RDONLY, as on such a mount."""
    out = two_k.save(tmp_path / "mono.safetensors")
    out.chmod(0o644)
    real_access, real_statvfs = os.access, os.statvfs

    class ReadOnly:
        def __init__(self, real):
            self._real = real

        def __getattr__(self, name):
            return getattr(self._real, name)

        @property
        def f_flag(self):
            return self._real.f_flag | os.ST_RDONLY

    monkeypatch.setattr(os, "access", lambda p, mode, **kw: False if Path(p) == out and mode & os.W_OK
                        else real_access(p, mode, **kw))
    monkeypatch.setattr(os, "statvfs", lambda p: ReadOnly(real_statvfs(p)) if str(p).startswith(str(tmp_path))
                        else real_statvfs(p))
    with pytest.raises(UnwritableError) as caught:
        two_k.save(out)
    assert "mounted read-only" in str(caught.value) and "chmod" not in str(caught.value)
    assert caught.value.errno == errno.EROFS
    assert cli.main(calibrate_argv(calib, out)) == 2
    line = one_error_line(capsys.readouterr().err, str(out), "mounted read-only", "writable disk", "(--out)")
    assert "chmod" not in line and "mode 0644" not in line and loads == []


def test_a_file_of_another_user_is_not_said_to_be_read_only(two_k, tmp_path, monkeypatch):
    out = two_k.save(tmp_path / "mono.safetensors")
    out.chmod(0o644)
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: False if Path(p) == out and mode & os.W_OK
                        else real_access(p, mode, **kw))
    with pytest.raises(UnwritableError, match=r"you may not write it \(mode 0644, owner uid \d+\)"):
        two_k.save(out)


# --------------------------------------------------------------------------------------------
# Lock files
# --------------------------------------------------------------------------------------------


def test_no_lock_file_stays_after_a_run(two_k, calib, tmp_path, loads, capsys):
    """c16ac8c: ``.mono.safetensors.lock`` stayed beside every artifact, sweep table, checkpoint and saved model."""
    out = tmp_path / "mono.safetensors"
    with file_lock(out) as lock:
        assert lock.exists() and lock.name == ".mono.safetensors.lock"
        with file_lock(out):  # re-entrant: the inner block leaves the file to the outer one
            pass
        assert lock.exists()
    assert not lock.exists()
    assert cli.main(calibrate_argv(calib, out)) == 0
    countdown.save(tiny_model("llama"), tmp_path / "saved")
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.endswith(".lock")) == []


def test_a_lock_taken_on_a_file_its_holder_removed_is_taken_again(tmp_path, monkeypatch):
    """The race the removal opens: a waiter opened the lock file, the holder let go and removed it, and a third run
    created a new one and locked it. The waiter's flock succeeds on the removed file; it must see that this is no
    longer the path's file and lock the path's file instead, which the third run holds."""
    import countdown.io.locks as locks

    out = tmp_path / "table.csv"
    lock_path = tmp_path / ".table.csv.lock"
    real_flock, third = locks.fcntl.flock, []

    class Fcntl:
        LOCK_EX, LOCK_NB = locks.fcntl.LOCK_EX, locks.fcntl.LOCK_NB

        @staticmethod
        def flock(fd, how):
            if not third:  # between this run's open and its flock: the holder removes the file, a third run locks anew
                os.unlink(lock_path)
                third.append(os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644))
                real_flock(third[0], locks.fcntl.LOCK_EX)
            return real_flock(fd, how)

    lock_path.write_text("{}")
    monkeypatch.setattr(locks, "fcntl", Fcntl)
    try:
        with pytest.raises(LockedError, match="is being written by"):
            with file_lock(out):
                pytest.fail("two holders of one lock")
        assert lock_path.exists()  # the third run's file: not removed by the run that did not hold it
    finally:
        os.close(third[0])


def test_runs_in_turn_keep_their_exclusion_while_lock_files_come_and_go(tmp_path):
    """Four processes add 1 to a counter 25 times each, each read-modify-write under file_lock (waiting): with the
    lock file removed after every hold, no update may be lost."""
    counter = tmp_path / "counter"
    counter.write_text("0")

    def work():
        for _ in range(25):
            with file_lock(counter, wait=60):
                value = int(counter.read_text())
                os.sched_yield()
                counter.write_text(str(value + 1))
        return 0

    children = [(in_child(work, tmp_path / f"r{i}.json"), tmp_path / f"r{i}.json") for i in range(4)]
    for pid, result in children:
        assert wait_child(pid, result, timeout=120)["rc"] == 0
    assert counter.read_text() == "100"
    assert not (tmp_path / ".counter.lock").exists()


# --------------------------------------------------------------------------------------------
# countdown bench: runs into one folder keep every run's rows
# --------------------------------------------------------------------------------------------


def _bench(out, *extra):
    return ["bench", "--model", "tiny", "--methods", "mono", "-k", "0.7", "--new-tokens", "2", "--prompt", "4",
            "--samples", "1", "--no-progress", "--speed-only", "--out", str(out), *extra]


def _rows(out):
    with open(out / "tiny.csv", newline="") as fh:
        return list(csv.DictReader(fh))


def test_a_bench_run_made_while_another_runs_keeps_both_runs_rows(tmp_path, loads, monkeypatch):
    """c16ac8c: a run replaced the table an earlier run had written (here the earlier run is made inside the later
    one, in the same process, where c16ac8c's whole-run lock let it through; between two processes that lock made
    the second stop at once). Now the rows are added, each row saying its run."""
    import countdown.bench.operating as operating

    out, real = tmp_path / "bench", operating.operating_points
    inner = []

    def measure_while_another_run_writes(*args, **kwargs):
        if not inner:
            inner.append("running")
            inner[0] = cli.main(_bench(out, "-k", "0.8"))
        return real(*args, **kwargs)

    monkeypatch.setattr(operating, "operating_points", measure_while_another_run_writes)
    assert cli.main(_bench(out, "-k", "0.7")) == 0 and inner == [0]
    rows = _rows(out)
    assert [(r["method"], r["sparsity"]) for r in rows if r["method"].startswith("mono")] == [("mono[threshold]", "0.8"), ("mono[threshold]", "0.7")]
    assert len({r["run"] for r in rows}) == 2 and len(rows) == 4 and all(r["run"] for r in rows)
    assert sorted(p.name for p in out.iterdir()) == ["tiny.csv", "tiny.md", "tiny.png"]  # no temporaries, no lock


def test_processes_adding_rows_at_once_keep_every_row(tmp_path):
    """The merge itself, in four processes at once (no model: a forked torch thread pool can hang): each adds
    five rows, one merge at a time; no row is lost and every row says its run."""
    from countdown.io import adding_rows

    table = tmp_path / "t.csv"

    def work(i):
        for j in range(5):
            with adding_rows(table, ["who", "n"], "table") as (work_dir, added):
                (work_dir / "report.md").write_text(f"{i} {j}\n")
                added.append({"who": str(i), "n": str(j)})
        return 0

    children = [(in_child(lambda i=i: work(i), tmp_path / f"r{i}.json"), tmp_path / f"r{i}.json") for i in range(4)]
    for pid, result in children:
        assert wait_child(pid, result, timeout=120)["rc"] == 0
    with open(table, newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert sorted((r["who"], r["n"]) for r in rows) == [(str(i), str(j)) for i in range(4) for j in range(5)]
    assert len({r["run"] for r in rows}) == 20
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(("t.", ".t.", "report"))) == \
        ["report.md", "t.csv"]


def test_a_file_that_is_no_bench_table_is_refused_before_the_work(tmp_path, loads, capsys):
    out = tmp_path / "bench"
    out.mkdir()
    (out / "tiny.csv").write_text("my,own\nnotes,here\n")
    assert cli.main(_bench(out)) == 2
    one_error_line(capsys.readouterr().err, str(out / "tiny.csv"), "is not a bench table")
    assert loads == [] and (out / "tiny.csv").read_text() == "my,own\nnotes,here\n"
