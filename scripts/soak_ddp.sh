#!/usr/bin/env bash
# Launch the same short 2-process DDP run (CPU, gloo) COUNT times in a row and count how many
# exit 0. A run that finished its work must exit 0 on every rank; a rare crash at teardown
# (a rank killed by SIGABRT after the final model was saved) shows up here as a failed launch.
#
#   scripts/soak_ddp.sh [COUNT] [OVERRIDES...]     e.g. scripts/soak_ddp.sh 20
#   PYTHON=/path/to/venv/bin/python scripts/soak_ddp.sh 20
#
# Each run gets a run dir of its own under a temporary folder; a failed run's log is kept
# (failed-N.log; PYTHONFAULTHANDLER=1 puts each thread's Python stack there on a crash) and its
# path printed. Exits 0 only if every run exited 0.
set -uo pipefail
cd "$(dirname "$0")/.."  # the repository root: `-m trainloop` is this checkout

COUNT=${1:-20}
shift || true
PYTHON=${PYTHON:-python}
TORCHRUN=${TORCHRUN:-$(dirname "$(command -v "$PYTHON")")/torchrun}
out=$(mktemp -d "${TMPDIR:-/tmp}/soak_ddp.XXXXXX")
echo "soak_ddp: $COUNT runs of 2-process DDP; run dirs and logs in $out"

free_port() { "$PYTHON" -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])"; }

passed=0
for i in $(seq 1 "$COUNT"); do
    started=$SECONDS
    OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} PYTHONFAULTHANDLER=1 "$TORCHRUN" --nproc_per_node 2 --master_addr 127.0.0.1 \
        --master_port "$(free_port)" -m trainloop +preset=smoke trainer.max_steps=10 trainer.eval_every=1000 \
        logging.progress_bar=false hydra.run.dir="$out/run-$i" "$@" >"$out/run-$i.log" 2>&1
    code=$?
    if [ "$code" -eq 0 ]; then
        passed=$((passed + 1))
        echo "run $i: exit 0 ($((SECONDS - started)) s)"
    else
        mv "$out/run-$i.log" "$out/failed-$i.log"
        echo "run $i: exit $code ($((SECONDS - started)) s), log: $out/failed-$i.log"
        grep -E "terminate called|Signal|exitcode|Error" "$out/failed-$i.log" | head -5 | sed 's/^/    /'
    fi
done
echo "soak_ddp: $passed of $COUNT runs exited 0"
[ "$passed" -eq "$COUNT" ]
