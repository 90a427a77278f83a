"""Evaluation: perplexity, lm-eval tasks, agreement, the sweep over configurations, offline GPU scoring,
and the paper's appendix (cost model, indicator analysis)."""
