"""``countdown bench``: speed and quality of each configuration on the user's own model and machine.

* :mod:`~countdown.bench.cli`: the command (``countdown bench``, ``python -m countdown.bench.cli``);
* :mod:`~countdown.bench.operating`: the operating points it measures (dense and each method spec at each k);
* :mod:`~countdown.bench.measure`: decode tokens/s through ``generate_fast``, kept fractions;
* :mod:`~countdown.bench.quality`: decode-style perplexity, KL and top-1 against dense in one pass;
* :mod:`~countdown.bench.speedonly`: speed-only artifacts (random predictors, cuts fitted on the model's own
  decode steps) for models without a tokenizer (the random-weight ``*-shape`` models);
* :mod:`~countdown.bench.opreport`: the operating-point CSV / Markdown / plot (Pareto frontier) and the
  recommendation line.

The measurement harness of the project's own benchmarks (kernel tables, the one-compile decode benchmark, the
4-bit parts, ...) is not part of the library: it lives in ``benchmarks/harness/`` and imports countdown.
"""
