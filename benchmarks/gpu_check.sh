#!/usr/bin/env bash
# GPU check, run on a lent GPU machine (its own python3 with torch, transformers, scipy, rich):
#   bash benchmarks/gpu_check.sh [SRC]   (SRC: where memfit's src/ is; default: this checkout)
# Writes $OUT/gpu_check.json (or ./gpu_check.json) and prints a table. Budget: under 8 minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
SRC=${1:-src}
OUTDIR=${OUT:-.}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
export PYTHONPATH="$SRC${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
timeout 420 python3 benchmarks/gpu_check.py --out "$OUTDIR/gpu_check.json" --models hf:gpt2 hf:llama demo --budgets 3 --rounds 5
