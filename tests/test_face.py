"""The package's face: one version, the LICENSE and py.typed shipped, `countdown --version`, one --device rule for
every command, and ppl's default the configuration the operating-point tables recommend."""

import argparse
import json
import re
import tomllib
from pathlib import Path

import pytest
import torch

import countdown
import countdown.data.texts as texts_module
from countdown.cli import commands as cli
from countdown.options import device_arg
from conftest import tiny_model
from test_calibrate import TOK, word_texts

ROOT = Path(__file__).resolve().parents[1]


def _subparsers(parser):
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


def test_the_version_has_one_source_and_the_cli_prints_it(capsys):
    from setuptools.config.expand import read_attr

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
    attr = project["tool"]["setuptools"]["dynamic"]["version"]["attr"]
    # what setuptools writes into the wheel's metadata, read as setuptools reads it (without importing countdown)
    assert read_attr(attr, {"": "src"}, str(ROOT)) == countdown.__version__
    assert re.fullmatch(r"\d+\.\d+\.\d+", countdown.__version__)
    with pytest.raises(SystemExit) as stop:
        cli.build_parser().parse_args(["--version"])
    assert stop.value.code == 0 and capsys.readouterr().out == f"countdown {countdown.__version__}\n"


def test_license_and_py_typed_ship_with_the_package():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["project"]["license"] == "Apache-2.0" and project["project"]["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert text.split()[:4] == ["Apache", "License", "Version", "2.0,"]
    assert "TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION" in text and "END OF TERMS AND CONDITIONS" in text
    assert (ROOT / "src" / "countdown" / "py.typed").is_file()
    assert "py.typed" in project["tool"]["setuptools"]["package-data"]["countdown"]


def test_the_serving_extra_is_in_serve_and_dev():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    serving = [r for r in extras["serve"] if r.startswith("transformers[serving]")]
    assert serving and serving[0] in extras["dev"]


@pytest.mark.parametrize("cuda", [False, True])
def test_every_command_that_takes_a_device_has_the_one_rule(monkeypatch, cuda):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    parser = cli.build_parser()
    assert "--device (auto: cuda when PyTorch sees a GPU, else cpu; the default)" in parser.format_help().replace("\n", " ")
    with_device = []
    for command, sub in _subparsers(parser).items():
        for action in sub._actions:
            if "--device" in action.option_strings:
                assert (action.default, action.type) == ("auto", device_arg), command
                assert "cuda when PyTorch sees a GPU, else cpu" in action.help
                with_device.append(command)
    # every command that loads a model (cost reads shapes only; methods / models load nothing)
    assert set(with_device) == {"ppl", "calibrate", "train", "quality", "generate", "eval", "agreement", "sweep",
                                "bench", "demo", "analyze", "serve"}
    required = {"generate": ["--prompt", "hi"], "quality": ["--artifacts", "a.safetensors"], "serve": ["folder"]}
    for command in with_device:
        args = parser.parse_args([command, *required.get(command, [])])
        assert args.device == ("cuda" if cuda else "cpu"), command
        assert parser.parse_args([command, *required.get(command, []), "--device", "cpu"]).device == "cpu"


def test_ppl_defaults_to_the_configuration_the_tables_recommend():
    """The operating-point table of the default model names its recommendation; ppl's defaults are that spec and k
    (not mono at 0.8, +662 % perplexity in the same table)."""
    line = (ROOT / "results" / "operating_points" / "smollm2-135m.md").read_text().splitlines()[2]
    spec, k = re.search(r"use (\S+) at k=([\d.]+)", line).groups()
    from countdown.cli.common import fill_sparse_args

    args = cli.build_parser().parse_args(["ppl"])
    fill_sparse_args(args)  # the defaults of a --model that is not a folder saved sparsified
    assert (args.method, args.sparsity) == (spec, float(k)) == ("dual[shadow4]", 0.5)


def test_ppl_builds_the_recommended_artifact_once_and_caches_it(monkeypatch, tmp_path, capsys):
    model = tiny_model("llama")
    monkeypatch.setattr(countdown, "load_model", lambda *a, **k: (model, TOK))
    monkeypatch.setattr(texts_module, "calibration_texts", lambda *a, **k: word_texts(0))
    monkeypatch.setattr(texts_module, "cache_root", lambda: tmp_path / "cache")
    held = tmp_path / "held.txt"
    held.write_text("\n".join(word_texts(1)))
    argv = ["ppl", "--texts", str(held), "--max-tokens", "256", "--window", "64", "--json"]
    assert cli.main(argv) == 0
    out = capsys.readouterr()
    result = json.loads(out.out)
    assert (result["method"], result["mode"], result["sparsity"]) == ("dual[shadow4]", "prac", 0.5)
    assert "built on first use" in out.err
    countdown.unsparsify(model)  # the command leaves the model it loaded sparsified (its process ends there)
    cached = list((tmp_path / "cache" / "artifacts").glob("*.safetensors"))
    assert len(cached) == 1
    # the same figure as the API with that artifact (independently loaded from the cache)
    art = countdown.load_artifacts(cached[0])
    assert art.kind == "shadow" and art.sparsities == [0.5]
    countdown.sparsify(model, "dual[shadow4]", 0.5, artifacts=art)
    try:
        want = countdown.perplexity(model, TOK, texts=word_texts(1), max_tokens=256, window=64, progress=False)
    finally:
        countdown.unsparsify(model)
    assert result["perplexity"] == pytest.approx(want, rel=1e-6)
    # a second run reuses the cached file (its modification time is unchanged)
    stamp = cached[0].stat().st_mtime_ns
    assert cli.main(argv) == 0
    countdown.unsparsify(model)
    assert json.loads(capsys.readouterr().out)["perplexity"] == result["perplexity"]
    assert list((tmp_path / "cache" / "artifacts").glob("*.safetensors")) == cached
    assert cached[0].stat().st_mtime_ns == stamp


def test_an_explicit_prac_spec_without_its_kind_still_needs_artifacts(monkeypatch, capsys):
    def load(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(countdown, "load_model", load)
    assert cli.main(["ppl", "--method", "mono", "--mode", "prac"]) == 2
    assert "needs artifacts" in capsys.readouterr().err


DEMO_ON_THE_BASE_INSTALL = r"""
import sys
for name in ("triton", "lm_eval", "datasets", "fastapi", "uvicorn", "openai"):
    sys.modules[name] = None  # not installed: `make demo` installs the base package only
from pathlib import Path
import countdown, countdown.data.texts as texts_module
from countdown.cli import commands, headline
from conftest import tiny_model
from test_calibrate import word_texts
from test_readme import ReadmeTokenizer
out = Path(sys.argv[1])
model = tiny_model("llama")
countdown.load_model = lambda *a, **k: (model, ReadmeTokenizer())
texts_module.eval_texts = lambda *a, **k: word_texts(1)
texts_module.calibration_texts = lambda *a, **k: word_texts(0)
texts_module.cache_root = lambda: out / "cache"
commands.build_parser()  # every command registers without the extras
headline.run_headline("tiny", out_dir=out / "demo", max_tokens=512, new_tokens=6, speed_tokens=4, repeats=1)
"""


def test_the_demo_runs_on_the_base_install_and_shows_its_stages(tmp_path):
    """`make demo` installs no extra: the demo (on a tiny model) runs with triton, lm-eval, datasets and the serving
    packages absent, and its progress bar names each stage and the time left."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT / "tests")]),
           "TRITON_INTERPRET": ""}
    done = subprocess.run([sys.executable, "-c", DEMO_ON_THE_BASE_INSTALL, str(tmp_path)], capture_output=True,
                          text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "demo" / "demo.md").is_file() and "| dual[shadow4] k=0.5 |" in done.stdout
    bar = done.stderr.replace("\r", "\n")
    for stage in ("download + de-quantize the model", "calibrate", "score dense and sparse", "decode"):
        assert f"countdown demo, {stage}" in bar, stage
    assert "<" in bar and "100%" in bar  # tqdm's elapsed<remaining, and the bar completes
