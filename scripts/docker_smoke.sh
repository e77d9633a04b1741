#!/usr/bin/env bash
# Build Dockerfile.ngc and smoke-test the image on a machine with Docker and NVIDIA GPUs
# (the NVIDIA Container Toolkit, so that `docker run --gpus all` works).
#
#   scripts/docker_smoke.sh                      # build trainloop:ngc, then test it
#   IMAGE=trainloop:dev scripts/docker_smoke.sh --build-arg CUDA_ARCHS=9.0
#   SKIP_BUILD=1 IMAGE=registry/trainloop:ngc scripts/docker_smoke.sh   # test a pushed image
#
# Arguments are passed to `docker build`. Every check prints what it does; the first failure
# stops the script with a non-zero exit.
set -euo pipefail
cd "$(dirname "$0")/.."

IMAGE=${IMAGE:-trainloop:ngc}
RUNS=$(mktemp -d)
trap 'rm -rf "$RUNS"' EXIT
chmod 777 "$RUNS"  # the image's user (uid 1000 by default) writes here

step() { printf '\n=== %s\n' "$*"; }
fail() { printf 'FAILED: %s\n' "$*" >&2; exit 1; }
in_image() {
    docker run --rm --gpus all --ipc=host --ulimit memlock=-1 --ulimit stack=67108864 \
        -e OMP_NUM_THREADS=1 -v "$RUNS:/workspace/runs" "$IMAGE" "$@"
}
bare() { docker run --rm --gpus all --entrypoint "" "$IMAGE" "$@"; }  # no NGC banner on stdout

if [ -z "${SKIP_BUILD:-}" ]; then
    step "docker build -f Dockerfile.ngc -t $IMAGE $*"
    docker build -f Dockerfile.ngc -t "$IMAGE" "$@" .
fi

step "torch is still the base image's own"
# image-pins.txt was written before anything was installed: its first line is the base's torch.
base_torch=$(bare head -1 /opt/trainloop/image-pins.txt)
image_torch=$(bare python -c "import importlib.metadata as m; print('torch==' + m.version('torch'))")
echo "base $base_torch, image $image_torch"
[ "$base_torch" = "$image_torch" ] || fail "the install replaced the image's torch"

step "runs as a non-root user, default command is python -m trainloop"
user=$(bare id -u)
[ "$user" != 0 ] || fail "the image runs as root"
cmd=$(docker inspect --format '{{json .Config.Cmd}}' "$IMAGE")
[ "$cmd" = '["python","-m","trainloop"]' ] || fail "CMD is $cmd"

step "GPUs visible, DeepSpeed ops prebuilt, bitsandbytes loads"
gpus=$(bare python -c 'import torch; assert torch.cuda.is_available(), "no GPU"; print(torch.cuda.device_count())')
echo "$gpus GPU(s)"
in_image ds_report
in_image python -c "
from deepspeed.git_version_info import installed_ops
missing = [op for op in ('cpu_adam', 'fused_adam', 'async_io') if not installed_ops.get(op)]
assert not missing, f'not prebuilt: {missing}'
from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
import torch
p = [torch.nn.Parameter(torch.zeros(8))]
DeepSpeedCPUAdam(p); FusedAdam([torch.nn.Parameter(torch.zeros(8, device='cuda'))])
import bitsandbytes as bnb
bnb.optim.AdamW8bit([torch.nn.Parameter(torch.zeros(4096, device='cuda'))])
print('ops load without compiling')"

SMOKE=(+preset=smoke trainer.max_steps=10 logging.progress_bar=false)

step "the default command trains (1 GPU, bf16)"
in_image python -m trainloop "${SMOKE[@]}" precision=bf16 hydra.run.dir=/workspace/runs/one
[ -f "$RUNS/one/final/config.json" ] || fail "no final model in the run dir"

step "bitsandbytes 8-bit AdamW"
in_image python -m trainloop "${SMOKE[@]}" optimizer=adamw8bit hydra.run.dir=/workspace/runs/bnb

step "DeepSpeed ZeRO-3 with CPU offload uses the prebuilt CPU Adam (no JIT build)"
log="$RUNS/zero3.log"
in_image python -m trainloop "${SMOKE[@]}" deepspeed=zero3 deepspeed.offload_optimizer=cpu \
    deepspeed.offload_param=cpu hydra.run.dir=/workspace/runs/zero3 2>&1 | tee "$log"
if grep -qiE 'building extension|ninja: ' "$log"; then fail "DeepSpeed compiled an op at run time"; fi

if [ "$gpus" -ge 2 ]; then
    step "2 GPUs: torchrun (DDP), accelerate launch (ZeRO-2)"
    in_image torchrun --nproc_per_node 2 -m trainloop "${SMOKE[@]}" hydra.run.dir=/workspace/runs/ddp
    grep -q '"world_size": 2' "$RUNS/ddp/metrics.jsonl" || fail "DDP run did not record world_size 2"
    in_image accelerate launch --multi_gpu --num_processes 2 -m trainloop "${SMOKE[@]}" \
        deepspeed=zero2 hydra.run.dir=/workspace/runs/zero2
else
    step "1 GPU: skipping the multi-GPU launches"
fi

step "report and sweep"
in_image python -m trainloop -m "${SMOKE[@]}" trainer.max_steps=5 optimizer=adamw,sgd \
    hydra.sweep.dir=/workspace/runs/sweep
in_image python -m trainloop.report /workspace/runs/one
[ -s "$RUNS/one/report.png" ] || fail "no report.png"

step "all checks passed for $IMAGE"
