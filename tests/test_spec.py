"""countdown.spec: one grammar for a method configuration, parsed in one place and accepted by every entry
point (sparsify, the builders, the command line, `countdown bench` / `sweep`), on a tiny Llama (CPU)."""

import csv
import functools
import glob
import json
import shlex
import sys
from pathlib import Path

import pytest
import torch

import countdown
from countdown.artifacts.store import ArtifactMismatchError
from countdown.cli import commands as cli
from countdown.selectors.base import KINDS, SelectorKind, register_kind
from countdown.spec import LEGACY, NOT_SPECS, Spec, artifact_spec, parse_spec, parse_specs, resolve_mode, spec_forms
from conftest import tiny_model
from test_calibrate import CharTokenizer, TOK, word_texts

ROOT = Path(__file__).resolve().parents[1]
KW = dict(texts=word_texts(0), num_tokens=256, window=128, progress=False)
IDS = torch.randint(3, 120, (2, 24), generator=torch.Generator().manual_seed(0))


# ---------------------------------------------------------------------------------------------------------
# The grammar
# ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, label, method, kind, options", [
    ("dense", "dense", "dense", None, {}),
    ("mono", "mono", "mono", None, {}),
    ("M-CountDown", "mono", "mono", None, {}),  # registry aliases, any case
    ("cats", "cats", "cats", None, {}),
    ("teal", "teal", "teal", None, {}),
    ("dual", "dual", "dual", None, {}),
    ("dejavu", "dejavu", "dejavu", None, {}),
    ("dual[shadow4]", "dual[shadow4]", "dual", "shadow", {"bits": 4}),
    ("dual[shadow]", "dual[shadow4]", "dual", "shadow", {"bits": 4}),  # shadow's bits always printed
    ("dual[shadow8]", "dual[shadow8]", "dual", "shadow", {"bits": 8}),
    ("dual[shadow3g64]", "dual[shadow3]", "dual", "shadow", {"bits": 3}),  # group 64 is the default
    ("dual[shadow3g32]", "dual[shadow3g32]", "dual", "shadow", {"bits": 3, "group": 32}),
    ("dual[shadow,bits=2,group=32]", "dual[shadow2g32]", "dual", "shadow", {"bits": 2, "group": 32}),
    ("dual[lowrank]", "dual[lowrank]", "dual", "lowrank", {}),
    ("dual[lowrank256]", "dual[lowrank256]", "dual", "lowrank", {"d_rank": 256}),
    ("dual[hybrid]", "dual[hybrid]", "dual", "hybrid", {}),
    ("dual[hybrid128]", "dual[hybrid128]", "dual", "hybrid", {"d_rank": 128}),  # d_rank's default is capped per model
    ("dual[ternary]", "dual[ternary]", "dual", "ternary", {}),
    ("dejavu[lowrank]", "dejavu[lowrank]", "dejavu", "lowrank", {}),
    ("d-countdown [ Shadow4 , cut_rule = pooled ]", "dual[shadow4,cut_rule=pooled]", "dual", "shadow",
     {"bits": 4, "cut_rule": "pooled"}),
    ("dual[lowrank,epochs=1,d_rank=8]", "dual[lowrank8,epochs=1]", "dual", "lowrank", {"d_rank": 8, "epochs": 1}),
    ("dual[hybrid,cut_rule=mean-quantile]", "dual[hybrid]", "dual", "hybrid", {}),  # a default option drops out
    ("mono[threshold]", "mono[threshold]", "mono", "threshold", {}),  # SP-Prac always prints its kind
    ("mono[rule=pooled]", "mono[threshold,rule=pooled]", "mono", "threshold", {"rule": "pooled"}),  # kind implied
    ("cats[threshold]", "cats[threshold]", "cats", "threshold", {}),
    ("teal[teal]", "teal[teal]", "teal", "teal", {}),
    ("teal[allocation=uniform]", "teal[teal,allocation=uniform]", "teal", "teal", {"allocation": "uniform"}),
])
def test_labels_parse_and_print_one_way(text, label, method, kind, options):
    spec = parse_spec(text)
    assert (spec.label, spec.method, spec.kind, spec.options) == (label, method, kind, options)
    assert spec.mode == ("ideal" if kind is None else "prac")  # every spec says SP-Ideal or SP-Prac by itself
    assert ("[" in spec.label) == (kind is not None)
    again = parse_spec(spec.label)  # the label is a spec of the same configuration, printed the same
    assert again.label == spec.label and again.resolved() == spec.resolved()
    assert str(spec) == spec.label and parse_spec(spec) is spec
    assert "[" not in spec.slug and spec.slug.startswith(method)


def test_a_plain_method_resolves_to_its_default_kind_named_in_full():
    assert parse_spec("dual").resolved() == parse_spec("dual[shadow4]") == parse_spec("dual[shadow]")
    assert parse_spec("dual").resolved().label == "dual[shadow4]"
    assert parse_spec("dejavu").resolved().label == "dejavu[lowrank]"
    assert [parse_spec(m).resolved().label for m in ("mono", "cats", "teal", "dense")] == \
        ["mono[threshold]", "cats[threshold]", "teal[teal]", "dense"]
    assert parse_spec("mono").resolved().kind == "threshold" and parse_spec("teal").resolved().kind == "teal"
    assert parse_spec("dual[lowrank]").with_options(d_rank=32).label == "dual[lowrank32]"
    assert parse_specs("mono, dual[hybrid],mono,dual[shadow4,cut_rule=pooled]") == \
        [parse_spec("mono"), parse_spec("dual[hybrid]"), parse_spec("dual[shadow4,cut_rule=pooled]")]


def test_a_bracketed_kind_implies_prac():
    assert resolve_mode("dual[shadow4]", None) == "prac" and resolve_mode("mono[threshold]", None) == "prac"
    assert resolve_mode("dual", None) == "ideal" and resolve_mode("dual", "prac") == "prac"
    with pytest.raises(ValueError, match=r"'dual\[shadow4\]' names an SP-Prac kind \(shadow\).*write 'dual' for SP-Ideal"):
        resolve_mode("dual[shadow4]", "ideal")
    with pytest.raises(ValueError, match="unknown mode 'fast'"):
        resolve_mode("dual", "fast")


def test_a_spec_carries_k_scope_and_prints_its_method_part():
    spec = parse_spec("dual[shadow]", k=0.5, scope="all")
    assert (spec.label, str(spec), spec.k, spec.scope, spec.weights) == ("dual[shadow4]", "dual[shadow4]", 0.5, "all", None)
    assert repr(spec) == "Spec('dual[shadow4]', k=0.5, scope='all')"
    assert spec != parse_spec("dual[shadow4]") and spec == parse_spec("dual[shadow4]").at(0.5, "all")
    assert spec.resolved() is spec and spec.with_options(bits=3).label == "dual[shadow3]"
    assert spec.with_options(bits=3).k == 0.5  # the method part changes, k and scope stay
    assert parse_spec("dual", k=0.8).resolved() == parse_spec("dual[shadow4]", k=0.8)
    with pytest.raises(ValueError, match="sparsity"):
        parse_spec("mono", k=1.5)
    with pytest.raises(ValueError, match="unknown scope 'prompt'"):
        parse_spec("mono", scope="prompt")


def test_a_models_configuration_is_its_spec_k_scope_and_weight_format():
    from countdown.spec import WeightFormat

    model = tiny_model("llama", intermediate_size=96)
    assert Spec.of(model) == parse_spec("dense") and Spec.of(model).weights is None
    countdown.quantize(model, group=32, lm_head=True)
    weights = Spec.of(model).weights
    assert (weights.bits, weights.group, weights.source, weights.scale_dtype, weights.lm_head) == \
        (4, 32, "rtn", "float16", True) and weights.record == model.config.countdown_int4
    countdown.sparsify(model, parse_spec("mono", 0.5, "all").at(weights=weights))  # k, scope from the spec
    assert Spec.of(model) == parse_spec("mono", 0.5, "all").at(weights=WeightFormat.from_record(
        model.config.countdown_int4))
    assert repr(Spec.of(model)) == ("Spec('mono', k=0.5, scope='all', weights='int4 (groups of 32, float16 scales, "
                                    "lm_head)')")
    countdown.unsparsify(model)
    with pytest.raises(ValueError, match=r"the spec's weights are int4 .* but the model's are as loaded"):
        countdown.sparsify(tiny_model("llama"), parse_spec("mono", 0.5).at(weights=weights))


PRAC_QUALITY = {  # benchmarks/prac_quality.py's labels in results/prac_quality -> the configuration they name
    "dual[shadow4-g32]": "dual[shadow4g32]", "dual[shadow4-pooled]": "dual[shadow4,cut_rule=pooled]",
    "teal[greedy]": "teal", "teal[uniform]": "teal[allocation=uniform]", "mono[threshold]": "mono",
    "cats[threshold]": "cats", "dual[shadow2]": "dual[shadow2]", "dual[shadow8]": "dual[shadow8]",
}


def test_every_label_of_the_committed_results_parses_or_is_explained():
    # the results tables whose method column names configurations (kernel tables name kernel routes)
    patterns = ("results/**/decode.csv", "results/quality/*.csv", "results/prac_quality/*.csv", "results/teal/*.csv",
                "results/countdown_bench/*.csv", "results/operating_points/**/*.csv", "results/demo/*.csv",
                "results/tp_decode.csv", "results/decode_cpu.csv")
    files = [f for pattern in patterns for f in glob.glob(str(ROOT / pattern), recursive=True)]
    labels = set()
    for path in files:
        with open(path, newline="") as f:
            labels |= {row["method"] for row in csv.DictReader(f) if "method" in row}
    assert {"dual[lowrank256]", "dual[shadow4-g32]", "teal[uniform]", "dejavu[lowrank]"} <= labels  # they are read
    for label in sorted(labels):
        if label in NOT_SPECS:
            with pytest.raises(ValueError, match="not a library configuration"):
                parse_spec(label)
            continue
        spec = parse_spec(label)
        assert parse_spec(spec.label).resolved() == spec.resolved()
    for label, canonical in {**PRAC_QUALITY, **LEGACY}.items():
        assert parse_spec(label).resolved() == parse_spec(canonical).resolved()
        assert parse_spec(label).kind is not None  # a bracketed label was SP-Prac there and stays SP-Prac
    assert parse_spec("teal[uniform]").options == {"allocation": "uniform"}
    assert parse_spec("dual[shadow4-g32]").options == {"bits": 4, "group": 32}


@pytest.mark.parametrize("text, message", [
    ("dual[foo]", r"'dual\[foo\]': no SP-Prac kind 'foo'; dual takes dual\[hybrid<d_rank>\], dual\[lowrank<d_rank>\], "
                  r"dual\[mixed\], dual\[shadow<bits>\], dual\[ternary\]"),
    ("mono[lowrank]", r"kind 'lowrank' serves dual and dejavu only; mono takes mono\[threshold\]"),
    ("dense[shadow4]", "dense has no SP-Prac kinds .* write dense"),
    ("dual[ternary3]", r"kind ternary takes no number; write dual\[ternary\]"),
    ("dual[shadow4x2]", "kind shadow takes no x<number> .its letters: g<group>"),
    ("dual[shadow5]", "bits=5 is not one of 2, 3, 4, 8"),
    ("dual[shadow4,foo=1]", "kind shadow takes no option foo; its options are bits, cut_rule, group"),
    ("dual[shadow4,cut_rule=best]", "cut_rule=best is not one of mean-quantile, pooled"),
    ("dual[cut_rule=pooled]", r"name the SP-Prac kind first, e.g. dual\[hybrid,cut_rule=pooled\]"),
    ("dual[shadow4,pooled]", "'pooled' is no KEY=VALUE option"),
    ("nosuch", r"unknown method 'nosuch'.*valid specs: dense, cats, mono, dual, dual\[hybrid<d_rank>\]"),
    ("dual[", "cannot read the method spec 'dual\\['.*valid specs"),
    ("dual[shadow4-s]", "an experiment of benchmarks/prac_quality.py"),
])
def test_errors_name_the_fix(text, message):
    with pytest.raises(ValueError, match=message):
        parse_spec(text)


def test_spec_forms_list_what_the_library_runs():
    assert spec_forms() == ["dense", "cats", "mono", "dual", "dual[hybrid<d_rank>]", "dual[lowrank<d_rank>]",
                            "dual[mixed]", "dual[shadow<bits>]", "dual[ternary]", "dejavu", "dejavu[lowrank<d_rank>]",
                            "dejavu[ternary]", "teal"]
    with pytest.raises(TypeError, match="a method spec is a string"):
        parse_spec(3)


class ToyKind(SelectorKind):
    name = "toy"
    methods = ("dual",)
    defaults = {"d_rank": 8, "cut_rule": "pooled"}
    spec_number = "d_rank"


def test_a_new_kind_needs_no_edit_of_the_grammar():
    kind = register_kind(ToyKind())
    try:
        assert parse_spec("dual[toy16]").options == {"d_rank": 16} and parse_spec("dual[toy16]").label == "dual[toy16]"
        assert parse_spec("dual[toy,cut_rule=mean-quantile]").label == "dual[toy,cut_rule=mean-quantile]"
        assert "dual[toy<d_rank>]" in spec_forms("dual")
        with pytest.raises(ValueError, match="kind 'toy' serves dual only"):
            parse_spec("dejavu[toy]")
    finally:
        del KINDS[kind.name]
    with pytest.raises(ValueError, match="no SP-Prac kind 'toy'"):
        parse_spec("dual[toy]")


# ---------------------------------------------------------------------------------------------------------
# The API takes a spec
# ---------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


@pytest.fixture(scope="module")
def shadow4(model):
    return countdown.prepare(model, TOK, "dual[shadow4]", [0.6, 0.8], **KW)


def logits(model, method, k, **kwargs):
    countdown.sparsify(model, method, k, scope="all", **kwargs)
    try:
        with torch.no_grad():
            return model(IDS).logits
    finally:
        countdown.unsparsify(model)


def test_sparsify_with_a_spec_is_the_method_in_prac_mode(model, shadow4, tmp_path):
    # the builder: the spec's kind and options are prepare's kind= and options
    plain = countdown.prepare(model, TOK, "dual", [0.6, 0.8], kind="shadow", bits=4, **KW)
    assert shadow4.kind == "shadow" and shadow4.meta["bits"] == 4 and artifact_spec(shadow4).label == "dual[shadow4]"
    assert shadow4.tensors.keys() == plain.tensors.keys()
    assert all(torch.equal(shadow4.tensors[n], plain.tensors[n]) for n in plain.tensors)
    want = logits(model, "dual[shadow4]", 0.8, artifacts=plain)
    dense = logits(model, "dense", None)
    assert not torch.allclose(want, dense, atol=1e-3)  # the sparse model computes something else than dense
    path = shadow4.save(tmp_path / "shadow4.safetensors")
    for spec in ["dual[shadow4]", "dual[shadow]", "D-CountDown[shadow4]", parse_spec("dual[shadow4]")]:
        assert torch.equal(logits(model, spec, 0.8, artifacts=shadow4), want), spec
    assert torch.equal(logits(model, "dual[shadow4]", 0.8, artifacts=path), want)  # a path too
    # k and the scope from the spec (logits() asks for scope="all": the spec's must agree)
    assert torch.equal(logits(model, parse_spec("dual[shadow4]", k=0.8, scope="all"), None, artifacts=shadow4), want)
    with pytest.raises(ValueError, match="sparsity=0.6 was given but the spec says sparsity=0.8"):
        countdown.sparsify(model, parse_spec("dual[shadow4]", k=0.8), 0.6, artifacts=shadow4)
    assert not countdown.is_sparsified(model)
    # no kind in brackets: SP-Ideal, as always
    assert not torch.equal(logits(model, "dual", 0.8), want)


def test_mode_is_deprecated_and_folds_into_the_spec(model, shadow4, tmp_path):
    want = logits(model, "dual[shadow4]", 0.8, artifacts=shadow4)
    path = shadow4.save(tmp_path / "shadow4.safetensors")
    for spec, mode, artifacts in [("dual", "prac", shadow4), ("dual", "prac", path), ("dual[shadow4]", "prac", shadow4)]:
        with pytest.warns(DeprecationWarning, match=r"mode='prac' .* is deprecated.*write 'dual\[shadow4\]'"):
            assert torch.equal(logits(model, spec, 0.8, mode=mode, artifacts=artifacts), want), (spec, artifacts)
    with pytest.warns(DeprecationWarning, match=r"mode='ideal' .*write 'dual' \(a plain method is SP-Ideal\)"):
        ideal = logits(model, "dual", 0.8, mode="ideal")
    assert torch.equal(ideal, logits(model, "dual", 0.8))
    # a plain method in prac mode takes the artifact's kind and options, read from the file's header
    from countdown.patch.sparsify import with_mode

    assert with_mode("dual", "prac", path) == parse_spec("dual[shadow4]")
    assert with_mode("dual", None, path) == parse_spec("dual") and with_mode("mono", "ideal") == parse_spec("mono")
    with pytest.raises(ValueError, match="mode='prac' needs artifacts for dual.*'dual\\[shadow4\\]'"):
        countdown.sparsify(model, "dual", 0.8, mode="prac")
    with pytest.raises(ArtifactMismatchError, match="made for method 'dual', not 'mono'"):
        countdown.sparsify(model, "mono", 0.8, mode="prac", artifacts=shadow4)
    assert not countdown.is_sparsified(model)


def test_a_kind_that_disagrees_is_refused_naming_both(model, shadow4):
    for spec, have in [("dual[hybrid]", "dual[shadow4]"), ("dual[shadow3]", "dual[shadow4]"),
                       ("dual[shadow4,cut_rule=pooled]", "dual[shadow4]")]:
        with pytest.raises(ArtifactMismatchError, match=rf"spec is '{spec}' but the artifact holds '{have}'".replace(
                "[", r"\[").replace("]", r"\]")):
            countdown.sparsify(model, spec, 0.8, artifacts=shadow4)
        assert not countdown.is_sparsified(model)
    with pytest.raises(ValueError, match=r"names an SP-Prac kind \(shadow\), which implies mode='prac'"):
        countdown.sparsify(model, "dual[shadow4]", 0.8, mode="ideal", artifacts=shadow4)
    with pytest.raises(ValueError, match=r"'dual\[shadow4\]' is SP-Prac \(its kind in brackets\) and needs its artifact"):
        countdown.sparsify(model, "dual[shadow4]", 0.8)
    with pytest.raises(ValueError, match=r"'dual' is SP-Ideal .*\('dual\[shadow4\]' for this artifact\)"):
        countdown.sparsify(model, "dual", 0.8, artifacts=shadow4)
    with pytest.raises(ArtifactMismatchError, match="made for method 'dual', not 'mono'"):
        countdown.sparsify(model, "mono[threshold]", 0.8, artifacts=shadow4)
    assert not countdown.is_sparsified(model)
    # the builders: an explicit kind= / option against the brackets
    with pytest.raises(ValueError, match=r"'dual\[shadow4\]' names SP-Prac kind 'shadow' but kind='hybrid' was given"):
        countdown.prepare(model, TOK, "dual[shadow4]", 0.8, kind="hybrid", **KW)
    with pytest.raises(ValueError, match=r"'dual\[shadow4\]' says bits=4 but bits=3 was given"):
        countdown.prepare(model, TOK, "dual[shadow4]", 0.8, bits=3, **KW)
    # the deprecated builders keep the checks their names promised
    with pytest.warns(DeprecationWarning, match="countdown.calibrate is a deprecated alias of countdown.prepare"), \
            pytest.raises(ValueError, match="kind 'lowrank' is gradient-trained: use countdown.train_predictors"):
        countdown.calibrate(model, TOK, "dual[lowrank]", 0.8, **KW)
    with pytest.warns(DeprecationWarning, match="countdown.train_predictors is a deprecated alias"), \
            pytest.raises(ValueError, match="kind 'threshold' applies to cats and mono only"):
        countdown.train_predictors(model, TOK, "dual", 0.8, kind="threshold", **KW)


def test_every_builder_takes_a_spec(model, tmp_path, monkeypatch):
    trained = countdown.prepare(model, TOK, "dual[lowrank8,epochs=1]", 0.8, **KW)
    with pytest.warns(DeprecationWarning, match="train_predictors"):
        same = countdown.train_predictors(model, TOK, "dual", 0.8, kind="lowrank", d_rank=8, epochs=1, **KW)
    assert trained.meta["d_rank"] == 8 and trained.meta["training"]["epochs"] == 1
    assert all(torch.equal(trained.tensors[n], same.tensors[n]) for n in same.tensors)
    assert artifact_spec(trained).label == "dual[lowrank8,epochs=1]"
    with pytest.warns(DeprecationWarning, match="calibrate"):
        pooled = countdown.calibrate(model, TOK, "mono[rule=pooled]", 0.8, **KW)
    assert pooled.kind == "threshold" and pooled.meta["rule"] == "pooled"
    assert artifact_spec(pooled).label == "mono[threshold,rule=pooled]"
    # prepare(cache_dir=): one cached file per configuration, however it is spelled (ensure_artifacts: its alias)
    first = countdown.prepare(model, TOK, "dual[shadow4]", 0.8, cache_dir=tmp_path, **KW)
    assert len(list(tmp_path.glob("dual-*.safetensors"))) == 1

    def no_build(*args, **kwargs):
        raise AssertionError("should have loaded from the cache")

    monkeypatch.setattr(sys.modules["countdown.artifacts.prepare"], "_build", no_build)
    for spelling in (("dual", {}), ("dual", {"kind": "shadow"}), ("dual[shadow]", {}), ("dual", {"bits": 4}),
                     ("dual", {"window": 128})):  # an argument at its default keys the file as if left out
        again = countdown.prepare(model, TOK, spelling[0], 0.8, cache_dir=tmp_path, **{**KW, **spelling[1]})
        assert torch.equal(again.tensors["k=0.8/layer0/cut"], first.tensors["k=0.8/layer0/cut"])
    with pytest.warns(DeprecationWarning, match="ensure_artifacts"):
        again = countdown.ensure_artifacts(model, TOK, "dual", 0.8, tmp_path, **KW)
    assert torch.equal(again.tensors["k=0.8/layer0/cut"], first.tensors["k=0.8/layer0/cut"])
    with pytest.raises(AssertionError, match="cache"):
        countdown.prepare(model, TOK, "dual[shadow3]", 0.8, cache_dir=tmp_path, **KW)  # another configuration


def test_the_eval_entry_points_take_a_spec(model, shadow4):
    from countdown.eval.agreement import agreement

    class Tok(CharTokenizer):
        def decode(self, ids, skip_special_tokens=True):
            return "".join(chr(97 + int(i) % 26) for i in ids)

    result = agreement(model, Tok(), "dual[shadow4]", 0.8, artifacts=shadow4, prompts=["a b c", "d e"],
                       max_new_tokens=3, chat=False)
    assert (result["method"], result["mode"]) == ("dual[shadow4]", "prac") and not countdown.is_sparsified(model)


# ---------------------------------------------------------------------------------------------------------
# The command line and `countdown bench`
# ---------------------------------------------------------------------------------------------------------

class GenTok(CharTokenizer):
    """The character tokenizer with what `countdown generate` asks of a tokenizer."""

    pad_token_id = 0

    def __call__(self, text, add_special_tokens=False, return_tensors=None):
        ids = super().__call__(text)["input_ids"]
        return {"input_ids": torch.tensor([ids]) if return_tensors == "pt" else ids}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + int(i) % 26) for i in ids)


@pytest.fixture
def tiny_cli(monkeypatch, tmp_path):
    model = tiny_model("llama")
    monkeypatch.setattr(countdown, "load_model", lambda *a, **k: (model, GenTok()))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "calib.txt").write_text("\n".join(word_texts(0)))
    (tmp_path / "held.txt").write_text("\n".join(word_texts(1)))
    return model


def run(model, argv) -> int:
    """``countdown ARGV`` on the tiny model, which is left dense afterwards (ppl / generate leave it patched)."""
    try:
        return cli.main(argv)
    finally:
        if countdown.is_sparsified(model):
            countdown.unsparsify(model)


def test_the_cli_accepts_specs(tiny_cli, capsys):
    ppl = ["--texts", "held.txt", "--max-tokens", "256", "--window", "128", "--json"]
    main = functools.partial(run, tiny_cli)
    assert main(["calibrate", "--method", "dual[shadow4]", "-k", "0.8", "--texts", "calib.txt",
                     "--num-tokens", "256"]) == 0
    assert "(dual[shadow4])" in capsys.readouterr().out
    art = countdown.load_artifacts("dual-shadow4-smollm2-135m-k0.8.safetensors")  # named after the spec
    assert art.kind == "shadow" and art.meta["bits"] == 4
    assert main(["ppl", "--method", "dual[shadow4]", "-k", "0.8", "--artifacts",
                     "dual-shadow4-smollm2-135m-k0.8.safetensors", *ppl]) == 0
    bracketed = json.loads(capsys.readouterr().out)
    assert (bracketed["method"], bracketed["mode"]) == ("dual[shadow4]", "prac")  # no --mode: implied
    assert main(["ppl", "--method", "dual", "--mode", "prac", "-k", "0.8", "--artifacts",
                     "dual-shadow4-smollm2-135m-k0.8.safetensors", *ppl]) == 0
    printed = capsys.readouterr()  # --mode still works this release, with a warning naming the spec to write
    assert json.loads(printed.out)["perplexity"] == bracketed["perplexity"]
    assert "--mode prac) is deprecated" in printed.err and "write 'dual[shadow4]'" in printed.err
    assert main(["train", "--method", "dual[lowrank8]", "-k", "0.8", "--epochs", "1", "--texts", "calib.txt",
                     "--num-tokens", "256", "--out", "lr.safetensors"]) == 0
    assert countdown.load_artifacts("lr.safetensors").meta["d_rank"] == 8
    capsys.readouterr()
    for argv, message in [
        (["ppl", "--method", "dual[hybrid]", "-k", "0.8", "--artifacts", "lr.safetensors"],
         r"spec is 'dual[hybrid]' but the artifact holds 'dual[lowrank8,epochs=1]'"),
        (["ppl", "--method", "dual[shadow4]", "--mode", "ideal", "-k", "0.8"], "implies mode='prac'"),
        (["calibrate", "--method", "dual[shadow4]", "--kind", "hybrid"], "kind='hybrid' was given"),
        (["calibrate", "--method", "dual[shadow4]", "--bits", "3", "--texts", "calib.txt"], "says bits=4 but bits=3"),
        (["eval", "--method", "dual[nosuch]"], "no SP-Prac kind 'nosuch'"),
        (["agreement", "--method", "mono[lowrank]"], "kind 'lowrank' serves dual and dejavu only"),
    ]:
        assert main(argv) == 2, argv
        assert message in capsys.readouterr().err
    assert main(["methods"]) == 0
    listed = capsys.readouterr().out
    assert "dual[shadow<bits>]" in listed and "default kind (built for plain dual): dual[shadow4]" in listed
    assert "SP-Prac: mono[threshold] (kind threshold)" in listed and "--mode" not in listed


def test_the_bench_recommendation_pastes_into_the_api_and_the_cli(tiny_cli, capsys, monkeypatch):
    from countdown.bench.cli import usage_lines

    rows = [{"method": "dense", "sparsity": 0.0, "sparsity_real": 0.0, "ppl_increase": 0.0, "decode_speedup": 1.0},
            {"method": "dual[shadow4]", "sparsity": 0.8, "sparsity_real": 0.8, "ppl_increase": 0.03,
             "decode_speedup": 1.5},
            {"method": "mono", "sparsity": 0.8, "sparsity_real": 0.8, "ppl_increase": 0.2, "decode_speedup": 1.9}]
    python, shell, use = usage_lines(rows, 0.05, "tiny")
    # the Python form, run as printed (prepare with the tests' calibration text)
    model = tiny_cli
    real_prepare = countdown.prepare
    monkeypatch.setattr(countdown, "prepare", functools.partial(real_prepare, **KW))
    namespace = {"countdown": countdown, "model": model, "tokenizer": TOK}
    exec(python.split(":", 1)[1].strip(), namespace)
    with torch.no_grad(), countdown.dense_prefix(model, 0):  # every position sparse
        pasted = model(IDS).logits
    countdown.unsparsify(model)
    art = real_prepare(model, TOK, "dual[shadow4]", 0.8, **KW)
    assert torch.equal(logits(model, "dual[shadow4]", 0.8, artifacts=art), pasted)
    assert not torch.allclose(logits(model, "dense", None), pasted, atol=1e-3)
    # the shell form, run as printed (the calibration text added)
    build, gen = shlex.split(shell.split(":", 1)[1]), shlex.split(use)
    assert build[:2] == ["countdown", "calibrate"] and "dual[shadow4]" in build and gen[1] == "generate"
    assert run(model, build[1:] + ["--texts", "calib.txt", "--num-tokens", "256"]) == 0
    assert countdown.load_artifacts(build[build.index("--out") + 1]).kind == "shadow"
    capsys.readouterr()
    assert run(model, gen[1:] + ["--max-new-tokens", "4"]) == 0
    assert len(capsys.readouterr().out.strip()) > 0  # the continuation
    trained = usage_lines([rows[0], {**rows[1], "method": "dejavu[lowrank]"}], 0.05, "tiny")
    assert "countdown train " in trained[1] and '"dejavu[lowrank]"' in trained[0]
    assert usage_lines([rows[0], rows[2]], 0.05, "tiny") == []  # nothing within the bound: nothing to paste


def test_specs_are_the_only_grammar_left():
    import harness.qualitygrid as qualitygrid
    import countdown.eval.sweep.cells as cells

    assert not hasattr(cells, "parse_method_spec") and not hasattr(cells, "_SPEC")
    assert not hasattr(qualitygrid, "artifact_options")
    with open(ROOT / "benchmarks" / "prac_quality.py") as f:
        assert "countdown.spec import parse_spec" in f.read()
    assert isinstance(parse_spec("dual"), Spec)
