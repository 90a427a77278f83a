"""The quality sweep: every method x mode x k on lm-eval tasks, perplexity and agreement, resumable.

One *cell* is one measurement unit: (method, mode, k) on one lm-eval task, one perplexity style
(``ppl_all``: every position sparse; ``ppl_decode``: each window's first half a dense prompt, loss on
the sparse second half) or the agreement metrics with the dense model. Dense is one configuration
(no mode, no k). A method is named by a spec, ``mono`` or ``dual[lowrank]`` (an SP-Prac kind).

The package, one concept per module:

* :mod:`.cells`: method specs (:mod:`countdown.spec`) as CSV labels, configurations, cells and their keys;
* :mod:`.measure`: measuring cells; all configurations of an lm-eval task share each prompt's dense
  pass (:mod:`countdown.eval.shared_prompt`);
* :mod:`.runner`: :func:`run_sweep`, resuming and Ctrl-C;
* :mod:`.store`: the files, merged under a lock and replaced atomically (:mod:`countdown.io`);
* :mod:`.tables`, :mod:`.stats`, :mod:`.orderings`, :mod:`.report`: scores, standard errors, paired
  tests, the paper's orderings, the Markdown report and plots;
* :mod:`.command`: ``countdown sweep``'s arguments.

Files in ``out_dir``: ``<model>.csv`` (one row per (cell, metric), columns :data:`CSV_FIELDS`; a cell
is known by ``(model, method, mode, sparsity, task, setting, artifacts)``), ``<model>.docs.csv``
(per-document scores of the lm-eval cells, for paired tests), ``<model>.meta.json``, ``<model>.md``
and ``<model>.png``. See docs/sweep.md.
"""

from .cells import (AGREEMENT_METRICS, AGREEMENT_TASK, CSV_FIELDS, DEFAULT_METHODS, DEFAULT_MODES,
                    DEFAULT_SPARSITIES, DEFAULT_TASKS, KEY_FIELDS, MODE_LABEL, MODES, PPL_TASKS, CellSpec,
                    column_label, format_k, model_label, parse_methods, plan_cells, row_key)
from .command import add_arguments, split_list, sweep_from_args
from .orderings import TARGET_K, orderings, orderings_markdown
from .report import agreement_markdown, plot_scores, write_report
from .runner import default_threads, device_description, run_sweep, select_rows, task_splits
from .stats import PairedTests, paired_bootstrap, stderr
from .store import SweepStore, merge, read_rows, write_rows_atomic
from .tables import (SCORE_PREFERENCE, TABLE_ORDER, average_scores, average_stderr, mean_sparsity_real,
                     metric_values, score_metric, table1_markdown, task_scores)

__all__ = [name for name in dir() if not name.startswith("_")]
