"""Moves change no numbers: record what a fixed set of runs logs, then compare two records bitwise.

    python scripts/same_numbers.py record before.json      # on the commit before a move (a clean clone of it)
    python scripts/same_numbers.py record after.json       # on the commit after
    python scripts/same_numbers.py compare before.json after.json

Each run is trainloop's command line as a user types it (torchrun for 2 processes), 10 steps, CPU: the default
run, ZeRO-3 and FSDP2 on 2 processes, tensor, pipeline and context parallelism on 2, DPO with LoRA, GRPO. A record
holds every loss, gradient norm and evaluation value of metrics.jsonl by step; compare exits 1, naming the
first value that differs, unless every run logged the same numbers, bit for bit (issue 59, acceptance check 4).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "tests" / "data"
STEPS = ["trainer.max_steps=10", "trainer.log_every=1", "trainer.eval_every=10", "trainer.eval_batches=1",
         "logging.progress_bar=false"]
SMOKE = ["+preset=smoke", *STEPS]
RUNS = {  # name: (processes, overrides)
    "default": (1, STEPS),
    "zero3 2": (2, ["+preset=[smoke,zero3]", *STEPS]),
    "fsdp 2": (2, ["+preset=[fsdp,smoke]", *STEPS]),
    "tp 2": (2, ["+preset=[smoke,tp]", *STEPS]),
    "pp 2": (2, [*SMOKE, "model.tie_embeddings=false", "model.num_layers=4", "parallel.pp_size=2",
                 "trainer.gradient_accumulation_steps=2"]),
    "cp 2": (2, [*SMOKE, "parallel.cp_size=2"]),
    "dpo lora": (1, ["+preset=[smoke,lora]", *STEPS, "data=preference", "objective=dpo",
                     f"data.path={DATA / 'preference.jsonl'}"]),
    "grpo": (1, [*SMOKE, "data=prompts", "objective=grpo", f"data.path={DATA / 'prompts.jsonl'}",
                 f"objective.rewards=[{DATA / 'grpo_rewards.py'}:letters]", "objective.num_generations=4",
                 "objective.max_new_tokens=6"]),
}
NUMBERS = ("loss", "grad_norm", "eval_loss", "reward", "kl", "rewards/margin", "rewards/accuracy", "eval_reward")


def run(name: str, processes: int, overrides: list[str], port: int) -> list:
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        launcher = ([sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={processes}",
                     f"--master-port={port}"] if processes > 1 else [sys.executable])
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
        done = subprocess.run([*launcher, "-m", "trainloop", *overrides, f"hydra.run.dir={run_dir}"], cwd=REPO,
                              env=env, capture_output=True, text=True)
        if done.returncode:
            sys.exit(f"{name}: exit {done.returncode}\n{done.stderr[-3000:]}")
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [[r["step"], key, r[key]] for r in rows for key in NUMBERS if isinstance(r.get(key), float)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    record = sub.add_parser("record", help="run every case and write what it logged")
    record.add_argument("out", type=Path)
    record.add_argument("--only", nargs="*", choices=list(RUNS), help="these runs alone")
    record.add_argument("--master-port", type=int, default=29731)
    compare = sub.add_parser("compare", help="exit 1 unless two records are equal, bit for bit")
    compare.add_argument("before", type=Path)
    compare.add_argument("after", type=Path)
    args = parser.parse_args(argv)
    if args.command == "record":
        names = args.only or list(RUNS)
        numbers = {name: run(name, *RUNS[name], args.master_port) for name in names}
        args.out.write_text(json.dumps(numbers, indent=1))
        for name, logged in numbers.items():
            print(f"{name}: {len(logged)} values, last loss {[v for _, k, v in logged if k == 'loss'][-1]!r}")
        return 0
    before, after = json.loads(args.before.read_text()), json.loads(args.after.read_text())
    differ = 0
    for name in before:
        if name not in after:
            print(f"{name}: not in {args.after}")
            differ = 1
            continue
        a, b = before[name], after[name]
        first = next((f"step {x[0]} {x[1]}: {x[2]!r} then {y[2]!r}" for x, y in zip(a, b) if x != y), None)
        if first is None and len(a) != len(b):
            first = f"{len(a)} values then {len(b)}"
        print(f"{name}: " + ("the same, bit for bit" if first is None else first) + f" ({len(a)} values)")
        differ |= first is not None
    return differ


if __name__ == "__main__":
    sys.exit(main())
