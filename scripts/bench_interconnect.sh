#!/usr/bin/env bash
# The HF guide's NVLink experiment with trainloop: the same short DDP run on 2 GPUs, once as is
# and once with NCCL_P2P_DISABLE=1 (NCCL may not use NVLink or PCIe peer-to-peer), then both
# training times and their ratio. The guide measured 101 s against 131 s (GPT-2, 200 steps, 2x
# TITAN RTX, NV2): ~23% faster with NVLink. Over PCIe host bridges (PHB/NODE/SYS) expect ~1.0.
#
#   scripts/bench_interconnect.sh [OVERRIDES...]     e.g. trainer.max_steps=100 data.batch_size=8
#   GPUS=2,3 scripts/bench_interconnect.sh           which two GPUs (default 0,1)
#
# The model is GPT-2 small's shape (12 x 768, 1024-token blocks, built from its config, no
# download) at micro-batch 4, as in the guide; your overrides come last and win.
set -euo pipefail

PYTHON=${PYTHON:-python}
GPUS=${GPUS:-0,1}
export CUDA_VISIBLE_DEVICES=$GPUS

visible=$("$PYTHON" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
if [ "$visible" -lt 2 ]; then
    echo "bench_interconnect: needs 2 GPUs, but torch sees $visible (CUDA_VISIBLE_DEVICES=$GPUS)." >&2
    echo "It compares DDP between two GPUs with and without NCCL peer-to-peer; run it on a multi-GPU machine." >&2
    exit 2
fi

out=$(mktemp -d "${TMPDIR:-/tmp}/bench_interconnect.XXXXXX")
echo "GPUs $GPUS; runs in $out"
nvidia-smi topo -m 2>/dev/null | sed -n '1,3p' || true

overrides=(model.arch=gpt2 model.num_layers=12 model.hidden_size=768 model.num_heads=12
           data.seq_len=1024 data.batch_size=4 trainer.max_steps=200 trainer.log_every=10
           trainer.eval_every=100000 checkpoint.save_final_model=false checkpoint.resume=null
           logging.progress_bar=false "$@")

# Training time: from the first logged step to the last (metrics.jsonl `time`), so start-up,
# data preparation and NCCL set-up, which differ little between the two runs, are left out.
train_seconds() {
    "$PYTHON" - "$1/metrics.jsonl" <<'EOF'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
steps = [r for r in rows if "loss" in r]
first, last = steps[0], steps[-1]
print(f"{last['time'] - first['time']:.2f} {last['step'] - first['step']}")
EOF
}

run() {  # $1: label, rest: environment assignments
    local label=$1 dir=$out/$1
    shift
    local start end
    start=$(date +%s.%N)
    env "$@" "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node 2 -m trainloop \
        "${overrides[@]}" hydra.run.dir="$dir" > "$dir.log" 2>&1 \
        || { echo "the $label run failed; see $dir.log" >&2; tail -20 "$dir.log" >&2; exit 1; }
    end=$(date +%s.%N)
    read -r seconds steps < <(train_seconds "$dir")
    wall=$("$PYTHON" -c "print(f'{$end - $start:.1f}')")
    echo "$label: $seconds s for $steps steps (wall $wall s)"
    eval "${label//-/_}_seconds=$seconds"
}

run p2p NCCL_P2P_DISABLE=0
run no-p2p NCCL_P2P_DISABLE=1
"$PYTHON" -c "print(f'ratio (NCCL_P2P_DISABLE=1 / with P2P): {$no_p2p_seconds / $p2p_seconds:.3f}')"
