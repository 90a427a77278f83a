"""lm-evaluation-harness without a fork: an ``HFLM`` subclass that evaluates a sparsified model.

What is sparse (the paper's setting, as in decoding):

* log-likelihood requests (multiple choice, LAMBADA, rolling perplexity): the context is the prompt
  and stays dense; every continuation token fed to the model is sparse. A continuation of ``n``
  tokens is scored from the input ``(context + continuation)[:-1]``; its first token is predicted by
  the last context position (dense, as a prefill would), the other ``n - 1`` by sparse positions.
  Each batch runs inside ``countdown.dense_prefix(model, n_dense)`` with ``n_dense[row]`` = the
  number of context tokens actually in that row's input (after lm-eval's left truncation to
  ``max_length``); rows are right-padded, so every row's prefix starts at position 0.
* ``generate_until`` requests (GSM8K): the model is patched with ``scope="decode"``, so the prompt
  (the forward that starts with an empty KV cache) is dense and each generated token is sparse.

From Python::

    lm = CountdownLM(pretrained=model, tokenizer=tok, method="mono", sparsity=0.8)   # patches model
    lm_eval.simple_evaluate(model=lm, tasks=["arc_easy"], task_manager=countdown.eval.tasks.task_manager("arc_easy"))
    lm.restore()                                                                      # unpatches it

or simply :func:`evaluate`. From the shell, ``python -m countdown.eval.lmeval`` is lm-eval's own command
line with the ``countdown`` model registered and the offline tasks on its include path::

    python -m countdown.eval.lmeval --model countdown --device cpu --tasks arc_easy --limit 50 \\
        --model_args pretrained=smollm2-135m,method=mono,sparsity=0.8,mode=prac,artifacts=PATH

(lm-eval 0.4.13 reads no entry-point group for models, so a plain ``lm_eval --model countdown``
cannot find this class unless something imported this module first.)
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F
from lm_eval.api.registry import model_registry
from lm_eval.models.huggingface import HFLM
from tqdm import tqdm

from ..nonfinite import check_finite_values
from ..spec import parse_spec, resolve_mode
from ..patch.sparsify import dense_prefix, is_sparsified, reset_sparsity_stats, sparsify, sparsity_real, unsparsify, with_mode

MODEL_NAME = "countdown"
DEFAULT_SEED = 1234
log = logging.getLogger(__name__)


class CountdownLM(HFLM):
    """lm-eval's Hugging Face causal LM with countdown's sparse Gated-MLPs.

    pretrained: a model object (then ``tokenizer`` is required) or a name/path for
        :func:`countdown.load_model` (catalogue name such as ``"smollm2-135m"``, a .gguf file, a folder), read by
        the one rule of ``--model`` (:func:`countdown.data.models.model_source`). ``artifacts``: a path or an
        :class:`~countdown.artifacts.store.Artifacts`.
    method, sparsity, mode, artifacts, path: as for :func:`countdown.sparsify`; the model is patched
        in place with ``scope="decode"`` and :meth:`restore` undoes it. ``method=None`` leaves the
        model as it is (already patched by the caller, or dense).
    dtype, device: used when ``pretrained`` is a name. A CUDA device asked for on a machine without
        CUDA (lm-eval's command line defaults to ``cuda:0``) falls back to the CPU with a warning.
    Other keyword arguments (``max_length``, ``add_bos_token``, ``softmax_dtype`` ...) go to ``HFLM``.
    """

    def __init__(self, pretrained: Any = "smollm2-135m", tokenizer: Any = None, method: str | None = "dense",
                 sparsity: float | None = None, mode: str | None = None, artifacts: Any = None, path: str = "masked",
                 dtype: str = "fp32", device: str | None = "cpu", batch_size: int | str = 8, **kwargs):
        if isinstance(pretrained, str):
            from ..data.models import load_model

            model, own_tokenizer = load_model(pretrained, dtype=dtype, device=_usable_device(device))
            tokenizer = tokenizer if tokenizer is not None else own_tokenizer
        else:
            model = pretrained
        if tokenizer is None or isinstance(tokenizer, str):
            raise ValueError("CountdownLM needs a tokenizer object with a model object "
                             "(tokenizer=<the model's tokenizer>); the hub is not consulted for one")
        self._patched_here = False
        if method is not None:
            mode = resolve_mode(method, mode)
            if is_sparsified(model):
                raise ValueError("the model is already sparsified: pass method=None to evaluate it as patched, "
                                 "or countdown.unsparsify(model) first")
            sparsify(model, with_mode(method, mode, artifacts), sparsity, scope="decode", artifacts=artifacts, path=path)
            self._patched_here = True
        self.countdown_config = {"method": None if method is None else parse_spec(method).label,
                                 "sparsity": sparsity, "mode": mode,
                                 "artifacts": None if artifacts is None else str(artifacts), "path": path}
        try:
            super().__init__(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, **kwargs)
        except BaseException:
            if self._patched_here:
                unsparsify(model)
            raise

    def restore(self) -> None:
        """Unpatch the model if this object patched it."""
        if self._patched_here and is_sparsified(self._model):
            unsparsify(self._model)
        self._patched_here = False

    def get_model_info(self) -> dict:
        # HFLM's version asks the hub for a commit sha: not reachable here, and not what identifies a run.
        info = {"model_num_parameters": sum(p.numel() for p in self._model.parameters()),
                "model_dtype": str(next(self._model.parameters()).dtype)}
        info.update({f"countdown_{k}": v for k, v in self.countdown_config.items()})
        return info

    # ---------------------------------------------------------------------------------------
    # Log-likelihood with a dense prompt and a sparse continuation
    # ---------------------------------------------------------------------------------------

    def _model_input(self, context: list[int], continuation: list[int]) -> tuple[tuple[int, ...], int]:
        """The model input for one request (lm-eval's left truncation) and its number of context tokens."""
        if len(continuation) > self.max_length:
            raise ValueError(f"a continuation of {len(continuation)} tokens is longer than "
                             f"max_length={self.max_length}")
        tokens = (context + continuation)[-(self.max_length + 1):][:-1]
        n_dense = len(tokens) - (len(continuation) - 1)
        return tuple(tokens), max(0, n_dense)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs: int | None = None):
        """``[(cache_key, context_tokens, continuation_tokens)] -> [(log p(continuation), is_greedy)]``.

        Requests whose model input and dense prefix coincide (the choices of a multiple-choice item
        that differ only in their last token) share one forward pass. Inputs run longest first,
        ``batch_size`` at a time, right-padded.
        """
        if self.backend != "causal":
            raise NotImplementedError("CountdownLM scores decoder-only (causal) models only")
        groups: dict[tuple[tuple[int, ...], int], list[int]] = {}
        for i, (_, context, continuation) in enumerate(requests):
            groups.setdefault(self._model_input(context, continuation), []).append(i)
        order = sorted(groups, key=lambda key: (-len(key[0]), key))
        batch = self._requests_batch_size(override_bs, order)
        pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        results: list[tuple[float, bool] | None] = [None] * len(requests)
        bar = tqdm(total=len(requests), disable=disable_tqdm or self.rank != 0, desc="Running loglikelihood requests")
        for start in range(0, len(order), batch):
            keys = order[start:start + batch]
            width = len(keys[0][0])
            ids = torch.full((len(keys), width), pad_id, dtype=torch.long)
            for row, (tokens, _) in enumerate(keys):
                ids[row, :len(tokens)] = torch.tensor(tokens, dtype=torch.long)
            n_dense = torch.tensor([n for _, n in keys], dtype=torch.long, device=self.device)
            lengths = torch.tensor([len(tokens) for tokens, _ in keys], dtype=torch.long, device=self.device)
            logits = self._forward_dense_prefix(ids.to(self.device), n_dense, lengths)
            for row, key in enumerate(keys):
                length = len(key[0])
                for i in groups[key]:
                    cache_key, _, continuation = requests[i]
                    n = len(continuation)
                    logp = F.log_softmax(logits[row, length - n:length], dim=-1, dtype=self.softmax_dtype)
                    target = torch.tensor(continuation, dtype=torch.long, device=logp.device)
                    answer = (float(logp.gather(-1, target[:, None]).sum()), bool((logp.argmax(-1) == target).all()))
                    results[i] = answer
                    if cache_key is not None:
                        self.cache_hook.add_partial("loglikelihood", cache_key, answer)
                    bar.update(1)
        bar.close()
        check_finite_values(results, "lm-eval's log-likelihoods")  # a NaN would still rank the choices: refused
        return results

    def _forward_dense_prefix(self, ids: torch.Tensor, n_dense: torch.Tensor,
                              lengths: torch.Tensor | None = None) -> torch.Tensor:
        if not is_sparsified(self._model):
            return self._model_call(ids)
        with dense_prefix(self._model, n_dense, lengths):
            return self._model_call(ids)

    def _requests_batch_size(self, override_bs: int | None, order: list) -> int:
        if override_bs:
            return int(override_bs)
        if str(self.batch_size).startswith("auto"):
            if not order:
                return 1
            # HFLM's detector probes with the longest request; our inputs are already sorted longest first
            probe = [(None, list(order[0][0]), [0])]
            return max(1, int(self._detect_batch_size(probe)))
        return int(self.batch_size)


def _usable_device(device: str | None) -> str:
    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if str(device).startswith("cuda") and not torch.cuda.is_available():
        log.warning("device %r asked for but CUDA is not available: using the CPU", device)
        return "cpu"
    return str(device)


def register() -> None:
    """Register :class:`CountdownLM` with lm-eval's model registry as ``"countdown"`` (idempotent)."""
    if MODEL_NAME not in model_registry:
        model_registry.register(MODEL_NAME)(CountdownLM)


register()


# -------------------------------------------------------------------------------------------------
# Python entry point
# -------------------------------------------------------------------------------------------------


def evaluate(model: Any, tokenizer: Any, tasks: list[str] | str, limit: int | float | None = None,
             method: str | None = "dense", sparsity: float | None = None, mode: str | None = None,
             artifacts: Any = None, batch_size: int | str = 8, num_fewshot: int | None = None,
             task_manager: Any = None, seed: int = DEFAULT_SEED, bootstrap_iters: int = 1000,
             path: str = "masked") -> dict:
    """Evaluate ``model`` (patched for this call only) on lm-eval tasks; returns the metrics.

    tasks: names from :func:`countdown.eval.tasks.available_tasks` (offline data, generated YAMLs) or,
        with ``task_manager`` given, any task that manager knows.
    limit: the first ``limit`` documents of each task (an integer >= 1; a float in (0, 1) is a fraction), as
        lm-eval does; None for every document (0 is refused: lm-eval would run none).
    seed: fixes python/numpy/torch/few-shot sampling seeds. ``bootstrap_iters``: for the stderr of
        metrics without a closed form (lm-eval's default, 100000, is slow on 2 cores).

    Returns ``{"tasks": {task: {metric: value}}, "n_samples": {task: n}, "sparsity_real": float | None,
    "seconds": float, "config": {...}}``; metric names are lm-eval's (``acc``, ``acc_norm``,
    ``acc_stderr``, ``perplexity``; metrics of filtered generations keep their filter,
    ``exact_match,strict-match``). Groups (``mmlu``) appear beside their subtasks.
    """
    import lm_eval

    from ..data.models import require_tokenizer
    from ..options import check_all, check_optional

    check_optional("limit", limit)  # 0 is no limit: lm-eval would read it as "no documents"
    check_all(num_fewshot=num_fewshot, bootstrap_iters=bootstrap_iters, seed=seed,
              batch_size=None if str(batch_size).startswith("auto") else batch_size)
    require_tokenizer(tokenizer, "evaluate")
    if isinstance(tasks, str):
        tasks = [t for t in tasks.split(",") if t]
    if task_manager is None:
        from .tasks import task_manager as offline_task_manager

        task_manager = offline_task_manager(tasks)
    lm = CountdownLM(pretrained=model, tokenizer=tokenizer, method=method, sparsity=sparsity, mode=mode,
                     artifacts=artifacts, path=path, batch_size=batch_size)
    try:
        patched = lm._model
        if is_sparsified(patched):
            reset_sparsity_stats(patched)
        start = time.perf_counter()
        out = lm_eval.simple_evaluate(
            model=lm, tasks=list(tasks), limit=limit, num_fewshot=num_fewshot, task_manager=task_manager,
            random_seed=seed, numpy_random_seed=seed, torch_random_seed=seed, fewshot_random_seed=seed,
            bootstrap_iters=bootstrap_iters, log_samples=False)
        seconds = time.perf_counter() - start
        real = sparsity_real(patched)["mean"] if is_sparsified(patched) and sparsity is not None else None
    finally:
        lm.restore()
    return {"tasks": {task: _metrics(values) for task, values in out["results"].items()},
            "n_samples": {task: n["effective"] for task, n in out.get("n-samples", {}).items()},
            "sparsity_real": real, "seconds": seconds,
            "config": {**lm.countdown_config, "limit": limit, "num_fewshot": num_fewshot, "seed": seed}}


def _metrics(values: dict) -> dict:
    """lm-eval's ``"acc,none": 0.5`` keys to ``"acc": 0.5`` (other filters keep their name)."""
    out = {}
    for key, value in values.items():
        # lm-eval keys metrics as "metric,filter"; "alias" and "sample_len" are bookkeeping
        if "," not in key or not isinstance(value, (int, float)):
            continue
        metric, _, filt = key.partition(",")
        out[metric if filt in ("", "none") else key] = float(value)
    return out


# -------------------------------------------------------------------------------------------------
# Command line: lm-eval's own, with the countdown model and the offline tasks available
# -------------------------------------------------------------------------------------------------


def _requested_tasks(argv: list[str]) -> list[str]:
    names = []
    for i, arg in enumerate(argv):
        if arg in ("--tasks", "-t"):
            for value in argv[i + 1:]:
                if value.startswith("-"):
                    break
                names.extend(v for v in value.split(",") if v)
        elif arg.startswith("--tasks="):
            names.extend(v for v in arg.split("=", 1)[1].split(",") if v)
    return names


def _check_limit(argv: list[str]) -> None:
    """lm-eval's ``--limit`` / ``-L`` against :data:`countdown.options.RANGES` before lm-eval starts: ``--limit 0``
    would run no document (and a negative one a slice from the end); one line and exit status 2 instead."""
    from ..options import RANGES

    for i, arg in enumerate(argv):
        flag, sep, value = arg.partition("=")
        if flag not in ("--limit", "-L"):
            continue
        value = value if sep else (argv[i + 1] if i + 1 < len(argv) else "")
        try:
            RANGES["limit"].parse(value)
        except ValueError:
            print(f"countdown-lm-eval: error: --limit {value} is not a limit: give {RANGES['limit'].text}, or leave "
                  "--limit out to score every document", file=sys.stderr)
            raise SystemExit(2) from None


def main(argv: list[str] | None = None) -> int | None:
    """``python -m countdown.eval.lmeval <lm-eval arguments>``: registers the ``countdown`` model, writes the
    YAMLs of any offline task named in ``--tasks`` and adds their folder as ``--include_path`` (unless
    one is given), then runs lm-eval's ``cli_evaluate``. An OS error (a full or read-only disk, a missing
    permission) is one line on stderr naming the path and the fix, with exit status 2, not a traceback."""
    from lm_eval.__main__ import cli_evaluate

    from ..data.texts import PackageUnavailableError
    from ..io import describe_os_error, os_error_of
    from .tasks import is_offline_task, write_task_yamls

    argv = list(sys.argv[1:] if argv is None else argv)
    _check_limit(argv)
    try:
        offline = [t for t in _requested_tasks(argv) if is_offline_task(t)]
        has_include = any(a == "--include_path" or a.startswith("--include_path=") for a in argv)
        if offline and not has_include:
            argv += ["--include_path", str(write_task_yamls(offline))]
        sys.argv = ["lm-eval", *argv]
        cli_evaluate()
    except PackageUnavailableError as err:
        print(f"countdown-lm-eval: error: {err}", file=sys.stderr)
        return 2
    except Exception as err:
        if os_error_of(err) is None:
            raise
        print(f"countdown-lm-eval: error: {describe_os_error(err)}", file=sys.stderr)
        return 2
    return None


if __name__ == "__main__":
    sys.exit(main())
