"""Fault injection, third round (issue 59): less input than asked for, arguments the API took that the command line
refuses, states a model can be in (meta tensors, a folder replaced while it is read), shell advice on the shell,
and a base install without Triton.

What c16ac8c did, each named in its test: ``countdown ppl --texts <3-token file> --max-tokens 64 --json`` reported
``"tokens": 64``; calibration on a text shorter than ``--num-tokens`` said nothing; whitespace-only texts passed the
API; ``sparsify(model, "mono", 10**400)`` raised OverflowError, a token id beyond the vocabulary an IndexError;
``generate(top_p=1.5)`` ran in greedy mode; ``countdown cost --d-rank 1024 --d-model 64`` printed a table; a meta
model had "no Gated-MLP block" and ``quantize`` raised a raw RuntimeError; ``load_model(folder)`` during a save said
"made for a model with other weights"; the CLI printed "call countdown.unsparsify(model)"; ``quantize`` and a CPU
forward imported Triton.
"""

import json
import os
import subprocess
import sys
import warnings

import pytest
import torch

import countdown
from countdown.cli import commands as cli
from countdown.options import ShortInputWarning
from conftest import TINY_CONFIGS, tiny_model
from test_calibrate import TOK, word_texts
from test_faults import calib, calibrate_argv  # noqa: F401
from test_faults_os import one_error_line


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("COUNTDOWN_CACHE", str(tmp_path / "countdown-cache"))


@pytest.fixture
def model():
    return tiny_model("llama")


@pytest.fixture
def loads(monkeypatch):
    """``load_model`` answers with a fresh tiny model (a command patches the model it loads and leaves it so)."""
    import countdown.data.models as models

    calls = []

    def fake_load(*args, **kwargs):
        calls.append(args)
        return tiny_model("llama"), TOK

    monkeypatch.setattr(countdown, "load_model", fake_load)
    monkeypatch.setattr(models, "load_model", fake_load)
    return calls


def _text_file(tmp_path, text: str):
    path = tmp_path / "short.txt"
    path.write_text(text)
    return path


# --------------------------------------------------------------------------------------------
# Less input than asked for: the count used is the count reported; one rule for the API and the CLI
# --------------------------------------------------------------------------------------------


class OneToken:
    """A tokenizer that makes one token of any text (no BOS): too little to predict a next token from."""

    bos_token_id = None

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [5]}


def test_ppl_reports_the_tokens_it_scored_and_warns_once(tmp_path, loads, capsys):
    """c16ac8c: ``"tokens": 64`` for a text of 3 tokens (CharTokenizer: a token per character), exit 0, no word."""
    texts = _text_file(tmp_path, "abc")
    assert cli.main(["ppl", "--method", "dense", "--texts", str(texts), "--max-tokens", "64", "--window", "32",
                     "--json"]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out)["tokens"] == 5  # "abc" and the blank line that ends a text: 5 characters
    warned = [line for line in out.err.splitlines() if "warning" in line]
    assert warned == ["countdown ppl: warning: the texts hold 5 tokens, fewer than max_tokens=64: using those 5"]


def test_the_api_applies_the_same_rule(model):
    with pytest.warns(ShortInputWarning, match="hold 5 tokens, fewer than max_tokens=64") as seen:
        ppl, tokens = countdown.perplexity(model, TOK, texts=["abc"], max_tokens=64, window=32, progress=False,
                                           return_tokens=True)
    assert tokens == 5 and len(seen) == 1 and ppl > 1
    with warnings.catch_warnings():  # enough text: no warning, and the count is the tokens of the whole windows
        warnings.simplefilter("error")
        _, tokens = countdown.perplexity(model, TOK, texts=word_texts(0), max_tokens=100, window=32, progress=False,
                                         return_tokens=True)
    assert tokens == 93  # 3 whole windows of 31 tokens (a BOS each): the 7 tokens after them are not scored
    with pytest.raises(ValueError, match="hold 1 tokens, fewer than the 2 that max_tokens needs at least"):
        countdown.perplexity(model, OneToken(), texts=["a"], max_tokens=64, window=32, progress=False)



@pytest.mark.parametrize("face", ["api", "cli"])
def test_calibration_on_less_text_than_asked_is_refused_below_64_tokens_and_warned_above(face, model, tmp_path,
                                                                                        loads, capsys):
    """c16ac8c: 41 tokens (38 characters, the blank line, BOS) were calibrated on with nothing but their count in the
    artifact; about 500 of 4096 without a word."""
    short, medium = "x" * 38, "\n\n".join(word_texts(0))[:498]
    for text, ok in ((short, False), (medium, True)):
        if face == "api":
            if not ok:
                with pytest.raises(ValueError, match="hold 41 tokens, fewer than the 64 that num_tokens needs"):
                    countdown.calibrate(model, TOK, "mono", 0.8, texts=[text], num_tokens=4096, progress=False)
                continue
            with pytest.warns(ShortInputWarning, match=r"fewer than num_tokens=4096: using those \d+"):
                art = countdown.calibrate(model, TOK, "mono", 0.8, texts=[text], num_tokens=4096, progress=False)
            assert art.meta["data"]["num_tokens"] < 4096
            continue
        path = _text_file(tmp_path, text)
        argv = calibrate_argv(str(path), tmp_path / f"{ok}.safetensors")
        argv[argv.index("--num-tokens") + 1] = "4096"
        assert cli.main(argv) == (0 if ok else 2)
        err = capsys.readouterr().err
        if ok:
            assert "countdown calibrate: warning: the texts hold" in err and "fewer than num_tokens=4096" in err
        else:
            one_error_line(err, "hold 41 tokens, fewer than the 64 that num_tokens needs at least")


@pytest.mark.parametrize("texts", [["   ", "\n\t"], [""], []])
def test_whitespace_only_texts_are_refused_by_the_api_as_on_the_cli(texts, model):
    """c16ac8c: perplexity and calibrate took ["   "]; the CLI refused such a file with "holds no text"."""
    for call in (lambda: countdown.perplexity(model, TOK, texts=texts, max_tokens=64, window=32, progress=False),
                 lambda: countdown.calibrate(model, TOK, "mono", 0.8, texts=texts, progress=False)):
        with pytest.raises(ValueError, match="texts holds no text"):
            call()


# --------------------------------------------------------------------------------------------
# Every public argument through countdown.options, named
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("call,words", [
    (lambda m: countdown.sparsify(m, "mono", 10**400), "sparsity must be a number in (0, 1)"),
    (lambda m: countdown.sparsify(m, "mono", -10**400), "sparsity must be a number in (0, 1)"),
    (lambda m: countdown.perplexity(m, TOK, texts=["abc"], max_tokens=2**64), "max_tokens must be an integer >= 2"),
    (lambda m: countdown.generate(m, torch.tensor([[1, 2]]), 10**400), "max_new_tokens must be an integer >= 1"),
    (lambda m: countdown.evaluate(m, TOK, "arc_easy", limit=10**400), "limit must be"),
    (lambda m: countdown.generate(m, torch.tensor([[1, 2, 300]]), 2),
     "input_ids holds token id 300, outside the model's vocabulary of 128"),
    (lambda m: countdown.generate(m, torch.tensor([[1, -1]]), 2), "input_ids holds token id -1"),
    (lambda m: countdown.generate_fast(m, torch.tensor([[1, 128]]), 2), "input_ids holds token id 128"),
    (lambda m: countdown.generate(m, torch.tensor([[1, 2]]), 2, top_p=1.5), "top_p must be a number in (0, 1]"),
    (lambda m: countdown.generate(m, torch.tensor([[1, 2]]), 2, top_k=0), "top_k must be an integer >= 1"),
    (lambda m: countdown.generate(m, torch.tensor([[1, 2]]), 2, top_k=129), "at most the vocabulary"),
    (lambda m: countdown.generate(m, torch.tensor([[1, 2]]), 2, seed=2**40), "seed must be an integer from 0"),
    (lambda m: countdown.generate(m, torch.tensor([[1, 2]]), 2, do_sample=True, top_p=1.5), "top_p must be"),
])
def test_the_api_names_the_argument_and_its_range(call, words, model):
    """c16ac8c: OverflowError, IndexError, or (greedy generate with top_p=1.5) a result."""
    with pytest.raises(ValueError) as caught:
        call(model)
    assert words in str(caught.value)
    assert not countdown.is_sparsified(model)


def test_cost_refuses_a_rank_above_d_model_on_both_faces(capsys):
    """c16ac8c: ``countdown cost --d-rank 1024 --d-model 64`` printed a table."""
    from countdown.eval.cost import cost_table

    assert cli.main(["cost", "--d-model", "64", "--d-inter", "256", "--d-rank", "1024"]) == 2
    one_error_line(capsys.readouterr().err, "--d-rank must be at most --d-model (64), got 1024")
    with pytest.raises(ValueError, match=r"d_rank must be at most d_model \(64\), got 1024"):
        cost_table(64, 256, 1024, 0.8)
    assert cli.main(["cost", "--d-model", "64", "--d-inter", "256", "--json"]) == 0  # the default rank fits
    assert json.loads(capsys.readouterr().out)["0.7"]["dual"]["kept_rows"] == 76


# --------------------------------------------------------------------------------------------
# States: meta tensors, a folder replaced while it is read
# --------------------------------------------------------------------------------------------


def _meta_model():
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(TINY_CONFIGS["llama"]()).eval()


@pytest.mark.parametrize("what,call", [
    ("countdown", lambda m, out: countdown.sparsify(m, "mono", 0.8)),
    ("countdown", lambda m, out: countdown.prepare(m, TOK, "mono", 0.8, texts=word_texts(0))),
    ("quantize", lambda m, out: countdown.quantize(m, group=32)),
    ("generate", lambda m, out: countdown.generate(m, torch.tensor([[1, 2]]), 2)),
    ("perplexity", lambda m, out: countdown.perplexity(m, TOK, texts=word_texts(0), max_tokens=64, window=32)),
    ("save", lambda m, out: countdown.save(m, out)),
])
def test_a_model_on_the_meta_device_is_named_as_such(what, call, tmp_path):
    """c16ac8c: "has no Gated-MLP block"; quantize and perplexity: RuntimeError "Tensor.item() cannot be called on
    meta tensors"; generate: "META device type not an accelerator"; save: NotImplementedError."""
    with pytest.raises(Exception, match=f"^{what}: the model's weights are meta tensors .*load the weights first") \
            as caught:
        call(_meta_model(), tmp_path / "saved")
    assert type(caught.value).__name__ == "MetaTensorError" and isinstance(caught.value, ValueError)
    assert list(tmp_path.iterdir()) == []


def test_a_folder_saved_over_while_it_loads_is_read_again_as_one_save(tmp_path, monkeypatch, capsys):
    """c16ac8c: the weights of one save with the artifact of the next: "made for a model with other weights ...
    another checkpoint or a fine-tune". Now the load sees the folder change, reads it again and says so; a folder
    that changes under both reads is named."""
    import countdown.data.models as models

    kw = dict(texts=word_texts(0), num_tokens=256, window=128, progress=False)
    saved = []
    for seed in (0, 1):
        m = tiny_model("llama", seed=seed)
        countdown.sparsify(m, "mono", 0.8, mode="prac", artifacts=countdown.calibrate(m, TOK, "mono", 0.8, **kw))
        saved.append(m)
    folder = tmp_path / "saved"
    countdown.save(saved[0], folder)
    real, saves = models._load_folder, []

    def load_during_a_save(*args, **kwargs):
        out = real(*args, **kwargs)
        if saves:
            countdown.save(saved[saves.pop()], folder, overwrite=True)  # another process's save lands now
        return out

    monkeypatch.setattr(models, "_load_folder", load_during_a_save)
    saves.append(1)
    loaded, _ = countdown.load_model(folder)
    ids = torch.tensor([[1, 5, 9, 3, 7]])
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, saved[1](ids).logits)
    assert f"{folder} changed while load_model read it (another process saved into it): reading it again" in \
        capsys.readouterr().err
    saves.extend([1, 0])
    from countdown.data.snapshot import FolderReplacedError

    with pytest.raises(FolderReplacedError, match="changed twice while load_model read it: another process is saving"):
        countdown.load_model(folder)


# --------------------------------------------------------------------------------------------
# Shell advice on the shell
# --------------------------------------------------------------------------------------------


def test_the_cli_gives_shell_advice_not_python_calls(calib, tmp_path, monkeypatch, capsys):
    """c16ac8c: "calibrate/train on the dense model: call countdown.unsparsify(model) first" from `countdown
    calibrate` on a model given sparsified (a folder countdown.save wrote)."""
    import countdown.data.models as models

    sparse = tiny_model("llama")
    countdown.sparsify(sparse, "mono", 0.8)
    monkeypatch.setattr(countdown, "load_model", lambda *a, **k: (sparse, TOK))
    monkeypatch.setattr(models, "load_model", lambda *a, **k: (sparse, TOK))
    assert cli.main(calibrate_argv(calib, tmp_path / "out.safetensors")) == 2
    line = one_error_line(capsys.readouterr().err, "--model names a model saved sparsified", "give the dense model")
    assert "countdown.unsparsify" not in line and "(model)" not in line
    with pytest.raises(countdown.AlreadySparsifiedError, match=r"call countdown\.unsparsify\(model\)"):
        countdown.calibrate(sparse, TOK, "mono", 0.8, texts=word_texts(0))  # Python advice in Python
    foreign = tmp_path / "notes.safetensors"
    foreign.write_text("my notes")
    assert cli.main(calibrate_argv(calib, foreign)) == 2
    line = one_error_line(capsys.readouterr().err, "pass --force to overwrite it")
    assert "force=True" not in line
    from countdown.cli.common import shell_advice

    for message in ("this model is already sparsified; call countdown.unsparsify(model) before patching it again",
                    "quantize the model before sparsifying it (countdown.unsparsify first): the selectors were built",
                    "model folder f has no tokenizer (none of x): copy the tokenizer files of this model into it "
                    "(tokenizer.save_pretrained(folder)), or pass the tokenizer",
                    "3 of 4 layers are lost (no checkpoint folder): pass --checkpoint DIR (checkpoint=...) to resume"):
        shell = shell_advice(message)
        assert "countdown." not in shell.replace("countdown.save", "") and "(folder)" not in shell, shell
        assert "pass the tokenizer" not in shell and "=..." not in shell, shell


# --------------------------------------------------------------------------------------------
# A base install: 4-bit on the CPU without Triton
# --------------------------------------------------------------------------------------------


NO_TRITON = """
import sys
for name in ("triton", "triton.language"):
    sys.modules[name] = None  # as on an install without it: import raises, importlib.util.find_spec says None
sys.path.insert(0, "tests")
import torch, countdown
from conftest import tiny_model
model = tiny_model("llama")
want = model(torch.tensor([[1, 5, 9]])).logits
countdown.quantize(model, group=32)
with torch.no_grad():
    many, one = model(torch.tensor([[1, 5, 9]])).logits, model(torch.tensor([[1]])).logits
print(many.shape[1], one.shape[1], float((many - want).abs().max()) < 0.5, countdown.generate(model, torch.tensor([[1, 5, 9]]), 3).shape[1])
print([name for name, module in sys.modules.items() if name.startswith("triton") and module is not None])
"""


def test_quantize_and_a_cpu_forward_need_no_triton():
    """c16ac8c: ModuleNotFoundError: No module named 'triton' (the 4-bit Linear imported its CUDA de-quantization
    kernel to decide whether it applies)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    here = os.path.dirname(os.path.dirname(countdown.__file__))  # the countdown this test imported
    env["PYTHONPATH"] = os.pathsep.join(p for p in (here, env.get("PYTHONPATH", "")) if p)
    done = subprocess.run([sys.executable, "-c", NO_TRITON], capture_output=True, text=True, env=env, timeout=300,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split("\n")[:2] == ["3 1 True 6", "[]"], done.stdout
    from countdown.int4.backends import DEQUANT_DTYPES
    from countdown.kernels.int4.dequant import DTYPES

    assert DEQUANT_DTYPES == DTYPES  # the decision's copy of what the kernel writes
