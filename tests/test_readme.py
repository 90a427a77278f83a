"""The README's quick start runs as written, on the CPU, with the model name swapped for a tiny model (and the
held-out and calibration text for offline pseudo-text, so the test needs no download)."""

import re
from pathlib import Path

import torch

import countdown
import countdown.data.texts as texts_module
import countdown.model.saving
from conftest import tiny_model
from test_calibrate import word_texts

README = Path(__file__).resolve().parent.parent / "README.md"


class ReadmeTokenizer:
    """One token per character, with the calls the quick start makes (tensors out, decode)."""

    bos_token_id, eos_token_id, pad_token_id = 1, 2, 0

    def __call__(self, text, add_special_tokens=False, return_tensors=None):
        ids = [3 + (ord(c) % 120) for c in text]
        if return_tensors == "pt":
            ids = torch.tensor([ids])
            return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        return {"input_ids": ids}

    def save_pretrained(self, folder):
        (folder / "tokenizer.txt").write_text("characters")

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(97 + (int(i) - 3) % 26) for i in ids if int(i) > 2)


def quick_start() -> str:
    text = README.read_text(encoding="utf-8")
    section = text[text.index("## Quick start"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_quick_start_runs_as_written(monkeypatch, tmp_path, capsys):
    code = quick_start()
    assert 'countdown.load_model("smollm2-135m")' in code  # the line the test swaps, so it is still there
    model = tiny_model("llama")
    model.generation_config.eos_token_id = None
    monkeypatch.setattr(countdown, "load_model", lambda *a, **k: (model, ReadmeTokenizer()))
    monkeypatch.setattr(texts_module, "eval_texts", lambda *a, **k: word_texts(1))
    monkeypatch.setattr(texts_module, "calibration_texts", lambda *a, **k: word_texts(0))
    monkeypatch.chdir(tmp_path)
    exec(compile(code, "README.md quick start", "exec"), {})
    printed = capsys.readouterr().out.splitlines()
    assert len(printed) == 3 and len(printed[0]) > 0  # the generated text, then two perplexities
    decode_ppl, ideal_ppl = float(printed[1]), float(printed[2])
    assert 1 < decode_ppl < 1e4 and 1 < ideal_ppl < 1e4
    assert not countdown.is_sparsified(model)
    assert countdown.model.saving.saved_config(tmp_path / "smollm2-dual")["spec"] == "dual[shadow4]"
    back = countdown.load_artifacts(tmp_path / "dual-shadow4.safetensors")
    assert back.method == "dual" and back.kind == "shadow" and back.sparsities == [0.5]
