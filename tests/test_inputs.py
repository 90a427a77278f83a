"""Every input gets a clear answer before the work (issue 44, part B).

* Every numeric option of every command has a range from ``countdown.options.RANGES``: each out-of-range value
  exits 2 with one line naming the option and its range, before any model load (``load_model`` raises if
  called), and the option's ``--help`` states the range. The Python API checks the same ranges, in the same words.
* One rule reads a string as a name or a path, on the command line and in Python.
* An artifact loads on its own model in fp32, bf16 and fp16, or the message names the dtype and the fix.
* Messages name the problem and the fix: a text file as --artifacts, a model folder without a tokenizer,
  non-UTF-8 text, lm-eval's --limit 0, a window longer than the model's positions.
"""

import argparse
import copy
import json
import math

import pytest
import torch

import countdown
import countdown.data.models as data_models
from countdown.cli import commands as cli
from countdown.options import RANGES, Range, check
from conftest import tiny_model
from test_calibrate import TOK, word_texts

KW = dict(texts=word_texts(0), num_tokens=256, window=128, progress=False)
REQUIRED = {"generate": ["--prompt", "hi"], "quality": ["--artifacts", "a.safetensors"], "serve": ["folder"]}


@pytest.fixture
def no_load(monkeypatch):
    """Any model load fails the test: every refusal below must come before it."""
    def load(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(countdown, "load_model", load)
    monkeypatch.setattr(data_models, "load_model", load)


def _subparsers(parser):
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


def ranged_options():
    """(command, flag, range text, bad values) of every option whose type is a countdown.options range."""
    out = []
    for command, parser in _subparsers(cli.build_parser()).items():
        for action in parser._actions:
            text = getattr(action.type, "range_text", None)
            if text is None:
                continue
            name = action.type.__name__
            bad = (["0.7,1.5", "0", "0.7,0.7", "x"] if name == "sparsities" else
                   [*_out_of(RANGES[name]), "x"])
            out += [(command, action.option_strings[0], text, value) for value in bad]
    return out


def _out_of(r: Range) -> list[str]:
    """Values just outside a range (and, for numbers, the non-finite ones; for integers a fraction)."""
    if r.choices:
        return [str(max(r.choices) + 1), str(min(r.choices) - 1)]
    if r.fraction:
        return ["0", "-1", "1.5"]
    step = 1 if r.integer else 0.5
    values = []
    if r.low is not None:
        below = r.low if r.open_low else r.low - step
        values.append(below if below != r.off else below - step)
    if r.high is not None:
        values.append(r.high if r.open_high else r.high + step)
    values = [f"{v:g}" if isinstance(v, float) else str(v) for v in values]
    return values + (["2.5"] if r.integer else ["nan", "inf"])


RANGED = ranged_options()


def test_every_numeric_option_of_every_command_has_a_range():
    missing = []
    for command, parser in _subparsers(cli.build_parser()).items():
        for action in parser._actions:
            if not action.option_strings or isinstance(action, (argparse._HelpAction, argparse._StoreTrueAction)):
                continue
            numeric = action.type in (int, float) or (action.type is None and isinstance(action.default, (int, float))
                                                      and not isinstance(action.default, bool))
            if numeric or action.option_strings[0] in ("--sparsity", "--sparsities", "--prac-sparsities") \
                    and getattr(action.type, "range_text", None) is None:
                missing.append(f"{command} {action.option_strings[0]}")
    assert missing == []
    commands = {c for c, *_ in RANGED}
    assert commands == {"ppl", "calibrate", "train", "quality", "generate", "eval", "agreement", "sweep", "bench",
                        "demo", "cost", "analyze", "serve"}
    assert len({(c, f) for c, f, *_ in RANGED}) >= 55


@pytest.mark.parametrize("command, flag, text, value", RANGED,
                         ids=[f"{c} {f} {v}" for c, f, _, v in RANGED])
def test_an_out_of_range_value_exits_2_with_one_line_before_the_load(command, flag, text, value, no_load, capsys):
    assert cli.main([command, *REQUIRED.get(command, []), flag, value]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert f"countdown {command}: error: argument {flag}" in err[0] and text in err[0], err[0]


@pytest.mark.parametrize("command", sorted({c for c, *_ in RANGED}))
def test_the_help_states_each_range(command):
    parser = _subparsers(cli.build_parser())[command]
    for action in parser._actions:
        text = getattr(action.type, "range_text", None)
        if text is not None:
            assert text in action.help and "default" in action.help.lower(), (action.option_strings, action.help)


def test_in_range_values_parse_as_numbers():
    args = cli.build_parser().parse_args(["train", "--epochs", "1", "--pos-weight", "2.5", "--group", "32",
                                          "--bits", "3", "--seed", "0", "-k", "0.7,0.9", "--refine-on-decode", "0"])
    assert (args.epochs, args.pos_weight, args.group, args.bits, args.seed) == (1, 2.5, 32, 3, 0)
    assert args.sparsity == [0.7, 0.9] and args.refine_on_decode == 0
    args = cli.build_parser().parse_args(["eval", "--limit", "0.25"])
    assert args.limit == 0.25
    assert cli.build_parser().parse_args(["eval", "--limit", "20"]).limit == 20


def test_bench_and_lm_eval_entry_points(no_load, capsys):
    from countdown.bench.cli import main as bench_main
    from countdown.eval.lmeval import main as lmeval_main

    with pytest.raises(SystemExit) as stop:
        bench_main(["--samples", "0"])
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--samples: must be an integer >= 1, got '0'" in err[0]
    for argv in (["--limit", "0"], ["--limit=0"], ["-L", "-3"]):
        with pytest.raises(SystemExit) as stop:
            lmeval_main(["--model", "countdown", "--tasks", "arc_easy", *argv])
        assert stop.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "is not a limit" in err[0] and "leave --limit out" in err[0], err


def test_the_device_entry_point_checks_its_numbers(capsys):
    from countdown.eval.offline.device import _parser

    parser = _parser()
    numeric = [a for a in parser._actions if a.option_strings and hasattr(a.type, "range_text")]
    assert {a.option_strings[0] for a in numeric} == {"--chunk", "--batch-tokens", "--stop-after", "--threads"}
    assert all(getattr(a.type, "range_text", "") in a.help for a in numeric)
    for flag, value in (("--chunk", "0"), ("--batch-tokens", "-1"), ("--stop-after", "nan"), ("--threads", "0")):
        with pytest.raises(SystemExit) as stop:
            parser.parse_args(["--job", "j", "--weights", "w", "--config-dir", "c", "--out", "o", flag, value])
        err = capsys.readouterr().err.strip().splitlines()
        assert stop.value.code == 2 and len(err) == 1 and f"argument {flag}: must be" in err[0], err


def test_bench_ppl_tokens_below_one_window(no_load, capsys):
    from countdown.bench.cli import main as bench_main

    assert bench_main(["--ppl-tokens", "100", "--window", "512"]) == 2
    assert "--ppl-tokens 100 is less than one --window of 512" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------
# The Python API: the same ranges, the same words
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


def _api_cases(model, tmp_path):
    from countdown.bench.operating import BenchSettings
    from countdown.cli.demo import run_demo
    from countdown.cli.headline import run_headline
    from countdown.eval.agreement import agreement
    from countdown.eval.analysis import collect_indicator_stats
    from countdown.eval.cost import cost_table
    from countdown.eval.sweep import run_sweep
    from countdown.spec import parse_spec

    ids = torch.tensor([[1, 5, 9]])
    texts = word_texts(0)
    return {
        "perplexity max_tokens": (lambda: countdown.perplexity(model, TOK, texts, max_tokens=-5), "max_tokens"),
        "perplexity window": (lambda: countdown.perplexity(model, TOK, texts, window=2), "window"),
        "perplexity batch_size": (lambda: countdown.perplexity(model, TOK, texts, batch_size=0), "batch_size"),
        "generate max_new_tokens": (lambda: countdown.generate(model, ids, -5), "max_new_tokens"),
        "generate_fast temperature": (lambda: countdown.generate_fast(model, ids, 4, temperature=-1), "temperature"),
        "generate_fast temperature nan": (lambda: countdown.generate_fast(model, ids, 4, temperature=float("nan")),
                                          "temperature"),
        "generate temperature": (lambda: countdown.generate(model, ids, 4, do_sample=True, temperature=0),
                                 "sample_temperature"),
        "generate_fast top_k": (lambda: countdown.generate_fast(model, ids, 4, temperature=1, top_k=0), "top_k"),
        "generate_fast top_p": (lambda: countdown.generate_fast(model, ids, 4, temperature=1, top_p=0), "top_p"),
        "generate_fast seed": (lambda: countdown.generate_fast(model, ids, 4, seed=-1), "seed"),
        "calibrate num_tokens": (lambda: countdown.calibrate(model, TOK, "mono", 0.8, texts=texts, num_tokens=2),
                                 "num_tokens"),
        "prepare window": (lambda: countdown.prepare(model, TOK, "mono", 0.8, texts=texts, window=1), "calib_window"),
        "train epochs": (lambda: countdown.train_predictors(model, TOK, "dual", 0.8, kind="lowrank", epochs=0,
                                                           **KW), "epochs"),
        "train pos_weight": (lambda: countdown.train_predictors(model, TOK, "dual", 0.8, kind="lowrank",
                                                               pos_weight=-1, **KW), "pos_weight"),
        "train seed": (lambda: countdown.train_predictors(model, TOK, "dual[lowrank]", 0.8, seed=-1, **KW), "seed"),
        "spec d_rank": (lambda: countdown.prepare(model, TOK, parse_spec("dual[lowrank0]"), 0.8, **KW), "d_rank"),
        "shadow group": (lambda: countdown.calibrate(model, TOK, "dual[shadow4]", 0.8, group=0, **KW), "group"),
        "shadow bits": (lambda: countdown.calibrate(model, TOK, "dual", 0.8, kind="shadow", bits=5, **KW), "bits"),
        "evaluate limit": (lambda: countdown.evaluate(model, TOK, "arc_easy", limit=0), "limit"),
        "predictor_quality num_tokens": (lambda: countdown.predictor_quality(model, TOK, None, num_tokens=2),
                                         "num_tokens"),
        "refine_cuts_on_decode rounds": (lambda: countdown.refine_cuts_on_decode(model, None, ids, rounds=0), "rounds"),
        "agreement max_new_tokens": (lambda: agreement(model, TOK, "mono", 0.8, max_new_tokens=0), "max_new_tokens"),
        "analysis max_tokens": (lambda: collect_indicator_stats(model, TOK, texts, [0.7], max_tokens=0),
                                "analysis_tokens"),
        "cost d_model": (lambda: cost_table(0, 4, 1, 0.5), "d_model"),
        "sweep limit": (lambda: run_sweep("tiny", limit=0, out_dir=tmp_path), "limit_docs"),
        "sweep ppl_tokens": (lambda: run_sweep("tiny", ppl_tokens=1, out_dir=tmp_path), "ppl_tokens"),
        "sweep agreement_prompts": (lambda: run_sweep("tiny", agreement_prompts=21, out_dir=tmp_path),
                                    "agreement_prompts"),
        "sweep chunk": (lambda: run_sweep("tiny", chunk=0, out_dir=tmp_path), "chunk"),
        "sweep wait": (lambda: run_sweep("tiny", wait=-1.0, out_dir=tmp_path), "wait"),
        "bench samples": (lambda: BenchSettings(specs=[], samples=0), "samples"),
        "bench ppl_tokens": (lambda: BenchSettings(specs=[], ppl_tokens=1), "max_tokens"),
        "demo max_tokens": (lambda: run_demo("smollm2-135m", max_tokens=-5, out_dir=tmp_path), "max_tokens"),
        "headline max_tokens": (lambda: run_headline("smollm2-135m", max_tokens=1, out_dir=tmp_path), "max_tokens"),
    }


API = list(_api_cases(None, None))


@pytest.mark.parametrize("case", API)
def test_the_api_refuses_the_same_ranges_in_the_same_words(case, model, tmp_path, no_load, monkeypatch):
    import countdown.eval.perplexity as ppl
    import countdown.artifacts.prepare as prepare

    def no_work(*args, **kwargs):
        raise AssertionError("work started before the check")

    monkeypatch.setattr(prepare, "token_windows", no_work)
    monkeypatch.setattr(ppl, "_windows", no_work)
    call, range_name = _api_cases(model, tmp_path)[case]
    with pytest.raises(ValueError, match="must be " + _re(RANGES[range_name].text)):
        call()
    assert not countdown.is_sparsified(model)


def _re(text: str) -> str:
    import re

    return re.escape(text)


def test_check_converts_and_refuses_what_is_no_number():
    assert check("max_tokens", 5) == 5 and isinstance(check("temperature", 1), float)
    assert check("limit", 0.5) == 0.5 and check("limit", 3.0) == 3
    with pytest.raises(TypeError, match="max_tokens must be an integer >= 2.*parse it first"):
        check("max_tokens", "5")
    with pytest.raises(TypeError):
        check("epochs", True)
    with pytest.raises(ValueError, match="got float 2.5"):
        check("epochs", 2.5)


# --------------------------------------------------------------------------------------------
# One rule for names and paths
# --------------------------------------------------------------------------------------------


def test_a_texts_string_is_a_name_or_a_path_everywhere(model, tmp_path, monkeypatch, capsys):
    from countdown.data.texts import as_texts

    path = tmp_path / "held.txt"
    path.write_text("\n\n".join(word_texts(1)))
    listed = countdown.load_texts(str(path))
    assert as_texts(str(path)) == as_texts(path) == listed and as_texts(listed) == listed
    # the API reads the string as the CLI does: a file, not the text "/tmp/.../held.txt"
    api = countdown.perplexity(model, TOK, str(path), max_tokens=256, window=64, progress=False)
    assert api == countdown.perplexity(model, TOK, listed, max_tokens=256, window=64, progress=False)
    monkeypatch.setattr(countdown, "load_model", lambda *a, **k: (model, TOK))
    assert cli.main(["ppl", "--method", "dense", "--texts", str(path), "--max-tokens", "256", "--window", "64",
                     "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["perplexity"] == pytest.approx(api, rel=1e-6)
    countdown.unsparsify(model)  # the command patched it (with dense)
    # calibration reads it the same way, and records where the text came from
    art = countdown.calibrate(model, TOK, "mono", 0.8, texts=str(path), num_tokens=256, window=64, progress=False)
    assert art.meta["data"]["name"].startswith(str(path))
    # a string is never the text itself
    with pytest.raises(ValueError, match="unknown text source 'the sky is blue'.*list of strings is the text"):
        countdown.calibrate(model, TOK, "mono", 0.8, texts="the sky is blue", num_tokens=256, progress=False)
    with pytest.raises(ValueError, match="no such text file"):
        as_texts(str(tmp_path / "missing.txt"))
    with pytest.raises(TypeError, match="list of strings"):
        as_texts([1, 2])


def test_a_model_string_is_read_by_one_rule(model, tmp_path, monkeypatch):
    from countdown.data.models import model_source

    monkeypatch.chdir(tmp_path)
    folder = tmp_path / "smollm2-135m"  # a folder named like a catalogue model, holding a sparsified save
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "countdown.json").write_text(json.dumps({"format": "not-a-save"}))
    assert model_source("smollm2-135m") == ("catalogue", "smollm2-135m")
    assert model_source("./smollm2-135m")[0] == "folder" and model_source(folder)[0] == "folder"
    assert model_source("org/name") == ("hub", "org/name")
    with pytest.raises(FileNotFoundError):
        model_source("./nothing-here")
    # countdown.load_model reads the name as data.models.load_model does: the catalogue model, never the folder
    monkeypatch.setattr(data_models, "load_model", lambda *a, **k: (model, TOK))
    loaded, _ = countdown.load_model("smollm2-135m")
    assert loaded is model and not countdown.is_sparsified(model)
    with pytest.raises(ValueError, match="not a countdown save"):  # the folder, written as a path, is the folder
        countdown.load_model("./smollm2-135m")


# --------------------------------------------------------------------------------------------
# An artifact on its own model in every dtype
# --------------------------------------------------------------------------------------------


DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
IDS = torch.tensor([[1, 5, 17, 42, 7, 9, 3, 11]])


@pytest.mark.parametrize("spec", ["mono", "dual[shadow4]", "dual[lowrank]"])
def test_an_artifact_built_on_fp32_runs_on_bf16_and_fp16(model, spec):
    kw = dict(KW, epochs=1) if "lowrank" in spec else KW
    art = countdown.prepare(model, TOK, spec, 0.7, **kw)
    assert art.meta["model"]["dtype"] == "fp32" and len(art.meta["model"]["probe"]) == 2 * 3 * 3 * 4
    for name, dtype in DTYPES.items():
        other = copy.deepcopy(model).to(dtype)
        countdown.sparsify(other, spec, 0.7, mode="prac", artifacts=art, path="gather")
        with torch.no_grad():
            logits = other(IDS).logits
        assert torch.isfinite(logits).all(), name
        countdown.unsparsify(other)


def test_an_artifact_built_on_fp16_runs_on_fp32(model, tmp_path):
    half = copy.deepcopy(model).to(torch.float16)
    art = countdown.calibrate(half, TOK, "mono", 0.7, **KW)
    path = art.save(tmp_path / "half.safetensors")
    countdown.sparsify(model, "mono", 0.7, mode="prac", artifacts=path)
    countdown.unsparsify(model)


def test_another_checkpoint_is_refused_naming_both_dtypes(model):
    art = countdown.calibrate(model, TOK, "mono", 0.7, **KW)
    tuned = copy.deepcopy(model)
    with torch.no_grad():
        for p in tuned.parameters():
            p.mul_(1.01)  # a fine-tune's worth of change: far beyond fp16 rounding
    tuned = tuned.to(torch.float16)
    with pytest.raises(countdown.ArtifactMismatchError, match="fp32 weights.*fp16.*further apart than fp32 and fp16"):
        countdown.sparsify(tuned, "mono", 0.7, mode="prac", artifacts=art)
    assert not countdown.is_sparsified(tuned)


def test_an_artifact_without_a_probe_names_the_dtype_and_the_fix(model):
    art = countdown.calibrate(model, TOK, "mono", 0.7, **KW)
    meta = json.loads(json.dumps(art.meta))
    del meta["model"]["probe"], meta["model"]["dtype"]  # as countdown wrote them before
    old = countdown.Artifacts(meta, art.tensors)
    countdown.sparsify(copy.deepcopy(model).to(torch.bfloat16), "mono", 0.7, mode="prac", artifacts=old)
    with pytest.raises(countdown.ArtifactMismatchError, match="this model .*fp16.*--dtype bf16"):
        countdown.sparsify(copy.deepcopy(model).to(torch.float16), "mono", 0.7, mode="prac", artifacts=old)


def test_the_artifact_cache_serves_the_same_model_in_another_dtype(model, tmp_path, monkeypatch):
    import countdown.artifacts.prepare as prepare

    built = countdown.ensure_artifacts(model, TOK, "mono", 0.7, tmp_path, **KW)
    monkeypatch.setattr(prepare, "_build", lambda *a, **k: pytest.fail("rebuilt for another dtype"))
    again = countdown.ensure_artifacts(copy.deepcopy(model).to(torch.float16), TOK, "mono", 0.7, tmp_path, **KW)
    assert torch.equal(again.tensors["thresholds"], built.tensors["thresholds"])
    assert len(list(tmp_path.glob("*.safetensors"))) == 1


# --------------------------------------------------------------------------------------------
# Messages in the user's terms
# --------------------------------------------------------------------------------------------


def test_a_text_file_as_artifacts_is_not_an_artifact(tmp_path, no_load, capsys):
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n")
    for argv in (["ppl", "--method", "mono", "--mode", "prac"], ["quality"]):
        assert cli.main([*argv, "--artifacts", str(notes)]) == 2
        err = capsys.readouterr().err
        assert "is not a countdown artifact (a text file" in err and "corrupt" not in err and "delete" not in err


def test_a_model_folder_without_a_tokenizer_says_so(model, tmp_path, no_load, capsys):
    folder = tmp_path / "no-tokenizer"
    model.config.save_pretrained(folder)
    for argv in (["ppl"], ["calibrate", "--out", str(tmp_path / "a.safetensors")], ["generate", "--prompt", "hi"],
                 ["analyze"]):
        assert cli.main([*argv, "--model", str(folder)]) == 2
        err = capsys.readouterr().err
        assert f"model folder {folder} has no tokenizer" in err and "NoneType" not in err, err
    with pytest.raises(ValueError, match="perplexity needs the model's tokenizer, got None"):
        countdown.perplexity(model, None, word_texts(0))
    with pytest.raises(ValueError, match="needs the model's tokenizer"):
        countdown.calibrate(model, None, "mono", 0.8, texts=word_texts(0), progress=False)


def test_non_utf8_text_names_the_file(tmp_path, no_load, capsys):
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("caf\u00e9 au lait\n\nsecond text\n".encode("latin-1"))
    assert cli.main(["ppl", "--texts", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert f"{bad} is not UTF-8 text: byte 0xe9 at offset 3 (line 1)" in err and "iconv" in err
    with pytest.raises(ValueError, match="latin1.txt is not UTF-8"):
        countdown.load_texts(bad)


def test_lm_eval_limit_0_is_not_a_limit(model, no_load, capsys):
    assert cli.main(["eval", "--limit", "0"]) == 2
    assert "--limit: must be an integer >= 1 or a fraction in (0, 1), got '0'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="limit must be an integer >= 1 or a fraction"):
        countdown.evaluate(model, TOK, "arc_easy", limit=0)


def test_a_window_longer_than_the_models_positions(monkeypatch, tmp_path, capsys):
    short = tiny_model("llama", max_position_embeddings=64)
    with pytest.raises(ValueError, match="window=128 is longer than the model's 64 positions"):
        countdown.perplexity(short, TOK, word_texts(0), window=128)
    monkeypatch.setattr(countdown, "load_model", lambda *a, **k: (short, TOK))
    held = tmp_path / "held.txt"
    held.write_text("\n\n".join(word_texts(1)))
    assert cli.main(["ppl", "--method", "dense", "--window", "128", "--texts", str(held)]) == 2
    assert "window=128 is longer than the model's 64 positions" in capsys.readouterr().err  # not a number
    assert math.isfinite(countdown.perplexity(short, TOK, word_texts(0), max_tokens=128, window=64, progress=False))


def test_generate_temperature_is_checked_before_the_load(no_load, capsys):
    for value in ("-1", "nan"):
        assert cli.main(["generate", "--prompt", "hi", "--temperature", value]) == 2
        assert "--temperature: must be a finite number >= 0" in capsys.readouterr().err
