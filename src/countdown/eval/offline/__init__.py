"""Scoring the sweep's lm-eval requests on a machine with only torch and transformers (a GPU).

The CPU keeps lm-eval (documents, prompts, metrics); the GPU does the forward passes:

1. ``countdown sweep ... --export DIR`` (CPU): the job, :mod:`countdown.eval.offline.files`;
   :func:`countdown.eval.offline.weights.pack_gguf`: the model's weights as their GGUF blocks.
2. ``python -m countdown.eval.offline.device --job ... --weights ... --out SCORES`` (GPU): every
   configuration's log-likelihoods (:mod:`countdown.eval.offline.device`, :mod:`countdown.eval.scoring`).
3. ``countdown sweep ... --scores SCORES`` (CPU): lm-eval's metrics over those answers, into the
   sweep's CSV, per-document side file and report (:mod:`countdown.eval.sweep.offline`).
"""
