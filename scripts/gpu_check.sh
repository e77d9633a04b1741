#!/usr/bin/env bash
# Lent a GPU? One command runs every path only a GPU can show (bf16/fp16/tf32, fused and 8-bit
# AdamW, QLoRA 4-bit, flash attention, compile, FSDP2 and ZeRO-3 offload on one device, fp8,
# activation offload, the chunked loss's memory, bench.py --size gpt2's MFU, packed documents'
# attention against the dense mask, bench_methods.py) in
# 8 minutes, and writes one markdown report; its path is the last line printed. On a CPU
# it runs the tiny forms and names what it skipped and why. Options: scripts/gpu_check.py --help.
#   bash scripts/gpu_check.sh                 # report: gpu_check/gpu_check_report.md
#   bash scripts/gpu_check.sh --out /tmp/gc --only fp8 bf16
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1} TOKENIZERS_PARALLELISM=false
exec "$PYTHON" scripts/gpu_check.py "$@"
