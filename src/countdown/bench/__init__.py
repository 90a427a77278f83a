"""Benchmarks a user can run from the library: how fast is a configuration, and where the time goes.

* :mod:`~countdown.bench.timing`: device-to-device copy bandwidth, CUDA-graph timing over rotating
  weights (``time_graph``), peak memory, a wall-clock budget;
* method specs (``mono``, ``dual[lowrank]``, ``dual[shadow4]``, ``teal``) are :mod:`countdown.spec`'s;
* :mod:`~countdown.bench.measure`: decode tokens/s through ``countdown.generate_fast``, kept
  fractions, the weight bytes a decode step reads (roofline: :func:`countdown.eval.cost.mlp_weight_bytes`);
* :mod:`~countdown.bench.speedonly`: speed-only artifacts (random predictors, cuts fitted on the
  model's own decode steps) for random-weight shapes;
* :mod:`~countdown.bench.runner`: the per-compile decode benchmark (dense + every spec x k x batch);
* :mod:`~countdown.bench.slots`, :mod:`~countdown.bench.onecompile`, :mod:`~countdown.bench.rows`: the
  one-compile decode benchmark (every Gated-MLP behind an opaque op, the step compiled once, one CUDA
  graph per method, k switched in place; the MLP alone against its roofline);
* :mod:`~countdown.bench.maskreplay`: masks recorded on real models replayed at a paper-scale shape;
* :mod:`~countdown.bench.quality`, :mod:`~countdown.bench.qualitygrid`: decode-style perplexity, KL and
  top-1 against dense in one pass; the resumable quality grid of the operating points;
* :mod:`~countdown.bench.int4quality`: sparse rows on 4-bit weights for CPU quality studies (a 4-bit model's
  float twin, W_down rounded as a 4-bit W_down^T, MLP bytes per 4-bit layout);
* :mod:`~countdown.bench.merge`: quality (real models) joined with speed (8B shape) per model;
* :mod:`~countdown.bench.breakdown`: the dense step per operation, and the compiled step profiled;
* :mod:`~countdown.bench.report`: decode.csv / .md / .png;
* :mod:`~countdown.bench.mlpbench`: the Gated-MLP kernel-timing harness (random problems at real shapes,
  CUDA-graph timing over rotating weights) of ``benchmarks/kernels.py``, ``few.py`` and ``shadow.py``;
  :mod:`~countdown.bench.kernelchecks`, :mod:`~countdown.bench.kerneltable`: the kernel table's float64
  checks and rows; :mod:`~countdown.bench.sm90`: Triton kernels compiled for sm_90 without a GPU;
* :mod:`~countdown.bench.operating`, :mod:`~countdown.bench.cli`: ``countdown bench``, speed and quality
  on the user's own model, with a recommendation; :mod:`~countdown.bench.opreport`: the operating-point
  CSV / Markdown / plot (Pareto frontier) and the recommendation line.
"""

from ..eval.cost import mlp_weight_bytes
from .measure import kept_fractions, model_bytes, step_weight_bytes, time_decode
from ..spec import Spec, parse_spec, parse_specs
from .timing import Budget, PeakMemory, copy_bandwidth, free_memory, spread, time_graph

__all__ = [
    "Budget", "PeakMemory", "Spec", "copy_bandwidth", "free_memory", "kept_fractions",
    "mlp_weight_bytes", "model_bytes", "parse_spec", "parse_specs", "spread", "step_weight_bytes", "time_decode",
    "time_graph",
]
