"""CPU time of the shared-prompt path per configuration, against today's adapter, on 20 documents.

    PYTHONPATH=src python benchmarks/shared_prompt_marginal.py arc_easy [old]

Prints the process CPU seconds (``time.process_time``, so a loaded machine disturbs it less than
wall time) of countdown.eval.shared_prompt.score_requests for dense alone and for dense + mono, dual,
cats at k=0.8 (SP-Ideal), and the marginal cost of one more configuration; with ``old``, also
today's per-configuration adapter (CountdownLM._loglikelihood_tokens) on the same requests.
Per cell of a grid of C configurations: (1 config + (C - 1) x marginal) / C.
"""
import time, torch, sys
torch.set_num_threads(1)
from countdown.data.models import load_model
from countdown.eval.lmeval import CountdownLM
from countdown.eval.shared_prompt import EvalConfig, score_requests
from countdown.eval.tasks import task_manager
model, tok = load_model("smollm2-135m")
task_name = sys.argv[1] if len(sys.argv) > 1 else "arc_easy"
m = task_manager([task_name])
task = m.load([task_name])["tasks"][task_name]
task.build_all_requests(limit=20, rank=0, world_size=1)
lm = CountdownLM(pretrained=model, tokenizer=tok, method=None)
reqs = [lm._encode_pair(*i.args) for i in task.instances]
cfgs = [EvalConfig("dense"), EvalConfig("mono","ideal",0.8), EvalConfig("dual","ideal",0.8), EvalConfig("cats","ideal",0.8)]
c = time.process_time(); score_requests(model, reqs, cfgs[:1], lm.max_length); one = time.process_time()-c
c = time.process_time(); score_requests(model, reqs, cfgs, lm.max_length); four = time.process_time()-c
print(task_name, "CPU s for 20 docs: 1 config", round(one, 2), "4 configs", round(four, 2), "marginal per config", round((four-one)/3, 2))
if len(sys.argv) > 2:
    tot = 0
    for cfg in cfgs[1:]:
        ref = CountdownLM(pretrained=model, tokenizer=tok, method=cfg.method, sparsity=cfg.sparsity)
        c = time.process_time(); ref._loglikelihood_tokens([(None, x, y) for x, y in reqs], disable_tqdm=True); tot += time.process_time()-c
        ref.restore()
    print("old path per sparse config", round(tot/3, 2))
