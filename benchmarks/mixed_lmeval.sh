#!/bin/sh
# lm-eval's eight tasks at 500 documents: dense, dense 4-bit MLPs (G = 64) and dual[mixed] at k = 0.9, one model
# after the other, on the CPU with one torch thread (issue 58, item 4; results/mixed/lmeval/README.md).
# Resumable: a rerun skips every cell already in results/mixed/lmeval/<model>.csv.
#   sh benchmarks/mixed_lmeval.sh [MODEL ...]        (default: the three models; COUNTDOWN=path/to/countdown)
# Each model's log goes to lmeval_<model>.log in the repository root.
set -e
cd "$(dirname "$0")/.."
COUNTDOWN=${COUNTDOWN:-countdown}
[ $# -gt 0 ] || set -- smollm2-135m gemma3-270m qwen2.5-coder-0.5b
for MODEL in "$@"; do
    PYTHONPATH=src "$COUNTDOWN" sweep --model "$MODEL" --methods 'dense,dense@mlp4g64,dual[mixed]' --modes prac \
        --sparsity 0.9 --tasks arc_easy,arc_challenge,hellaswag,piqa,winogrande,openbookqa,boolq,lambada_openai \
        --limit 500 --ppl-tokens 0 --agreement-prompts 0 --threads 1 \
        --artifacts-dir "${ARTIFACTS_DIR:-$HOME/.cache/countdown/artifacts-mixed}" --out results/mixed/lmeval \
        >> "lmeval_$MODEL.log" 2>&1
done
