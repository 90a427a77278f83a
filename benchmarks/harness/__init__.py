"""The measurement harness of ``benchmarks/*.py``: imports countdown, never imported by it.

The scripts run as ``PYTHONPATH=src python benchmarks/<script>.py`` (``benchmarks/`` is then on ``sys.path``, so
this package is ``harness``); the tests of this package (``tests/harness/``) find it the same way
(``tests/conftest.py``). What ``countdown bench`` runs is the library's (``countdown.bench``).

* :mod:`harness.timing`: device-to-device copy bandwidth, CUDA-graph timing over rotating weights
  (``time_graph``), peak memory, a wall-clock budget;
* :mod:`harness.weightbytes`: the weight bytes one decode step reads (the roofline) and a model holds;
* :mod:`harness.checks`: before timing, every decode harness against ``model.generate`` (and Dynamo's counts);
* :mod:`harness.runner`: the per-compile decode benchmark (dense + every spec x k x batch);
* :mod:`harness.slots`, :mod:`harness.onecompile`, :mod:`harness.rows`: the one-compile decode benchmark (every
  Gated-MLP behind an opaque op, the step compiled once, one CUDA graph per method, k switched in place; the MLP
  alone against its roofline);
* :mod:`harness.maskreplay`: masks recorded on real models replayed at a paper-scale shape;
* :mod:`harness.qualitygrid`: the resumable quality grid of the operating points;
  :mod:`harness.merge`: quality (real models) joined with speed (8B shape) per model;
* :mod:`harness.breakdown`: the dense step per operation, and the compiled step profiled;
* :mod:`harness.report`: decode.csv / .md / .png;
* :mod:`harness.mlpbench`: the Gated-MLP kernel-timing harness (random problems at real shapes) of
  ``benchmarks/mlp_kernels.py``, ``few.py`` and ``shadow.py``; :mod:`harness.kernelchecks`, :mod:`harness.kerneltable`:
  the kernel table's float64 checks and rows; :mod:`harness.sm90`: Triton kernels compiled for sm_90 without a GPU;
  :mod:`harness.launches`: the compiled kernel of each Triton launch (registers, spills);
* :mod:`harness.int4quality`, :mod:`harness.int4rows`, :mod:`harness.int4prefill`, :mod:`harness.int4profile`,
  :mod:`harness.int4bound`, :mod:`harness.int4report`: the parts of ``benchmarks/int4_quality.py`` and
  ``benchmarks/int4_decode.py``.
"""
