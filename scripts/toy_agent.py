"""A toy agentic task that learns on a CPU (issue 38, check 1): SFT teaches a tiny model the
tool-call format, then GRPO with an environment teaches it to use the tool.

Each prompt asks what is in a vault. Only the environment knows (Vault below, in TRL's
environment_factory shape: one instance per rollout, reset(**row), its method `vault` the tool):
its number (#000-#999) comes from the row, which the prompt does not show; a model that does not
open the vault cannot know it. The reward checks the final answer
(trainloop.objectives.rewards:exact_answer against the row's `answer`).

1. SFT (`data=chat`, 400 steps): vault conversations in which the assistant opens the vault and
   copies the number into its answer (--call-share of them) or says at once that it does not
   know (the rest), and four times as many short ones in which the user writes a number and the
   assistant repeats it, laid out as a tool's reply and the answer after it are (the same
   distance between the two). Packed many to a row, they teach the copy: the vault conversations
   alone did not in 400 steps, nor did "Say #417." rows on every seed. The model learns the call
   format and the copy (40 of 40 new numbers copied after a call, seeds 0 and 1) and calls the
   tool in about --call-share of its answers.
2. GRPO (`objective=grpo objective.environment=scripts/toy_agent.py:Vault`, 30 steps, lr 3e-4
   after 10 warm-up steps) on numbers no SFT row held: an answer after a call is right, one
   without is not, so the group's advantages reward calling. The mean reward of the first 5
   steps is about the call share; it must reach at least 0.5 over the last 5 steps, above the
   first 5's, or the script exits 1. Measured (BENCHMARKS.md): 0.29 -> 0.97 on 1 process, 0.28
   -> 0.96 on 2; greedy eval_reward 1.0 on both.

    python scripts/toy_agent.py                     # 1 process: about 7 minutes on 2 cores
    python scripts/toy_agent.py --nproc 2           # GRPO under DDP (torchrun), 2 processes
    python scripts/toy_agent.py --out /tmp/agent    # keep the runs (metrics.jsonl, final/)
    python scripts/toy_agent.py --out /tmp/agent --keep-sft --nproc 2  # GRPO again on that SFT model
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve()
QUESTION = "What is in the vault?"
DONT_KNOW = "I do not know."
MODEL = ["model.num_layers=2", "model.hidden_size=128", "model.num_heads=4"]


class Vault:
    """The environment: a rollout's vault holds its row's number, which only `vault` tells."""

    def reset(self, answer, **row) -> None:
        self.number = str(answer)

    def vault(self) -> str:
        """The number in the vault."""
        return self.number


def conversation(number: str, call: bool) -> dict:
    """A SFT row: the assistant opens the vault and answers its number, or says at once that it does not know."""
    schema = {"type": "function", "function": {"name": "vault", "description": "The number in the vault.",
                                               "parameters": {"type": "object", "properties": {}},
                                               "return": {"type": "string"}}}
    messages = [{"role": "user", "content": QUESTION}]
    if call:
        messages += [{"role": "assistant", "content": None,
                      "tool_calls": [{"type": "function", "function": {"name": "vault", "arguments": {}}}]},
                     {"role": "tool", "name": "vault", "content": number},
                     {"role": "assistant", "content": number}]
    else:
        messages.append({"role": "assistant", "content": DONT_KNOW})
    return {"messages": messages, "tools": [schema]}


def write_data(folder: Path, sft_rows: int, prompts: int, call_share: float, seed: int) -> tuple[Path, Path]:
    """sft.jsonl (conversations) and prompts.jsonl (questions with an `answer` no SFT row held). Beside the
    vault conversations, four times as many short ones in which the user writes a number and the assistant
    repeats it: packed many to a row, they teach the copy in far fewer steps than the vault conversations
    alone, whose tools block makes each a row of its own."""
    rng = random.Random(seed)
    numbers = [f"#{n:03d}" for n in rng.sample(range(1000), 1000)]
    trained, held = numbers[:800], numbers[800:]
    rows = [conversation(rng.choice(trained), rng.random() < call_share) for _ in range(sft_rows)]
    rows += [{"messages": [{"role": "user", "content": number}, {"role": "assistant", "content": number}]}
             for number in (rng.choice(trained) for _ in range(4 * sft_rows))]
    rng.shuffle(rows)
    sft, task = folder / "sft.jsonl", folder / "prompts.jsonl"
    sft.write_text("".join(json.dumps(row) + "\n" for row in rows))
    task.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": QUESTION}], "answer": held[i % 200]})
                            + "\n" for i in range(prompts)))
    return sft, task


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(command: list[str], log: Path) -> None:
    print("$", " ".join(command), flush=True)
    with open(log, "w") as out:
        done = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if done.returncode:
        sys.exit(f"failed (exit {done.returncode}); its output: {log}\n" + log.read_text()[-3000:])


def rewards(run_dir: Path) -> list[float]:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["reward"] for r in lines if "reward" in r and r.get("event") is None]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=1, help="GRPO's processes (2: DDP under torchrun)")
    parser.add_argument("--sft-steps", type=int, default=400)
    parser.add_argument("--grpo-steps", type=int, default=30)
    parser.add_argument("--call-share", type=float, default=0.3, help="vault conversations that call the tool")
    parser.add_argument("--lr", type=float, default=3e-4, help="GRPO's learning rate")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep-sft", action="store_true", help="reuse --out's SFT model where there is one")
    parser.add_argument("--out", type=Path, default=None, help="keep the runs here (default: a temporary folder)")
    args = parser.parse_args()
    folder = args.out or Path(tempfile.mkdtemp(prefix="toy_agent_"))
    folder.mkdir(parents=True, exist_ok=True)
    sft, task = write_data(folder, 2000, 512, args.call_share, args.seed)
    python = [sys.executable, "-m", "trainloop"]
    if not (args.keep_sft and (folder / "sft" / "final").is_dir()):
        run([*python, *MODEL, "data=chat", f"data.path={sft}", "data.seq_len=384", "data.batch_size=16",
             "data.validation_fraction=0.05", f"trainer.max_steps={args.sft_steps}", "trainer.log_every=50",
             "trainer.eval_every=100", "optimizer.lr=3e-3", "scheduler=cosine", "scheduler.warmup_steps=20",
             f"trainer.seed={args.seed}", f"hydra.run.dir={folder / 'sft'}"], folder / "sft.log")
    launcher = python if args.nproc == 1 else [
        "torchrun", "--nproc_per_node", str(args.nproc), "--master_addr", "127.0.0.1",
        "--master_port", str(free_port()), "-m", "trainloop"]
    batch = 8 // args.nproc  # prompts a step, on every process together: 8 x num_generations completions
    run([*launcher, "model=hf", f"model.name_or_path={folder / 'sft' / 'final'}", "data=prompts",
         f"data.path={task}", "data.seq_len=300", f"data.batch_size={batch}", "data.validation_fraction=0.05",
         "objective=grpo", "objective.rewards=[trainloop.objectives.rewards:exact_answer]",
         f"objective.environment={HERE}:Vault", "objective.num_generations=8", "objective.max_new_tokens=96",
         "objective.max_tool_calls=1", f"optimizer.lr={args.lr}", "scheduler=constant", "scheduler.warmup_steps=10",
         f"trainer.max_steps={args.grpo_steps}", "trainer.log_every=1", f"trainer.eval_every={args.grpo_steps}",
         f"trainer.seed={args.seed}",
         "checkpoint.save_final_model=false", f"hydra.run.dir={folder / 'grpo'}"], folder / "grpo.log")
    values = rewards(folder / "grpo")
    first, last = statistics.mean(values[:5]), statistics.mean(values[-5:])
    print(f"GRPO on {args.nproc} process(es), {len(values)} steps: mean reward {first:.3f} over the first 5 steps, "
          f"{last:.3f} over the last 5")
    print("rewards by step:", " ".join(f"{v:.2f}" for v in values))
    if not (last >= 0.5 and last > first):
        sys.exit("the task did not learn: the last 5 steps' mean reward must be at least 0.5 and above the first 5's")


if __name__ == "__main__":
    main()
