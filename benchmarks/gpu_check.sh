#!/usr/bin/env bash
# GPU check, run on a lent GPU machine (its own python3 with torch, transformers, scipy, rich):
#   bash benchmarks/gpu_check.sh [SRC]   (SRC: where memfit's src/ is; default: this checkout)
# Writes into $OUT (or .): gpu_cli_check.json (the command line on CUDA end to end: profile, plan --measure, fit,
# verify, explain and train with --device cuda, the measured choice on by default, the estimate's old --device
# spelling), measured_choice_gpt2.json and measured_choice_llama.json (the measured choice at three budgets on the
# real shapes of `make bench-real-shapes`, bf16: the solver's plan, its next-best and the fixed policies timed in
# paired rounds), gpu_check.json (prediction accuracy on a small model and the long-sequence case: host-held
# inputs and tiled MLPs in a plan, verified), allocator_check.json (the caching-allocator model against
# max_memory_allocated / max_memory_reserved), allocator_reserved_budget.json (a plan for a budget meaning
# reserved memory, as `memfit plan` makes it on CUDA, run: max_memory_reserved within it), host_states.json
# (model states on the host: equality with plain training, device peak, step time).
# Budget: 8 minutes in all (75 + 90 + 70 + 90 + 45 + 45 + 60 = 475 s); each part has its own limit so that a slow
# one cannot take the others' time. The small models' frontier, the real shapes' frontier and expandable segments
# ran on an H200 on 2026-12-04 (benchmarks/results/gpu_check*_2026-12-04.json) and are left out to fit the budget.
set -uo pipefail
cd "$(dirname "$0")/.."
SRC=${1:-src}
OUTDIR=${OUT:-.}
GPT2_SMALL='hf:gpt2?n_layer=12&n_embd=768&n_head=12&vocab_size=50257&n_positions=1024&seq_len=512'
LLAMA_1024='hf:llama?num_hidden_layers=8&hidden_size=1024&num_attention_heads=16&num_key_value_heads=8&intermediate_size=2816&vocab_size=32000&max_position_embeddings=2048&seq_len=1024'
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
# The project is tested with the transformers its pyproject pins; a machine with another one can be given that
# wheel in .whl/ (pure Python; `pip download --no-deps transformers==X -d .whl`): it is installed beside, not over.
if compgen -G ".whl/transformers-*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/memfit-site \
        .whl/transformers-*.whl && export PYTHONPATH="/tmp/memfit-site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$SRC${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python3 -c "import torch, transformers, memfit; print('torch', torch.__version__, 'transformers', transformers.__version__, 'cuda', torch.cuda.is_available())" || exit 1
rc=0
timeout 75 python3 benchmarks/gpu_cli_check.py --out "$OUTDIR/gpu_cli_check.json" || rc=1
timeout 90 python3 benchmarks/measured_choice.py --model "${GPT2_SMALL%&seq_len=512}" --seq-len 512 --batch-size 4 \
    --device cuda --dtype bfloat16 --rounds 5 --confirm-rounds 5 --out "$OUTDIR/measured_choice_gpt2.json" || rc=1
timeout 70 python3 benchmarks/measured_choice.py --model "${LLAMA_1024%&seq_len=1024}" --seq-len 1024 --batch-size 4 \
    --device cuda --dtype bfloat16 --rounds 5 --confirm-rounds 5 --out "$OUTDIR/measured_choice_llama.json" || rc=1
timeout 90 python3 benchmarks/gpu_check.py --out "$OUTDIR/gpu_check.json" --models demo --budgets 3 --rounds 5 || rc=1
timeout 45 python3 benchmarks/allocator_check.py --out "$OUTDIR/allocator_check.json" || rc=1
timeout 45 python3 benchmarks/allocator_check.py --reserved-budget --models demo hf:gpt2 \
    --out "$OUTDIR/allocator_reserved_budget.json" || rc=1
timeout 60 python3 benchmarks/host_states_check.py --out "$OUTDIR/host_states.json" || rc=1
exit $rc
