"""`countdown serve`: transformers' OpenAI-compatible server on a saved countdown model, asked over HTTP on
127.0.0.1 (a free port); its answers are the same model's greedy ``model.generate`` on the chat-templated prompt.
The server tests need transformers' serving packages (the ``serve`` extra, in ``dev``); without them they skip."""

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

import countdown
from countdown.serving import RoutedGenerate, routed_generate
from conftest import tiny_model

MESSAGES = [{"role": "user", "content": "w1 w2 w3 w17 w5"}]
NEW_TOKENS = 12


def serve_available() -> bool:
    from transformers.utils.import_utils import is_serve_available

    try:
        from transformers.cli.serving import model_manager  # noqa: F401  (transformers >= 5.17)
    except ImportError:
        return False
    return is_serve_available()


needs_serving = pytest.mark.skipif(not serve_available(), reason="transformers' serving packages are not installed "
                                                                  "(pip install 'countdown[serve]')")


def chat_tokenizer():
    """A word-level fast tokenizer of the tiny models' 128 ids (pad 0, bos 1, eos 2) with a chat template."""
    words = ["[PAD]", "[BOS]", "[EOS]", "[UNK]", "user", "assistant", "system"] + [f"w{i}" for i in range(121)]
    backend = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", pad_token="[PAD]", bos_token="[BOS]",
                                  eos_token="[EOS]")
    tok.chat_template = ("{% for m in messages %}[BOS] {{ m['role'] }} {{ m['content'] }} {% endfor %}"
                         "{% if add_generation_prompt %}assistant{% endif %}")
    return tok


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A sparsified tiny Llama (mono, k = 0.5) saved with its chat tokenizer by countdown.save."""
    folder = tmp_path_factory.mktemp("serve") / "tiny-mono"
    model = tiny_model("llama")
    countdown.sparsify(model, "mono", 0.5)
    countdown.save(model, folder, chat_tokenizer())
    return folder


def reference(model, tok, **generate_options) -> str:
    """The model's own greedy generate on the chat-templated prompt, decoded as the server decodes."""
    inputs = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False, **generate_options)
    return tok.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)


def chat(url: str, name: str, stream: bool = False, **options) -> str:
    """A chat completion over HTTP (urllib, a real client): the answer's text (streamed: its chunks joined)."""
    body = {"model": name, "messages": MESSAGES, "max_tokens": NEW_TOKENS, "temperature": 0, "stream": stream,
            **options}
    request = urllib.request.Request(f"{url}/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        raw = response.read().decode()
    if not stream:
        return json.loads(raw)["choices"][0]["message"]["content"]
    chunks = [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: ") and line != "data: [DONE]"]
    return "".join(c["delta"].get("content") or "" for chunk in chunks for c in chunk.get("choices", []))


@needs_serving
def test_countdown_serve_answers_as_the_models_own_generate(saved):
    """The command itself, in its own process on a free port: loads the saved folder, answers one chat completion
    with the text of the same folder's model.generate, and stops cleanly on SIGTERM."""
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root / "src"), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-c", "import sys; from countdown.cli import main; sys.exit(main(sys.argv[1:]))",
               "serve", str(saved), "--port", "0", "--device", "cpu"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    lines: "queue.Queue[str]" = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in process.stdout], daemon=True).start()
    try:
        first = lines.get(timeout=180)
        assert first.startswith(f"serving {saved} at http://127.0.0.1:"), first
        url = first.split(" at ", 1)[1].split("/v1", 1)[0]
        model, tok = countdown.load_model(saved)
        assert countdown.is_sparsified(model)
        want = reference(model, tok)
        assert len(want.split()) >= 3  # a continuation, so that the comparison can fail
        assert chat(url, str(saved)) == want
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
        err = process.stderr.read()
        assert "stopped: 1 requests through countdown.generate, 0 through transformers' generate" in err, err
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


@needs_serving
def test_the_server_loads_a_saved_folder_itself(saved, monkeypatch):
    """A folder is loaded by transformers' server (its from_pretrained, countdown's quantizer registered): not by
    countdown.load_model; the model it loaded is the saved one, its generate routed to countdown.generate."""
    from countdown.serving import serving

    model, tok = countdown.load_model(saved)
    want = reference(model, tok)

    def not_this_way(*args, **kwargs):
        raise AssertionError("countdown.load_model was called: the server should load the folder itself")

    monkeypatch.setattr(countdown, "load_model", not_this_way)
    with serving(saved, port=0, device="cpu", dtype="float32") as server:
        assert chat(server.url, str(saved)) == want
        assert server.route.calls == {"countdown": 1, "transformers": 0}
        assert countdown.is_sparsified(server.route.model) and server.route.model is not model


@needs_serving
def test_streaming_and_the_fallback_to_transformers_generate(saved):
    from countdown.serving import serving

    model, tok = countdown.load_model(saved)
    want = reference(model, tok)
    penalised = reference(model, tok, repetition_penalty=1.5)
    assert penalised != want  # the penalty changes the text: the fallback is seen
    with serving(model, tok, "tiny", port=0) as server:
        assert chat(server.url, "tiny", stream=True) == want
        assert (server.route.last, server.route.why) == ("countdown", None)
        # OpenAI's frequency_penalty is transformers' repetition_penalty: not a setting countdown.generate has
        assert chat(server.url, "tiny", frequency_penalty=0.5) == penalised
        assert server.route.last == "transformers" and server.route.why == "generation settings repetition_penalty"
        assert server.route.calls == {"countdown": 1, "transformers": 1}
    assert not server.thread.is_alive() and "generate" not in model.__dict__
    with serving(model, tok, "tiny", port=0, fast=False) as server:  # every request through transformers' generate
        assert server.route is None and chat(server.url, "tiny") == want


def test_the_route_takes_what_countdown_generate_serves_exactly():
    from transformers import GenerationConfig

    model = tiny_model("llama")
    route = RoutedGenerate(model)
    one = torch.tensor([[1, 4, 9, 12]])
    config = GenerationConfig(max_new_tokens=8, do_sample=True, temperature=0.7, top_k=20, top_p=0.9,
                              eos_token_id=2, pad_token_id=0, output_attentions=False)
    assert route.unroutable(one, torch.ones_like(one), config, {}) is None
    assert route.unroutable(one.repeat(2, 1), None, config, {}) == "not one prompt"
    assert route.unroutable(one, torch.tensor([[0, 1, 1, 1]]), config, {}) == "a padded prompt"
    assert route.unroutable(one, None, config, {"logits_processor": []}) == "arguments logits_processor"
    for field, value in (("repetition_penalty", 1.3), ("num_beams", 2), ("stop_strings", ["w7"]),
                         ("min_new_tokens", 3)):
        other = GenerationConfig(**{**config.to_dict(), field: value})
        assert route.unroutable(one, None, other, {}) == f"generation settings {field}"
    neutral = GenerationConfig(**{**config.to_dict(), "repetition_penalty": 1.0, "num_beams": 1})
    assert route.unroutable(one, None, neutral, {}) is None
    model.train()
    assert route.unroutable(one, None, config, {}) == "the model is in training mode"


def test_the_routed_generate_gives_transformers_greedy_tokens():
    """Greedy through the route (countdown.generate) and through transformers: the same tokens, EOS included."""
    model = tiny_model("llama")
    countdown.sparsify(model, "mono", 0.5)
    ids = torch.tensor([[1, 4, 9, 12, 30, 7]])
    with torch.no_grad():
        want = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=False)
        with routed_generate(model) as route:
            config = model.generation_config
            config.max_new_tokens = 10
            got = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=config)
    assert route.calls == {"countdown": 1, "transformers": 0}
    assert torch.equal(got, want) and "generate" not in model.__dict__


def test_serve_without_the_serving_packages_says_how_to_install(monkeypatch, capsys):
    import transformers.utils.import_utils as import_utils

    from countdown.cli import commands as cli

    monkeypatch.setattr(import_utils, "is_serve_available", lambda: False)

    def load(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(countdown, "load_model", load)
    assert cli.main(["serve", "smollm2-135m"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pip install 'countdown[serve]'" in err[0], err
