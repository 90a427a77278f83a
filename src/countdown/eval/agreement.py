"""Chat quality without a paid judge: how closely a sparse model follows its dense self.

On a fixed set of short prompts (``configs/agreement_prompts.json``, 20 of them), in the paper's
setting (prompt dense, generated tokens sparse), with y = the dense model's greedy continuation and
z = the sparse model's (``max_new_tokens`` each, stopping after an end-of-sequence token):

* ``exact_match``: fraction of prompts with z == y token for token;
* ``prefix_match``: mean over prompts of (tokens before the first divergence) / len(y);
* ``token_match``: mean over prompts of #{i < len(y): z[i] == y[i]} / len(y);
* teacher-forced on y (the input is prompt + y; the prompt positions are dense, the len(y) positions
  of y are sparse, as in decoding), over every sparse position t, pooled over prompts:
  ``kl`` = mean_t KL(p_dense || p_sparse) = sum_v p_d(v) (log p_d(v) - log p_s(v)) in nats, and
  ``top1`` = mean_t [argmax p_sparse == argmax p_dense]. The first token of y is predicted by the
  last prompt position, dense in both models, so it is not among them.

The dense reference comes from the same patched model with every position forced dense
(``dense_prefix`` longer than the input), which computes exactly the unpatched model.

Optionally, :func:`judge_win_rate` asks any OpenAI-compatible chat endpoint (given by URL; standard
library only) which answer is better, AlpacaEval style: pairwise against dense, each pair judged in
both orders so that a judge's position bias cancels; 0.5 means "as good as dense".
"""

from __future__ import annotations

import json
import math
import re
import urllib.error
import urllib.request
from importlib import resources
from typing import Any

import torch
import torch.nn.functional as F

from ..decode.cache import cache_kwargs, output_cache
from ..nonfinite import check_finite
from ..spec import parse_spec, resolve_mode
from ..patch.sparsify import dense_prefix, is_sparsified, reset_sparsity_stats, sparsify, sparsity_real, unsparsify, with_mode

PROMPTS_FILE = "agreement_prompts.json"
_ALL_DENSE = 1 << 40  # a dense prefix longer than any input: every position dense


def default_prompts() -> list[str]:
    """The shipped prompt set (``countdown/configs/agreement_prompts.json``)."""
    text = resources.files("countdown").joinpath("configs", PROMPTS_FILE).read_text(encoding="utf-8")
    return list(json.loads(text)["prompts"])


# ------------------------------------------------------------------------------------------------
# Metrics on token sequences and distributions
# ------------------------------------------------------------------------------------------------


def match_stats(reference: list[int], other: list[int]) -> dict:
    """``{"exact", "prefix", "token"}`` of ``other`` against ``reference`` (see the module docstring)."""
    n = len(reference)
    if n == 0:
        return {"exact": float(other == reference), "prefix": 1.0, "token": 1.0}
    prefix = 0
    while prefix < min(n, len(other)) and other[prefix] == reference[prefix]:
        prefix += 1
    same = sum(1 for i in range(min(n, len(other))) if other[i] == reference[i])
    return {"exact": float(other == reference), "prefix": prefix / n, "token": same / n}


def kl_and_top1(dense_logits: torch.Tensor, sparse_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per position ``KL(p_dense || p_sparse)`` (nats, float64) and top-1 agreement (bool)."""
    log_p = F.log_softmax(dense_logits.double(), dim=-1)
    log_q = F.log_softmax(sparse_logits.double(), dim=-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)
    return kl, dense_logits.argmax(-1) == sparse_logits.argmax(-1)


# ------------------------------------------------------------------------------------------------
# Generation and teacher forcing
# ------------------------------------------------------------------------------------------------


@torch.no_grad()
def greedy_continuation(model, prompt_ids: torch.Tensor, max_new_tokens: int, stop_ids: set[int]) -> list[int]:
    """Greedy decoding with a KV cache: one forward for the prompt, then one per new token."""
    out = model(input_ids=prompt_ids[None], use_cache=True)
    tokens: list[int] = []
    for step in range(max_new_tokens):
        token = int(out.logits[0, -1].argmax())
        tokens.append(token)
        if token in stop_ids or step == max_new_tokens - 1:
            break
        ids = torch.tensor([[token]], device=prompt_ids.device)
        out = model(input_ids=ids, **cache_kwargs(output_cache(out)), use_cache=True)
    return tokens


@torch.no_grad()
def _continuation_logits(model, prompt_ids: torch.Tensor, continuation: list[int], n_dense: int) -> torch.Tensor:
    """Logits at the ``len(continuation)`` positions of the continuation, prompt + continuation fed at once."""
    ids = torch.cat([prompt_ids, torch.tensor(continuation, dtype=torch.long, device=prompt_ids.device)])
    with dense_prefix(model, n_dense):
        logits = model(input_ids=ids[None]).logits[0]
    return logits[len(prompt_ids):]


def _encode(tokenizer, prompt: str, chat: bool | None) -> list[int]:
    use_chat = bool(getattr(tokenizer, "chat_template", None)) if chat is None else chat
    if use_chat:
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True)
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    return tokenizer(prompt)["input_ids"]


def _stop_ids(model, tokenizer) -> set[int]:
    """End-of-sequence ids of the tokenizer and of the model's generation config (may be several)."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids = [tokenizer.eos_token_id, *(eos if isinstance(eos, (list, tuple)) else [eos])]
    return {i for i in ids if isinstance(i, int)}


def agreement(model, tokenizer, method: str, sparsity: float | None = None, mode: str | None = None,
              artifacts: Any = None, prompts: list[str] | None = None, max_new_tokens: int = 32,
              chat: bool | None = None, path: str = "masked", judge_url: str | None = None,
              judge_model: str | None = None, judge_api_key: str | None = None) -> dict:
    """Agreement of ``model`` sparsified with (method, sparsity, mode) with the dense ``model``; ``method`` is
    a method spec and ``mode`` defaults as for :func:`countdown.sparsify`.

    The model must not be patched already; it is patched for this call (``scope="decode"``) and
    restored afterwards. ``prompts`` defaults to :func:`default_prompts`; ``chat`` (default: when the
    tokenizer has a chat template) wraps each prompt as a user turn. With ``judge_url`` (and
    ``judge_model``), the dense and sparse answers are also judged (:func:`judge_win_rate`).

    Returns the metrics of the module docstring plus ``sparsity_real`` (over the sparse positions
    of this run), ``n_prompts``, ``n_sparse_positions`` and ``per_prompt`` (texts, token ids and
    per-prompt metrics), and ``judge`` when asked for.
    """
    if is_sparsified(model):
        raise ValueError("agreement() needs the dense model: call countdown.unsparsify(model) first")
    mode = resolve_mode(method, mode)
    from ..options import check

    max_new_tokens = check("max_new_tokens", max_new_tokens)
    if judge_url and not judge_model:
        raise ValueError("judge_url needs judge_model (the model name the endpoint serves)")
    prompts = default_prompts() if prompts is None else list(prompts)
    if not prompts:
        raise ValueError("prompts is empty")
    device = next(model.parameters()).device
    stop_ids = _stop_ids(model, tokenizer)

    sparsify(model, with_mode(method, mode, artifacts), sparsity, scope="decode", artifacts=artifacts, path=path)
    try:
        reset_sparsity_stats(model)
        per_prompt, kls, top1s = [], [], []
        for prompt in prompts:
            x = torch.tensor(_encode(tokenizer, prompt, chat), dtype=torch.long, device=device)
            with dense_prefix(model, _ALL_DENSE):
                y = greedy_continuation(model, x, max_new_tokens, stop_ids)
            z = greedy_continuation(model, x, max_new_tokens, stop_ids)  # scope="decode": prompt dense
            with dense_prefix(model, _ALL_DENSE):
                dense_logits = _continuation_logits(model, x, y, _ALL_DENSE)
            sparse_logits = _continuation_logits(model, x, y, len(x))
            kl, top1 = kl_and_top1(dense_logits, sparse_logits)
            kls.append(kl)
            top1s.append(top1)
            stats = match_stats(y, z)
            per_prompt.append({
                "prompt": prompt, "dense": tokenizer.decode(y, skip_special_tokens=True),
                "sparse": tokenizer.decode(z, skip_special_tokens=True), "dense_ids": y, "sparse_ids": z,
                **stats, "kl": float(kl.mean()), "top1": float(top1.float().mean()),
            })
        real = sparsity_real(model)["mean"] if sparsity is not None else None
    finally:
        unsparsify(model)

    all_kl, all_top1 = torch.cat(kls), torch.cat(top1s)
    n = len(per_prompt)
    result = {
        "method": parse_spec(method).label, "sparsity": sparsity, "mode": mode, "n_prompts": n, "max_new_tokens": max_new_tokens,
        "exact_match": sum(p["exact"] for p in per_prompt) / n,
        "prefix_match": sum(p["prefix"] for p in per_prompt) / n,
        "token_match": sum(p["token"] for p in per_prompt) / n,
        "kl": check_finite(float(all_kl.mean()), "the KL divergence from the dense model"),
        "top1": float(all_top1.float().mean()), "n_sparse_positions": int(all_kl.numel()), "sparsity_real": real, "per_prompt": per_prompt,
    }
    if judge_url:
        result["judge"] = judge_win_rate(prompts, [p["dense"] for p in per_prompt], [p["sparse"] for p in per_prompt],
                                         url=judge_url, model=judge_model, api_key=judge_api_key)
    return result


# ------------------------------------------------------------------------------------------------
# Optional LLM judge through an OpenAI-compatible endpoint
# ------------------------------------------------------------------------------------------------

JUDGE_SYSTEM = ("You compare two responses to the same instruction and say which one is better. "
                "Reply with a single letter.")
JUDGE_TEMPLATE = ("Instruction:\n{instruction}\n\n[Response A]\n{a}\n\n[Response B]\n{b}\n\n"
                  "Which response follows the instruction better and is more helpful, correct and fluent? "
                  "Answer with exactly one letter: A or B.")


def _endpoint(url: str) -> str:
    url = url.rstrip("/")
    return url if url.endswith("/chat/completions") else url + "/chat/completions"


def ask_judge(url: str, model: str, instruction: str, a: str, b: str, api_key: str | None = None,
              timeout: float = 60.0) -> str | None:
    """One pairwise judgment: ``"A"``, ``"B"``, or None when the reply names neither."""
    body = {"model": model, "temperature": 0, "max_tokens": 8,
            "messages": [{"role": "system", "content": JUDGE_SYSTEM},
                         {"role": "user", "content": JUDGE_TEMPLATE.format(instruction=instruction, a=a, b=b)}]}
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    request = urllib.request.Request(_endpoint(url), data=json.dumps(body).encode(), headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            reply = json.loads(response.read().decode())
    except urllib.error.HTTPError as error:
        detail = error.read().decode(errors="replace")[:300]
        raise RuntimeError(f"judge endpoint {_endpoint(url)} answered HTTP {error.code}: {detail}") from None
    except urllib.error.URLError as error:
        raise RuntimeError(f"judge endpoint {_endpoint(url)} is unreachable: {error.reason}") from None
    try:
        content = reply["choices"][0]["message"]["content"] or ""
    except (KeyError, IndexError, TypeError):
        raise RuntimeError(f"judge endpoint {_endpoint(url)} sent no choices[0].message.content: "
                           f"{json.dumps(reply)[:300]}") from None
    found = re.search(r"\b([AB])\b", content.strip())
    return found.group(1) if found else None


def judge_win_rate(prompts: list[str], dense: list[str], sparse: list[str], url: str, model: str,
                   api_key: str | None = None, timeout: float = 60.0) -> dict:
    """Win rate of the sparse answers against the dense ones, judged pairwise in both orders.

    Each prompt is judged twice, (A=dense, B=sparse) and (A=sparse, B=dense); a judgment scores 1
    when the sparse answer wins, 0 when it loses and 0.5 when the reply names neither. Identical
    answers score 0.5 twice without a call. ``win_rate`` is the mean over all 2N judgments;
    ``chose_a`` (fraction of answered calls that picked A) shows the judge's position bias.
    """
    if not (len(prompts) == len(dense) == len(sparse)):
        raise ValueError("prompts, dense and sparse answers must have the same length")
    scores, chose_a, answered, unparsed, identical = [], 0, 0, 0, 0
    for prompt, d, s in zip(prompts, dense, sparse):
        if d == s:
            identical += 1
            scores += [0.5, 0.5]
            continue
        for a, b, sparse_letter in ((d, s, "B"), (s, d, "A")):
            verdict = ask_judge(url, model, prompt, a, b, api_key=api_key, timeout=timeout)
            if verdict is None:
                unparsed += 1
                scores.append(0.5)
                continue
            answered += 1
            chose_a += verdict == "A"
            scores.append(1.0 if verdict == sparse_letter else 0.0)
    return {"win_rate": sum(scores) / len(scores), "n_judgments": len(scores), "identical": identical,
            "unparsed": unparsed, "chose_a": chose_a / answered if answered else math.nan}
