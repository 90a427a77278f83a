"""The command line opens every folder the API writes: ``countdown ppl`` and ``countdown generate`` on a folder
``countdown.save`` wrote (sparsified SP-Prac, 4-bit, 4-bit sparsified, dual[mixed]) run the model as saved when no --method is
given (the same perplexity and text as the saved model's in Python), and with --method sparsify its saved weights as
the options say (saying so on stderr)."""

import json
import random

import pytest
import torch

import countdown
from countdown.cli import commands as cli
from conftest import tiny_model
from test_calibrate import TOK, word_texts
from test_serve import chat_tokenizer

KINDS = ("dual[shadow4]", "int4", "int4 + dual[shadow4]", "dual[mixed]")
SAVED_SPEC = {"dual[shadow4]": "dual[shadow4]", "int4 + dual[shadow4]": "dual[shadow4]", "dual[mixed]": "dual[mixed]"}
PROMPT = "w1 w2 w3 w17 w5"


@pytest.fixture(scope="module")
def held_out(tmp_path_factory):
    rng = random.Random(5)
    path = tmp_path_factory.mktemp("texts") / "held_out.txt"
    path.write_text("\n\n".join(" ".join(f"w{rng.randrange(121)}" for _ in range(200)) for _ in range(3)))
    return path


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """{kind: (folder, the model as saved)} with the chat tokenizer in each folder."""
    out = {}
    for kind in KINDS:
        model = tiny_model("llama", intermediate_size=128)  # dual[mixed]'s groups of 64 divide d_inter
        if "int4" in kind:
            countdown.quantize(model, group=32)
        if "shadow4" in kind:
            art = countdown.prepare(model, TOK, "dual[shadow4]", [0.5, 0.7], texts=word_texts(0), num_tokens=256,
                                    window=64, progress=False)
            countdown.sparsify(model, "dual[shadow4]", 0.5, artifacts=art)
        if "mixed" in kind:  # the MLPs nested 8-bit (made by prepare), kept rows at 8 bits, the rest at 4
            art = countdown.prepare(model, TOK, "dual[mixed]", [0.5, 0.7], texts=word_texts(0), num_tokens=256,
                                    window=64, progress=False)
            countdown.sparsify(model, "dual[mixed]", 0.5, artifacts=art)
        folder = tmp_path_factory.mktemp("saved") / kind.replace(" + ", "-").replace("[", "-").replace("]", "")
        countdown.save(model, folder, chat_tokenizer())
        out[kind] = (folder, model)
    return out


def _ppl(model, held_out):
    return countdown.perplexity(model, chat_tokenizer(), texts=countdown.load_texts(str(held_out)), max_tokens=256,
                                window=64, metric="all")


def _run(capsys, *argv):
    code = cli.main([*argv, "--device", "cpu"])
    printed = capsys.readouterr()
    assert code == 0, printed.err
    return printed


@pytest.mark.parametrize("kind", KINDS)
def test_ppl_and_generate_run_a_saved_folder_as_saved(saved, held_out, kind, capsys):
    folder, model = saved[kind]
    sparse = kind in SAVED_SPEC  # saved sparsified: its spec and k come from the folder
    method = SAVED_SPEC.get(kind, "mono")  # a 4-bit folder alone takes a method as any model
    extra = [] if sparse else ["--method", "mono", "-k", "0.5"]
    printed = _run(capsys, "ppl", "--model", str(folder), *extra, "--texts", str(held_out), "--max-tokens", "256",
                   "--window", "64", "--json")
    result = json.loads(printed.out)
    assert (result["method"], result["sparsity"]) == (method, 0.5) and "replaces" not in printed.err
    if not sparse:
        countdown.sparsify(model, "mono", 0.5)
    try:
        assert result["perplexity"] == pytest.approx(_ppl(model, held_out), rel=1e-5)
        ids = chat_tokenizer().apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                                   return_tensors="pt", return_dict=True)["input_ids"]
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                                 pad_token_id=0)
    finally:
        if not sparse:
            countdown.unsparsify(model)
    if sparse:  # really sparse (or mixed): the saved weights alone give another perplexity: the saved weights alone give another perplexity
        dense = countdown.unsparsify(countdown.load_model(folder)[0])
        assert abs(_ppl(dense, held_out) / result["perplexity"] - 1) > 1e-4  # ten times the tolerance above
    want = chat_tokenizer().decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    assert len(want.split()) >= 3
    printed = _run(capsys, "generate", "--model", str(folder), *extra, "--prompt", PROMPT, "--max-new-tokens", "8")
    assert printed.out.strip() == want


def test_method_given_sparsifies_the_saved_weights_as_the_options_say(saved, held_out, capsys):
    folder = saved["dual[shadow4]"][0]
    printed = _run(capsys, "ppl", "--model", str(folder), "--method", "mono", "-k", "0.6", "--texts", str(held_out),
                   "--max-tokens", "256", "--window", "64", "--json")
    assert f"{folder} was saved sparsified (dual[shadow4], k=0.5); --method replaces that" in printed.err
    result = json.loads(printed.out)
    assert (result["method"], result["sparsity"]) == ("mono", 0.6)
    dense = countdown.unsparsify(countdown.load_model(folder)[0])
    assert result["perplexity"] == pytest.approx(_ppl(countdown.sparsify(dense, "mono", 0.6), held_out), rel=1e-5)
    # without --method, a k the saved artifact also holds: the saved spec and artifact at that k
    result = json.loads(_run(capsys, "ppl", "--model", str(folder), "-k", "0.7", "--texts", str(held_out),
                             "--max-tokens", "256", "--window", "64", "--json").out)
    assert (result["method"], result["sparsity"]) == ("dual[shadow4]", 0.7)
