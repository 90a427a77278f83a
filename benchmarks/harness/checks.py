"""Before timing: does every decode harness produce ``model.generate``'s tokens, in one graph?"""

from __future__ import annotations

import torch

from countdown.bench.speedonly import decode_prompts, fit_cuts_on_decode, random_artifacts
from countdown.patch.sparsify import with_mode
from countdown.spec import parse_spec


def dynamo_counts() -> dict:
    """Dynamo's graph and graph-break counters since they were last cleared: one graph over every
    call of a configuration means no recompilation."""
    from torch._dynamo.utils import counters

    return {"unique_graphs": int(counters["stats"]["unique_graphs"]),
            "graph_breaks": int(sum(counters["graph_break"].values()))}


def clear_dynamo_counts() -> None:
    from torch._dynamo.utils import counters

    counters.clear()


def _check_model(device: str):
    """The small random Llama both checks decode with (seeded: the same weights every time)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=1024, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=4)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg).eval()
    model.generation_config.eos_token_id = None
    return model


def run_checks(log=print, specs: tuple[str, ...] = ("mono", "dual[lowrank]"), modes: tuple[str, ...] | None = None,
               sampling: bool = True) -> bool:
    """generate_fast (eager / compile / cudagraph) against ``model.generate``, greedy, on a small fp32
    Llama, dense and patched with speed-only artifacts of ``specs`` (thresholds and a low-rank dual
    predictor: the Triton kernel paths on CUDA). The compiled step must be one graph for the whole
    generation (no graph break, no recompilation per token) and a repeated call must give the same
    tokens; with ``sampling``, a seeded sampled generation must give the same tokens in every mode."""

    import countdown
    from countdown.decode.generate import generate_fast, reset_decoders

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = _check_model(device)
    prompt = torch.randint(0, 512, (2, 9), device=device)
    if modes is None:
        modes = ("eager", "compile", "cudagraph") if device == "cuda" else ("eager",)
    ok = True
    setups = [("dense", None)]
    for label in specs:
        spec = parse_spec(label)
        art = random_artifacts(model, spec, [0.8])
        fit_cuts_on_decode(model, art, decode_prompts(512, 4, 9), new_tokens=16, rounds=1)
        setups.append((spec, art))
    n_new = 32
    for spec, art in setups:
        name = "dense" if art is None else spec.label
        if art is not None:
            countdown.sparsify(model, with_mode(spec.method, "prac", art), 0.8, artifacts=art, path="auto")
        ref = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n_new, do_sample=False)
        for mode in modes:
            torch._dynamo.reset()
            clear_dynamo_counts()
            try:
                out, stats = generate_fast(model, prompt, n_new, compile=mode)
                out2, _ = generate_fast(model, prompt, n_new, compile=mode)  # the reused graph / compiled step
            except Exception as error:  # report and go on: the other modes still run
                ok = False
                log(f"check {name:14s} {mode:9s}: FAILED with {type(error).__name__}: {str(error)[:400]}")
                continue
            same = int((out[:, 9:] == ref[:, 9:]).all(dim=0).cumprod(0).sum())
            counts = dynamo_counts()
            good = same == n_new and bool((out == out2).all())
            if mode == "compile":
                good = good and counts["unique_graphs"] == 1 and counts["graph_breaks"] == 0
            ok &= good
            log(f"check {name:14s} {mode:9s}: first {same}/{n_new} tokens equal model.generate; repeat equal "
                f"{bool((out == out2).all())}; dynamo {counts}; setup {stats['setup_s']:.1f}s -> {'ok' if good else 'FAILED'}")
        if art is None and sampling and len(modes) > 1:
            try:
                samples = [generate_fast(model, prompt, 16, temperature=0.9, top_k=50, seed=11, compile=mode)[0]
                           for mode in modes]
                same_sampled = [bool((s == samples[0]).all()) for s in samples[1:]]
                ok &= all(same_sampled)
                log(f"check dense sampled (T=0.9, top_k=50, seed 11): {modes[1:]} equal eager: {same_sampled}")
            except Exception as error:
                ok = False
                log(f"check sampled: FAILED with {type(error).__name__}: {str(error)[:400]}")
        reset_decoders()
        if art is not None:
            countdown.unsparsify(model)
    del model
    return ok


def run_slot_checks(log=print, specs: tuple[str, ...] = ("mono", "dual[lowrank]"), ks: tuple[float, ...] = (0.8, 0.5),
                    n_new: int = 24) -> bool:
    """The one-compile harness (:mod:`harness.slots`) against eager decoding of the patched model,
    on a small fp32 Llama: dense and each spec at each k (switched in place, one capture per spec) must
    give the eager tokens, and the compiled step must stay one graph with no break over all of them
    (CUDA: Inductor + our CUDA graph; CPU: Dynamo with the eager backend, no graph)."""

    import countdown
    from countdown.decode.generate import generate_fast, reset_decoders
    from countdown.bench.speedonly import private_copy, retarget

    from .slots import CapturedDecoder, SlotModel

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    model = _check_model(device)
    prompt = torch.randint(0, 512, (1, 9), device=device)
    arts = {}
    for label in specs:
        spec = parse_spec(label)
        art = random_artifacts(model, spec, list(ks))
        fit_cuts_on_decode(model, art, decode_prompts(512, 4, 9), new_tokens=16, rounds=1)
        arts[label] = (spec, art)
    refs = {("dense", None): generate_fast(model, prompt, n_new, compile="eager")[0][:, 9:]}
    for label, (spec, art) in arts.items():
        countdown.sparsify(model, with_mode(spec.method, "prac", art), ks[0], artifacts=private_copy(art), path="auto")
        try:
            for k in ks:
                retarget(model, art, k)
                refs[(label, k)] = generate_fast(model, prompt, n_new, compile="eager")[0][:, 9:]
        finally:
            countdown.unsparsify(model)
            reset_decoders()
    torch._dynamo.reset()
    clear_dynamo_counts()
    ok = True
    with SlotModel(model) as slots:
        dec = CapturedDecoder(model, slots.holder, 1, 64, compile="inductor" if cuda else "eager-backend",
                              options={"triton.cudagraphs": False})

        def check(name, k):
            nonlocal ok
            out = dec.run(prompt, n_new)[0]
            same = int((out == refs[(name, k)]).all(dim=0).cumprod(0).sum())
            ok &= same == n_new
            log(f"slot check {name:14s} k={k if k is not None else '-'}: first {same}/{n_new} tokens equal eager "
                f"-> {'ok' if same == n_new else 'FAILED'}")

        if cuda:
            dec.capture(prompt)
        check("dense", None)
        for label, (spec, art) in arts.items():
            countdown.sparsify(slots.holder, with_mode(spec.method, "prac", art), ks[0], artifacts=private_copy(art), path="auto")
            try:
                if cuda:
                    dec.capture(prompt)
                for k in ks:
                    retarget(slots.holder, art, k)
                    check(label, k)
            finally:
                dec.release()
                countdown.unsparsify(slots.holder)
    counts = dynamo_counts()
    one = counts["unique_graphs"] == 1 and counts["graph_breaks"] == 0
    ok &= one
    log(f"slot check: Dynamo over dense and every spec and k: {counts} -> {'ok' if one else 'FAILED'}")
    del model
    return ok
