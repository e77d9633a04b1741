"""Every objective on every layout, run: 10 steps of each cell against one process, within 1e-5.

    python scripts/matrix.py                                  # the whole table (14 minutes on 2 idle cores)
    python scripts/matrix.py --objectives dpo grpo --layouts "FSDP2 x TP" pipeline

A cell is trainloop's command line under torchrun on the layout's processes (2; HSDP's 2 x 2: 4), at the same
global batch (4) as one process, on the objective's own data. It passes when every number it logs to metrics.jsonl (each loss,
gradient norm, objective metric and evaluation value; not the clock's: MEASURED) equals the one-process
run's within 1e-5, relative or absolute, at the same steps and keys; a cell the config refuses prints the
refusal, which names the reason (docs/config-reference.md's table lists the same). Exit 1 if a cell that runs
differs or fails (issue 59, acceptance check 1). tests/test_matrix.py runs some cells on warm ranks.
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
STEPS = ["+preset=smoke", "trainer.max_steps=10", "trainer.log_every=1", "trainer.eval_every=10",
         "trainer.eval_batches=1", "logging.progress_bar=false", "checkpoint.save_final_model=false"]
BATCH = 4  # the global batch of every cell and of the one process
TEACHER = "{teacher}"  # objective=distill's teacher: made once per invocation (write_teacher)
# objective: what it trains on, on top of STEPS
OBJECTIVES = {
    "causal_lm": [],
    "chat": ["data=chat", f"data.path={DATA / 'chat.jsonl'}"],
    # a full fine-tune, so that the frozen copy is placed by the layout; at the default 1e-3: at 1e-2 every weight
    # moves so far in 7 steps that the ~1e-6 relative rounding of a summed log-probability near -100 shows in
    # beta x its difference from the reference's (rewards/*, about 0.7) as 1.2e-5 on DDP (largest 7e-7 at 1e-3)
    "dpo": ["objective=dpo", "data=preference", f"data.path={DATA / 'preference.jsonl'}"],
    "simpo": ["objective=simpo", "data=preference", f"data.path={DATA / 'preference.jsonl'}"],
    "orpo": ["objective=orpo", "data=preference", f"data.path={DATA / 'preference.jsonl'}"],
    # TRL RewardConfig's learning rate: at the smoke preset's 1e-3 the tiny scorer's gradient norm swings
    # 1 -> 19 -> 3 -> 20 in 10 steps, which grows fp32 rounding (a tp all-reduce's order) past 1e-5 by step 7
    "reward": ["objective=reward", "data=preference", f"data.path={DATA / 'preference.jsonl'}", "optimizer.lr=1e-4"],
    "kto": ["objective=kto", "data=unpaired", f"data.path={DATA / 'unpaired.jsonl'}", "adapter=lora",
            "optimizer.lr=1e-2"],
    "grpo": ["objective=grpo", "data=prompts", f"data.path={DATA / 'prompts.jsonl'}", "optimizer.lr=1e-2",
             f"objective.rewards=[{DATA / 'grpo_rewards.py'}:letters]", "objective.num_generations=4",
             "objective.max_new_tokens=6", "data.validation_fraction=0.2"],
    "distill": ["objective=distill", f"objective.teacher={TEACHER}"],
}
# layout: (processes, its overrides, each data-parallel rank's batch, what the one process changes with it)
LAYOUTS = {
    "DDP": (2, [], 2, []),
    "ZeRO-3": (2, ["deepspeed=zero3"], 2, []),
    "FSDP2": (2, ["fsdp=full_shard"], 2, []),
    "HSDP": (4, ["fsdp=full_shard", "parallel.dp_replicate=2"], 1, []),
    "FSDP2 x TP": (2, ["fsdp=full_shard", "parallel.tp_size=2"], 4, []),
    # one process at the pipeline's micro-batches (kto's KL estimate is a micro-batch's, over every rank)
    "pipeline": (2, ["parallel.pp_size=2", "trainer.gradient_accumulation_steps=2"], 2,
                 ["model.tie_embeddings=false", "trainer.gradient_accumulation_steps=2"]),
    "context parallel": (2, ["parallel.cp_size=2"], 4, []),
}
MEASURED = {"time", "tokens_per_s", "tflops", "mfu", "data_wait_frac", "rss_bytes", "generation_s",
            "generated_tokens_per_s", "world_size"}  # what the clock or the machine says, not the computation
TOLERANCE = 1e-5


def with_objective(objective: str, teacher: str) -> list[str]:
    """The objective's overrides, objective=distill's teacher at `teacher` (a write_teacher directory)."""
    return [o.replace(TEACHER, teacher) for o in OBJECTIVES[objective]]


def one_process(objective: str, layout: str, teacher: str) -> list[str]:
    """The one-process run a cell is compared with: the objective's, at the global batch BATCH, with the model and
    the micro-batches the layout needs."""
    same = LAYOUTS[layout][3]
    accumulation = next((int(o.split("=")[1]) for o in same if o.startswith("trainer.gradient_accumulation_steps=")), 1)
    return [*STEPS, *with_objective(objective, teacher), *same, f"data.batch_size={BATCH // accumulation}"]


def cell(objective: str, layout: str, teacher: str) -> tuple[int, list[str]]:
    """(processes, overrides) of the layout's run of the objective."""
    processes, overrides, batch, model = LAYOUTS[layout]
    return processes, [*STEPS, *with_objective(objective, teacher), *model,
                       *overrides, f"data.batch_size={batch}"]


def numbers(run_dir: Path) -> list[tuple]:
    """(line, step, key, value) of every number metrics.jsonl holds but the MEASURED ones, in order."""
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return [(i, r.get("step"), key, value) for i, r in enumerate(rows) for key, value in r.items()
            if key not in MEASURED and isinstance(value, (int, float)) and not isinstance(value, bool)]


def difference(got: list[tuple], want: list[tuple], tolerance: float = TOLERANCE) -> tuple[str | None, float]:
    """(the first value outside `tolerance`, relative or absolute, or the first key or step that differs, or
    None; the largest relative difference) of two runs' numbers."""
    if [x[:3] for x in got] != [x[:3] for x in want]:
        first = next((f"line {x[0]}: {x[1:3]} against {y[1:3]}" for x, y in zip(got, want) if x[:3] != y[:3]),
                     f"{len(got)} numbers against {len(want)}")
        return f"logged other keys or steps ({first})", float("inf")
    worst, first = 0.0, None
    for (_, step, key, x), (_, _, _, y) in zip(got, want):
        off = abs(x - y)
        worst = max(worst, off / max(abs(y), 1.0))
        if off > tolerance * max(abs(y), 1.0) and first is None:
            first = f"step {step} {key}: {x!r} against {y!r}"
    return first, worst


def refusal(overrides: list[str]) -> str | None:
    """What validate refuses in this config, in its own words, or None."""
    from trainloop.config.compose import ConfigError, compose_config

    try:
        compose_config(overrides)
    except ConfigError as refused:
        return str(refused)
    return None


def write_teacher(path: Path) -> Path:
    """A random 4-layer Llama at the smoke preset's shape, with the built-in tokenizer (seed 0): objective=distill's."""
    import torch
    from transformers import AutoModelForCausalLM

    from trainloop.config.compose import compose_config
    from trainloop.data.tokenizer import byte_level_tokenizer
    from trainloop.model.builder import build_model_config

    cfg = compose_config(["+preset=smoke", "model.num_layers=4"], check=False)
    tokenizer = byte_level_tokenizer()
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(build_model_config(cfg.model, len(tokenizer)))
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def torchrun(processes: int, overrides: list[str], run_dir: Path, port: int) -> str | None:
    """trainloop's command line on `processes` processes (one: plain python); its output's end if it failed."""
    launcher = ([sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={processes}",
                 f"--master-port={port}"] if processes > 1 else [sys.executable])
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([*launcher, "-m", "trainloop", *overrides, f"hydra.run.dir={run_dir}"], cwd=REPO, env=env,
                          capture_output=True, text=True)
    return None if done.returncode == 0 else f"exit {done.returncode}: {done.stderr.strip()[-1500:]}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--objectives", nargs="*", choices=list(OBJECTIVES), default=list(OBJECTIVES))
    parser.add_argument("--layouts", nargs="*", choices=list(LAYOUTS), default=list(LAYOUTS))
    parser.add_argument("--master-port", type=int, default=29741)
    args = parser.parse_args(argv)
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        teacher = str(write_teacher(tmp / "teacher")) if "distill" in args.objectives else ""
        references: dict[tuple, list] = {}
        print(f"| objective | {' | '.join(args.layouts)} |\n|---" + "|---" * len(args.layouts) + "|", flush=True)
        for objective in args.objectives:
            cells = []
            for layout in args.layouts:
                processes, overrides = cell(objective, layout, teacher)
                if (said := refusal(overrides)) is not None:
                    cells.append("refused: " + "; ".join(line.strip() for line in said.splitlines()[1:] or [said]))
                    continue
                base = one_process(objective, layout, teacher)
                if tuple(base) not in references:
                    run_dir = tmp / f"one-{len(references)}"
                    error = torchrun(1, base, run_dir, args.master_port)
                    references[tuple(base)] = error or numbers(run_dir)
                want = references[tuple(base)]
                run_dir = tmp / f"{objective}-{layout.replace(' ', '_')}"
                error = (f"the one process: {want}" if isinstance(want, str) else
                         torchrun(processes, overrides, run_dir, args.master_port))
                first, worst = (error, 0.0) if error else difference(numbers(run_dir), want)
                cells.append(f"FAILED: {first}" if first else f"within 1e-5 (largest {worst:.0e})")
                failed |= first is not None
            print(f"| {objective} | " + " | ".join(cells) + " |", flush=True)
    return failed


if __name__ == "__main__":
    sys.exit(main())
