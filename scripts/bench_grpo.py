"""objective=grpo against TRL's GRPOTrainer: completions per second and step time (issue 26, item 6).

The same tiny model (trainloop's tiny Llama, built from one seed, fp32), the same prompts, group
size, completion length, batch, optimizer and loss (dapo, beta 0, one iteration), generation by
Hugging Face `generate` in both (no vLLM), each variant in a fresh process of its own:
  trainloop  `python -m trainloop data=prompts objective=grpo ...`
  trl        trl.GRPOTrainer, a callback appending each step's wall-clock time
A step is: generate num_generations completions of each prompt, score them, one forward and
backward over them, the optimizer step. Its time is the gap between two steps' log lines; the
first --warmup steps are left out; the median over the rest. completions/s = completions a step /
the median step. Rounds alternate the two (trainloop, trl, trainloop, trl, ...): the machine's
speed drifts, so the paired ratio per round is printed as well as the ratio of the medians.

The reward is the share of lowercase letters in a completion: a random tiny model rarely writes
its end-of-text token, so both generate the full --max-new-tokens in every step.

    python scripts/bench_grpo.py                   # CPU: 2 rounds x 20 steps, about 4 minutes on 2 cores
    python scripts/bench_grpo.py --rounds 3 --json /tmp/grpo_bench.json

--generation compares the rollout engines alone (objective.generation, issue 38 item 5), in this
process on the same model and prompts: generated tokens/s of `generate` with its KV cache (as
objective=grpo runs it), of `generate` without one (as it ran before: the tiny model's config says
use_cache=false, so generate recomputed every prefix), and of `continuous` (transformers' continuous
batching), sampling as objective=grpo samples, each round running the three in turn from one seed;
the ratios are printed first.

    python scripts/bench_grpo.py --generation --rounds 5  # CPU: about a minute on 2 cores

--tools MODEL_DIR times multi-turn rollouts (issue 38, item 7): a model that calls tools (make one
with `python scripts/toy_agent.py --out DIR`: DIR/sft/final), chat prompts asking what is in a vault,
one tool `vault` (the same plain function in both: objective.tools, GRPOTrainer(tools=...)), one
round of calls (objective.max_tool_calls=1, max_tool_calling_iterations=1), the reward 1.0 where the
completion holds a tool reply. TRL parses the built-in template's turns with
trainloop.data.chat_template.BUILTIN_RESPONSE_TEMPLATE. Each line adds the tool calls a completion.

    python scripts/bench_grpo.py --tools /tmp/agent/sft/final --steps 6 --rounds 1  # CPU: about a minute
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MODEL = ["model.num_layers=4", "model.hidden_size=256", "model.num_heads=4"]
REWARD = '''def letters(prompts, completions, **columns):
    return [sum("a" <= ch <= "z" for ch in c) / len(c) if c else 0.0 for c in completions]
'''
WORDS = ("apple river stone cloud green quick seven maple lantern copper ocean violet amber birch coral delta "
         "ember frost grove harbor island jade kettle lemon meadow north olive pepper quartz raven").split()


TOOLS = '''def vault() -> str:
    """The number in the vault."""
    return "#417"


def opened(prompts, completions, **columns):
    return [float(any(m["role"] == "tool" for m in c)) for c in completions]
'''
QUESTION = [{"role": "user", "content": "What is in the vault?"}]


def write_task(folder: Path, tools: bool = False) -> tuple[Path, Path]:
    prompts = folder / "prompts.jsonl"
    rows = [{"prompt": QUESTION if tools else f"Write {w}:"} for w in WORDS]
    prompts.write_text("".join(json.dumps(row) + "\n" for row in rows))
    rewards = folder / "rewards.py"
    rewards.write_text(TOOLS if tools else REWARD)
    return prompts, rewards


def trainloop_command(args, folder: Path, prompts: Path, rewards: Path) -> list[str]:
    model, task = (["model=hf", f"model.name_or_path={args.tools}"], [
        f"objective.rewards=[{rewards}:opened]", f"objective.tools=[{rewards}:vault]", "objective.max_tool_calls=1",
        "data.seq_len=300"]) if args.tools else (MODEL, [f"objective.rewards=[{rewards}:letters]", "data.seq_len=16"])
    return [sys.executable, "-m", "trainloop", *model, "data=prompts", f"data.path={prompts}", *task,
            f"data.batch_size={args.prompts}", "data.validation_fraction=0.05", "objective=grpo",
            f"objective.num_generations={args.generations}",
            f"objective.max_new_tokens={args.max_new_tokens}", "objective.loss_type=dapo", "optimizer=adamw",
            "optimizer.lr=1e-5", "scheduler=constant", "trainer.seed=0", f"trainer.max_steps={args.steps}",
            "trainer.log_every=1", f"trainer.eval_every={args.steps * 10}", "trainer.eval_batches=1",
            "checkpoint.save_final_model=false", "logging.progress_bar=false", "logging.trackers=[]",
            f"hydra.run.dir={folder / 'trainloop'}"]


def trl_child(args, folder: Path) -> None:
    """The TRL variant, in this (child) process."""
    import datasets
    import torch
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from trainloop.config.compose import compose_config
    from trainloop.data.loaders import byte_level_tokenizer
    from trainloop.model.builder import build_model, build_model_config

    sys.path.insert(0, str(folder))
    import rewards  # noqa: E402 - the same file trainloop loads by its path

    if args.tools:  # the tool-calling model, read as trainloop's model=hf reads it
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from trainloop.data.chat_template import BUILTIN_RESPONSE_TEMPLATE

        tokenizer = AutoTokenizer.from_pretrained(args.tools)
        tokenizer.response_template = BUILTIN_RESPONSE_TEMPLATE  # TRL parses the model's turns with it
        model = AutoModelForCausalLM.from_pretrained(args.tools, dtype=torch.float32)
        task = {"reward_funcs": [rewards.opened], "tools": [rewards.vault]}
        rows = [{"prompt": QUESTION} for _ in WORDS]
    else:
        cfg = compose_config(MODEL, check=False)
        tokenizer = byte_level_tokenizer()
        torch.manual_seed(0)
        model = build_model(cfg.model, build_model_config(cfg.model, len(tokenizer)))
        task = {"reward_funcs": [rewards.letters]}
        rows = [{"prompt": f"Write {w}:"} for w in WORDS]
    steps_file = open(folder / "trl_steps.jsonl", "w")
    started = time.time()

    class StepTimes(TrainerCallback):
        def on_step_end(self, args_, state, control, **kwargs):
            steps_file.write(json.dumps({"step": state.global_step, "time": time.time() - started}) + "\n")
            steps_file.flush()

        def on_log(self, args_, state, control, logs=None, **kwargs):  # TRL's tools/call_frequency
            if logs and "tools/call_frequency" in logs:
                steps_file.write(json.dumps({"calls": logs["tools/call_frequency"]}) + "\n")

    config = GRPOConfig(output_dir=str(folder / "trl"), report_to=[], use_cpu=not torch.cuda.is_available(),
                        bf16=False, num_generations=args.generations, max_completion_length=args.max_new_tokens,
                        per_device_train_batch_size=args.prompts * args.generations, loss_type="dapo", beta=0.0,
                        learning_rate=1e-5, lr_scheduler_type="constant", max_steps=args.steps, logging_steps=1,
                        save_strategy="no", seed=0, top_k=0, disable_tqdm=True,
                        **({"max_tool_calling_iterations": 1} if args.tools else {}))
    trainer = GRPOTrainer(model=model, args=config, train_dataset=datasets.Dataset.from_list(rows),
                          processing_class=tokenizer, callbacks=[StepTimes()], **task)
    trainer.train()


def step_times(lines: list[dict], warmup: int) -> list[float]:
    """Each step's seconds: the gap between its log line and the previous one, after warm-up."""
    times = [r["time"] for r in lines]
    return [b - a for a, b in zip(times, times[1:])][warmup:]


def run_variant(name: str, args, folder: Path, prompts: Path, rewards: Path) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    if name == "trainloop":
        command = trainloop_command(args, folder, prompts, rewards)
        steps = folder / "trainloop" / "metrics.jsonl"
    else:
        command = [sys.executable, __file__, "--trl-child", str(folder), *sys.argv[1:],
                   *(["--tools", args.tools] if args.tools else [])]  # resolved: the child runs in `folder`
        steps = folder / "trl_steps.jsonl"
        from trainloop.__main__ import with_trainloops_malloc

        env = with_trainloops_malloc(env)  # jemalloc where `python -m trainloop` takes it: alike
    started = time.time()
    done = subprocess.run(command, env=env, cwd=folder, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{name} failed ({done.returncode}):\n{done.stderr[-4000:]}")
    every = [json.loads(line) for line in steps.read_text().splitlines()]
    lines = [r for r in every if ("loss" if name == "trainloop" else "step") in r]
    durations = step_times(lines, args.warmup)
    median = statistics.median(durations)
    calls = [r["tool_calls_per_completion" if name == "trainloop" else "calls"] for r in every
             if ("tool_calls_per_completion" if name == "trainloop" else "calls") in r]
    return {"variant": name, "median_step_s": median, "completions_per_s": args.prompts * args.generations / median,
            "steps_timed": len(durations), "wall_s": time.time() - started,
            **({"tool_calls_per_completion": statistics.mean(calls)} if calls else {})}


ENGINES = {"generate": ("generate", {"use_cache": True}), "generate_uncached": ("generate", {"use_cache": False}),
           "continuous": ("continuous", {})}


def generation_rates(args) -> list[dict]:
    """Each round: the three engines in turn on the bench's model and prompts, from one seed."""
    import torch

    from trainloop.config.compose import compose_config
    from trainloop.data.loaders import byte_level_tokenizer
    from trainloop.model.builder import build_model, build_model_config, special_token_ids
    from trainloop.objectives.generation import complete
    from trainloop.objectives.generation import completion_mask, generation_config

    cfg = compose_config(MODEL, check=False)
    tokenizer = byte_level_tokenizer()
    torch.manual_seed(0)
    model = build_model(cfg.model, build_model_config(cfg.model, len(tokenizer), special_token_ids(tokenizer))).eval()
    prompts = [tokenizer(f"Write {w}:")["input_ids"] for w in WORDS[:args.prompts]]
    width, eos = max(len(p) for p in prompts), tokenizer.eos_token_id
    prompt_ids = torch.full((len(prompts), width), eos).repeat_interleave(args.generations, 0)
    prompt_mask = torch.zeros_like(prompt_ids)
    for row in range(prompt_ids.shape[0]):
        ids = prompts[row // args.generations]
        prompt_ids[row, width - len(ids):], prompt_mask[row, width - len(ids):] = torch.tensor(ids), 1
    results = []
    for round_ in range(args.rounds + 1):  # round 0 warms up
        for name, (engine, extra) in ENGINES.items():
            # objective=grpo's sampling settings (GRPO.__init__)
            settings = generation_config(do_sample=True, temperature=1.0, top_p=1.0, top_k=0, pad_token_id=eos,
                                         eos_token_id=eos, max_new_tokens=args.max_new_tokens, **extra)
            with torch.no_grad(), torch.random.fork_rng():
                torch.manual_seed(round_)
                started = time.perf_counter()
                out = complete(model, prompt_ids, prompt_mask, settings, engine, synced_gpus=False)
                seconds = time.perf_counter() - started
            tokens = int(completion_mask(out[:, width:], eos).sum())
            if round_:
                results.append({"round": round_, "engine": name, "tokens": tokens, "seconds": seconds,
                                "tokens_per_s": tokens / seconds})
    return results


def report_generation(args, results: list[dict]) -> None:
    by = {name: [r for r in results if r["engine"] == name] for name in ENGINES}
    rate = {name: statistics.median(r["tokens_per_s"] for r in rs) for name, rs in by.items()}
    paired = {name: [c["tokens_per_s"] / r["tokens_per_s"] for c, r in zip(by["continuous"], rs)]
              for name, rs in by.items() if name != "continuous"}
    for name, ratios in paired.items():
        print(f"generated tokens/s continuous / {name}: x{rate['continuous'] / rate[name]:.2f} (ratio of medians); "
              f"paired per round {', '.join(f'x{p:.2f}' for p in ratios)}")
    for name, rs in by.items():
        print(f"{name:16s} {rate[name]:8.1f} tokens/s (median of {len(rs)} rounds; "
              f"{rs[0]['tokens']} tokens a round, {statistics.median(r['seconds'] for r in rs):.2f} s)")
    print(f"load average {os.getloadavg()[0]:.1f} at the end")
    if args.json:
        Path(args.json).write_text(json.dumps({"results": results, "tokens_per_s": rate, "paired": paired}, indent=1))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=4, help="prompts a step (data.batch_size)")
    parser.add_argument("--generations", type=int, default=8, help="completions a prompt")
    parser.add_argument("--max-new-tokens", type=int, default=None,
                        help="the completion's budget (default 32; 96 with --tools: a call, its reply, an answer)")
    parser.add_argument("--json", help="write the results here too")
    parser.add_argument("--generation", action="store_true",
                        help="compare the rollout engines' generated tokens/s alone (objective.generation)")
    parser.add_argument("--tools", metavar="MODEL_DIR",
                        help="multi-turn rollouts of this tool-calling model (scripts/toy_agent.py's sft/final)")
    parser.add_argument("--trl-child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.max_new_tokens = args.max_new_tokens or (96 if args.tools else 32)
    if args.tools:
        args.tools = str(Path(args.tools).resolve())  # the variants run in folders of their own
    if args.trl_child:
        trl_child(args, Path(args.trl_child))
        return 0
    import torch

    where = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU, {os.cpu_count()} cores"
    if args.generation:
        print(f"{where}; torch {torch.__version__}; {args.prompts} prompts x {args.generations} completions of "
              f"{args.max_new_tokens} tokens, sampled; {args.rounds} rounds (and one warm-up); "
              f"load average {os.getloadavg()[0]:.1f} at start", flush=True)
        report_generation(args, generation_rates(args))
        return 0
    print(f"{where}; torch {torch.__version__}; {args.prompts} prompts x {args.generations} completions of "
          f"{args.max_new_tokens} tokens a step{' (a tool call, its reply, an answer)' if args.tools else ''}, "
          f"{args.steps} steps ({args.warmup} warm-up), {args.rounds} rounds; "
          f"load average {os.getloadavg()[0]:.1f} at start")
    results = []
    for round_ in range(args.rounds):
        for name in ("trainloop", "trl"):
            with tempfile.TemporaryDirectory() as tmp:
                folder = Path(tmp)
                prompts, rewards = write_task(folder, tools=bool(args.tools))
                result = {"round": round_ + 1, **run_variant(name, args, folder, prompts, rewards)}
            results.append(result)
            print(f"round {result['round']}  {name:9s}  step {result['median_step_s']:.3f} s (median of "
                  f"{result['steps_timed']})  {result['completions_per_s']:7.1f} completions/s  "
                  + (f"{result['tool_calls_per_completion']:.2f} tool calls a completion  " if args.tools else "")
                  + f"(process {result['wall_s']:.0f} s)", flush=True)
    by = {name: [r for r in results if r["variant"] == name] for name in ("trainloop", "trl")}
    medians = {name: statistics.median(r["median_step_s"] for r in rs) for name, rs in by.items()}
    paired = [t["median_step_s"] / h["median_step_s"] for t, h in zip(by["trainloop"], by["trl"])]
    print(f"step time trainloop / trl: x{medians['trainloop'] / medians['trl']:.3f} (ratio of medians); "
          f"paired per round {', '.join(f'x{p:.3f}' for p in paired)}; "
          f"load average {os.getloadavg()[0]:.1f} at the end")
    if args.json:
        Path(args.json).write_text(json.dumps({"results": results, "medians": medians, "paired": paired}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
