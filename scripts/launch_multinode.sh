#!/usr/bin/env bash
# Start trainloop's processes on THIS node of a multi-node job; run it once on every node.
#
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=head-node scripts/launch_multinode.sh +preset=zero3 hydra.run.dir=runs/a
#   NNODES=2 NODE_RANK=1 MASTER_ADDR=head-node scripts/launch_multinode.sh +preset=zero3 hydra.run.dir=runs/a
#
# Under SLURM (scripts/slurm.sbatch) the node count, this node's rank and the head node come from
# SLURM_*. Arguments are trainloop's overrides. Give every node the same hydra.run.dir on a file
# system all nodes see: checkpoints are written there by every rank.
#   NNODES          nodes in the job                         (SLURM_NNODES, else 1)
#   NODE_RANK       this node, 0 .. NNODES-1                 (SLURM_NODEID, else 0)
#   NPROC_PER_NODE  processes on this node: GPUs, or 1 on CPU (all visible GPUs, else 1)
#   MASTER_ADDR     address of node 0, reachable from all    (first host of SLURM_JOB_NODELIST)
#   MASTER_PORT     a free TCP port on node 0                (29500)
#   LAUNCHER        torchrun or accelerate                   (torchrun)
#   PYTHON          the interpreter with trainloop installed (python)
set -euo pipefail

NNODES=${NNODES:-${SLURM_NNODES:-1}}
NODE_RANK=${NODE_RANK:-${SLURM_NODEID:-0}}
if [ -z "${MASTER_ADDR:-}" ]; then
  if [ -n "${SLURM_JOB_NODELIST:-}" ]; then
    MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
  else
    MASTER_ADDR=127.0.0.1
  fi
fi
MASTER_PORT=${MASTER_PORT:-29500}
PYTHON=${PYTHON:-python}
if [ -z "${NPROC_PER_NODE:-}" ]; then
  NPROC_PER_NODE=$("$PYTHON" -c "import torch; print(max(torch.cuda.device_count(), 1))")
fi
LAUNCHER=${LAUNCHER:-torchrun}

echo "node $NODE_RANK of $NNODES: $NPROC_PER_NODE process(es), rendezvous at $MASTER_ADDR:$MASTER_PORT ($LAUNCHER)" >&2
case "$LAUNCHER" in
  torchrun)
    exec "$PYTHON" -m torch.distributed.run --nnodes "$NNODES" --node_rank "$NODE_RANK" \
      --nproc_per_node "$NPROC_PER_NODE" --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT" \
      -m trainloop "$@" ;;
  accelerate)
    # --multi_gpu also on CPU: without it accelerate starts one process (trainloop picks gloo itself)
    exec "$PYTHON" -m accelerate.commands.launch --multi_gpu --num_machines "$NNODES" \
      --machine_rank "$NODE_RANK" --num_processes $((NNODES * NPROC_PER_NODE)) \
      --main_process_ip "$MASTER_ADDR" --main_process_port "$MASTER_PORT" \
      -m trainloop "$@" ;;
  *)
    echo "LAUNCHER=$LAUNCHER: use torchrun or accelerate" >&2; exit 2 ;;
esac
