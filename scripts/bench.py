"""Does trainloop cost anything over a raw PyTorch loop, and how does it compare with the HF Trainer?

Trains the same model on the same data with the same hyperparameters and batch three ways, each
run in a fresh process of its own, and each eager and compiled (--compile):
  raw        a minimal hand-written PyTorch loop (no accelerate, no Hydra); +compile: torch.compile(model)
  trainloop  `python -m trainloop` itself; +compile: compile=inductor
  hf         transformers.Trainer; +compile: TrainingArguments(torch_compile=True)
All log the loss every step (one host sync per step each), so the comparison is fair, and append
one line per optimizer step, flushed, with its wall-clock time. The first lines printed are the
ratios trainloop/raw (eager, and compiled), the question the script answers; then tokens/s and MFU.

The machine's own speed drifts by +-10% over 5-20 s windows, more than the differences to be
measured, so the three processes of a round share the machine in turns of a few seconds instead
of running one after another:
  1. each variant's process starts alone (the others stopped with SIGSTOP) and runs until it has
     logged its first optimizer step: "start to 1st step" (imports, data, model build, step 1);
     then it is stopped and the next one starts;
  2. then they take turns: SIGCONT one process for --turn seconds, SIGSTOP it, the next one, ...
     until each has done --steps steps and exited; every (continued, stopped) interval is kept.
     A turn is stretched to hold about 6 of the process's steps where they are slower than that
     (a loaded machine, a big model), so that every turn still times some whole steps.
A step is timed when the whole of it, from the previous step's end to its own, lies inside one
running interval of its process; the first --warmup steps and the first step that starts in each
turn (caches are cold after a switch) are left out. tokens/s of a run is its timed steps' tokens
over the sum of their durations. Per variant: the median over --rounds rounds. The ratios
trainloop/raw and trainloop/hf are printed as the ratio of the medians and, since the variants
of one round share its minutes, per round ("paired") with their median.
Peak memory: CPU, the process's peak RSS; GPU, torch.cuda.max_memory_allocated. On a GPU the
stopped process's queued kernels still run; the boundary steps that are left out cover that.

    python scripts/bench.py                          # CPU size, eager: 3 rounds x 80 steps, about 5 minutes on 2 cores
    python scripts/bench.py --size tiny              # 1 layer, 32 wide, 16 tokens a step: the loop's own cost, eager
                                                     # and compiled, 2000 steps a run
    python scripts/bench.py --size gpt2 --rounds 5   # +preset=gpt2_124m on a GPU (bf16), eager and compiled
"""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SIZES = {
    # model/data/optimizer overrides shared by all three variants (trainloop syntax)
    "cpu": ["model.num_layers=4", "model.hidden_size=256", "model.num_heads=4", "data.seq_len=128",
            "data.batch_size=8"],
    # where the host bounds the step (small models on any GPU): what the loop itself costs per step
    "tiny": ["model.num_layers=1", "model.hidden_size=32", "model.num_heads=2", "data.seq_len=16",
             "data.batch_size=1"],
    # +preset=gpt2_124m at its largest micro-batch, the same for all: no batch search, compile per variant
    "gpt2": ["+preset=gpt2_124m", "trainer.auto_batch_size=false", "compile=none"],
}
# data.packing=stream: the blocks a raw loop reads, one sequence a row, attended causally by all three
COMMON = ["optimizer=adamw", "optimizer.lr=1e-3", "scheduler=cosine", "trainer.max_grad_norm=1.0",
          "trainer.seed=0", "data.num_workers=0", "data.packing=stream"]
STEPS_FILE = {"raw": "steps.jsonl", "hf": "steps.jsonl", "trainloop": "trainloop/metrics.jsonl"}
COMPILED = "+compile"  # a variant's suffix: the same loop, its model compiled (inductor)
STEPS_PER_TURN = 6  # a turn stretches past --turn to hold this many of the process's steps (2 are lost per turn)
MAX_TURN_S = 60.0


def build_common(cfg):
    """The tokenizer, packed data and model every variant trains: trainloop's builders, which
    are thin wrappers over `datasets` and `transformers.AutoModelForCausalLM.from_config`, and the
    attention trainloop's run gives the model (trainloop.model.attention): the three variants run
    the same kernels, and the ratios measure the loops."""
    import torch

    from trainloop.data.loaders import build_datasets, build_tokenizer
    from trainloop.model.attention import training_attention, use
    from trainloop.model.builder import build_model, build_model_config

    tokenizer = build_tokenizer(None, None)
    train_set, _ = build_datasets(cfg.data, tokenizer, cfg.trainer.seed)
    torch.manual_seed(cfg.trainer.seed)
    config = build_model_config(cfg.model, len(tokenizer))
    model = build_model(cfg.model, config)
    if (attention := training_attention(cfg, config, blocks=True)) is not None:  # causal_lm on token blocks
        use(model, attention, f"data.packing={cfg.data.packing}")
    return train_set, model


class StepLog:
    """A worker's steps.jsonl: one flushed line per optimizer step, read by the parent while it runs."""

    def __init__(self, path: Path):
        self.file = open(path, "a")
        self.step = 0

    def write(self, record: dict) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()

    def step_done(self, loss: float) -> None:
        self.step += 1
        self.write({"step": self.step, "loss": loss, "time": time.time()})

    def close(self) -> None:
        import torch

        if torch.cuda.is_available():
            self.write({"gpu_peak_bytes": torch.cuda.max_memory_allocated()})
        self.file.close()


def worker_raw(cfg, steps: int, out: Path, compiled: bool = False) -> None:
    import torch
    from transformers import get_scheduler

    from trainloop.optim.optimizers import parameter_groups

    device = "cuda" if torch.cuda.is_available() else "cpu"
    train_set, model = build_common(cfg)
    model.to(device).train()
    forward = torch.compile(model) if compiled else model
    opt = cfg.optimizer
    optimizer = torch.optim.AdamW(parameter_groups(model, opt.weight_decay), lr=opt.lr, betas=tuple(opt.betas),
                                  eps=opt.eps, fused=True)  # as optimizer.impl=auto
    scheduler = get_scheduler("cosine", optimizer, num_warmup_steps=0, num_training_steps=steps)
    loader = torch.utils.data.DataLoader(train_set.blocks, batch_size=cfg.data.batch_size, shuffle=True,
                                         drop_last=True)  # the raw loop: plain token blocks, labels = inputs
    dtype = torch.bfloat16 if cfg.precision.name == "bf16" else None
    log = StepLog(out)
    batches = (ids for _epoch in iter(int, 1) for ids in loader)  # epoch after epoch, as the other two do
    for _ in range(steps):
        ids = next(batches).to(device, non_blocking=True)
        with torch.autocast(device, dtype=dtype, enabled=dtype is not None):
            loss = forward(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.trainer.max_grad_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        log.step_done(loss.item())
    log.close()


def worker_hf(cfg, steps: int, out: Path, compiled: bool = False) -> None:
    import torch
    from transformers import Trainer, TrainerCallback, TrainingArguments

    train_set, model = build_common(cfg)
    log = StepLog(out)

    class StepTimes(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:  # logging_steps=1: after each step's loss sync, like the others
                log.step_done(logs["loss"])

    class AsDict(torch.utils.data.Dataset):  # the raw loop's plain token blocks, labels = inputs
        def __len__(self):
            return len(train_set.blocks)

        def __getitem__(self, i):
            return {"input_ids": train_set.blocks[i], "labels": train_set.blocks[i]}

    opt = cfg.optimizer
    args = TrainingArguments(
        output_dir=str(out.parent / "hf"), max_steps=steps, per_device_train_batch_size=cfg.data.batch_size,
        learning_rate=opt.lr, weight_decay=opt.weight_decay, adam_beta1=opt.betas[0], adam_beta2=opt.betas[1],
        adam_epsilon=opt.eps, lr_scheduler_type="cosine", max_grad_norm=cfg.trainer.max_grad_norm,
        logging_steps=1, save_strategy="no", report_to=[], disable_tqdm=True, seed=cfg.trainer.seed,
        dataloader_num_workers=0, bf16=cfg.precision.name == "bf16",
        optim="adamw_torch_fused" if torch.cuda.is_available() else "adamw_torch",
        use_cpu=not torch.cuda.is_available(), dataloader_drop_last=True, torch_compile=compiled,
    )
    Trainer(model=model, args=args, train_dataset=AsDict(), callbacks=[StepTimes()]).train()
    log.close()


def model_flops_utilisation(cfg, tokens_per_s: float) -> float | None:
    """tokens/s x training FLOPs per token over the GPU's dense peak for the precision, as trainloop
    logs its own `mfu` (trainloop.model.flops); None on a CPU or a GPU whose peak is not in the table."""
    import torch

    from trainloop.data.loaders import build_tokenizer
    from trainloop.model.builder import build_model_config
    from trainloop.model.flops import flops_per_token, peak_tflops

    if not torch.cuda.is_available():
        return None
    peak = peak_tflops(torch.device("cuda"), cfg.precision.name, None)
    config = build_model_config(cfg.model, len(build_tokenizer(None, None)))
    return None if peak is None else tokens_per_s * flops_per_token(config, cfg.data.seq_len) / (peak * 1e12)


def timed_steps(times: list[float], intervals: list[tuple[float, float]], warmup: int) -> list[float]:
    """Durations of the steps that count towards tokens/s.

    times[i] is when step i+1 ended; intervals are the (continued, stopped) wall-clock spans in
    which the process ran. Step i+1 counts when [times[i-1], times[i]] lies inside one interval,
    it is past the first `warmup` steps, and it is not the first step to start in its interval.
    Step 1 never counts: it began at process start.
    """
    durations, turns_seen = [], set()
    for i in range(1, len(times)):
        begin, end = times[i - 1], times[i]
        turn = next((k for k, (a, b) in enumerate(intervals) if a <= begin and end <= b), None)
        if turn is None:  # stopped somewhere inside this step
            continue
        first_in_turn = turn not in turns_seen
        turns_seen.add(turn)
        if not first_in_turn and i >= warmup:
            durations.append(end - begin)
    return durations


class Run:
    """One variant's process in one round. Runs only between resume() and stop()/its exit."""

    def __init__(self, variant: str, size: str, steps: int, workdir: Path):
        import psutil

        self.variant, self.steps, self.workdir = variant, steps, workdir
        loop, compiled = variant.removesuffix(COMPILED), variant.endswith(COMPILED)
        self.loop = loop
        self.steps_path = workdir / STEPS_FILE[loop]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        if loop == "trainloop":
            # telemetry at the last step carries the GPU's peak allocation into metrics.jsonl
            cmd = [sys.executable, "-m", "trainloop", *SIZES[size], *COMMON, f"trainer.max_steps={steps}",
                   f"compile={'inductor' if compiled else 'none'}",
                   "trainer.log_every=1", f"trainer.eval_every={steps}", "trainer.eval_batches=1",
                   f"logging.telemetry_every={steps}", "checkpoint.save_final_model=false",
                   # the others write no tracker (the HF Trainer's report_to=[]): metrics.jsonl and the log line
                   "logging.trackers=[]",
                   "logging.progress_bar=false", f"hydra.run.dir={self.steps_path.parent}"]
        else:
            cmd = [sys.executable, __file__, "--worker", loop, "--size", size, "--steps", str(steps),
                   "--out", str(self.steps_path), *(["--compiled"] if compiled else [])]
            from trainloop.__main__ import with_trainloops_malloc

            env = with_trainloops_malloc(env)  # jemalloc where `python -m trainloop` takes it: alike
        with open(workdir / "stderr.txt", "w") as stderr:
            # its own process group: SIGSTOP/SIGCONT/SIGKILL reach any child it starts too
            self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=stderr,
                                         start_new_session=True)
        self.create_time = psutil.Process(self.proc.pid).create_time()
        self.pidfd = os.pidfd_open(self.proc.pid)
        self.intervals: list[tuple[float, float]] = []
        self.running_since: float | None = self.create_time
        self.usage = None

    @property
    def exited(self) -> bool:
        return self.usage is not None

    def turn_length(self, base: float) -> float:
        """--turn, or longer where the process's steps are slow (a loaded machine, a big model)."""
        recent = timed_steps(self.step_times(), self.intervals, warmup=0)[-5:]
        if recent:
            return min(max(base, STEPS_PER_TURN * statistics.median(recent)), MAX_TURN_S)
        rotation_turns = len(self.intervals) - 1  # the first interval was its start-up
        return min(base * 2 ** rotation_turns, MAX_TURN_S)  # not one whole step yet: double until one fits

    def resume(self) -> None:
        self.running_since = time.time()  # before SIGCONT: the interval holds all it can run
        os.killpg(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        os.killpg(self.proc.pid, signal.SIGSTOP)
        self.intervals.append((self.running_since, time.time()))  # after SIGSTOP, likewise
        self.running_since = None

    def run_for(self, seconds: float | None) -> bool:
        """Let it run up to `seconds` (None: until it exits); True when it exited meanwhile."""
        ready, _, _ = select.select([self.pidfd], [], [], seconds)
        if not ready:
            return False
        _, status, self.usage = os.wait4(self.proc.pid, 0)
        self.intervals.append((self.running_since, time.time()))
        self.running_since = None
        self.proc.returncode = os.waitstatus_to_exitcode(status)
        os.close(self.pidfd)
        if self.proc.returncode:
            stderr = (self.workdir / "stderr.txt").read_text()
            raise RuntimeError(f"{self.variant} failed ({self.proc.returncode}):\n{stderr[-3000:]}")
        return True

    def kill(self) -> None:
        """Never leave a stopped child behind: SIGKILL ends a stopped process too."""
        if self.exited:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        os.waitpid(self.proc.pid, 0)
        self.proc.returncode = -signal.SIGKILL
        self.usage = ()
        os.close(self.pidfd)

    def records(self) -> list[dict]:
        """The complete lines of its step file so far (a line being written is left for later)."""
        if not self.steps_path.exists():
            return []
        text = self.steps_path.read_text()
        return [json.loads(line) for line in text[: text.rfind("\n") + 1].splitlines()]

    def step_times(self) -> list[float]:
        """Wall-clock end of each optimizer step; trainloop logs seconds since its process started."""
        offset = self.create_time if self.loop == "trainloop" else 0.0
        return [r["time"] + offset for r in self.records() if "loss" in r]

    def result(self, tokens_per_step: int, warmup: int) -> dict:
        times = self.step_times()
        if len(times) != self.steps:
            raise RuntimeError(f"{self.variant} logged {len(times)} steps, not {self.steps}")
        durations = timed_steps(times, self.intervals, warmup)
        if not durations:
            raise RuntimeError(f"{self.variant}: no step ran whole inside one turn; raise --turn or --steps")
        peaks = [r[k] for r in self.records() for k in ("gpu_peak_bytes", "gpu_mem_peak_allocated_bytes") if k in r]
        return {"tokens_per_s": tokens_per_step * len(durations) / sum(durations), "timed_steps": len(durations),
                "peak_memory_bytes": peaks[-1] if peaks else self.usage.ru_maxrss * 1024,  # Linux: kilobytes
                "first_step_s": times[0] - self.create_time, "turns": len(self.intervals),
                # seconds since its process started, for a reader who wants to check the filtering
                "step_ends_s": [round(t - self.create_time, 3) for t in times],
                "running_s": [(round(a - self.create_time, 3), round(b - self.create_time, 3))
                              for a, b in self.intervals]}


def run_round(variants: list[str], size: str, steps: int, turn: float, workdir: Path) -> list[Run]:
    """Start each variant alone up to its first step, then rotate turns until all have exited."""
    runs = []
    try:
        for variant in variants:
            (workdir / variant).mkdir()
            run = Run(variant, size, steps, workdir / variant)
            runs.append(run)
            exited = False
            while not exited and not run.step_times():
                exited = run.run_for(0.05)
            if not exited:
                run.stop()
        live = [run for run in runs if not run.exited]
        while live:
            for run in list(live):
                seconds = run.turn_length(turn)
                run.resume()
                if run.run_for(seconds if len(live) > 1 else None):  # the last one left runs to its end
                    live.remove(run)
                else:
                    run.stop()
    finally:
        for run in runs:
            run.kill()
    return runs


def summarize(results: list[dict]) -> dict:
    rates = [r["tokens_per_s"] for r in results]
    return {"tokens_per_s": statistics.median(rates), "all_tokens_per_s": [round(x) for x in rates],
            "peak_memory_gib": statistics.median(r["peak_memory_bytes"] for r in results) / 2**30,
            "first_step_s": statistics.median(r["first_step_s"] for r in results)}


def exit_on_signal(signum, frame):
    sys.exit(128 + signum)  # SystemExit unwinds through run_round's finally, which kills the children


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(SIZES), default="cpu")
    parser.add_argument("--steps", type=int, help="optimizer steps per run (default: 2000 for --size tiny, else 80)")
    parser.add_argument("--warmup", type=int, default=10, help="first steps left out of tokens/s")
    parser.add_argument("--rounds", type=int, default=3, help="rounds; the variants of a round take turns")
    parser.add_argument("--turn", type=float, default=2.5, help="seconds a process runs before the next one's turn")
    parser.add_argument("--variants", default="raw,trainloop,hf", help="the loops, each run as --compile says")
    parser.add_argument("--compile", choices=["off", "on", "both"],
                        help="eager (off), compiled (on), or each both ways; default: off for --size cpu "
                             "(inductor's compile takes minutes on 2 cores), both for --size tiny and gpt2")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--worker", choices=["raw", "hf"], help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--compiled", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()

    from trainloop.config.compose import compose_config

    cfg = compose_config([*SIZES[args.size], *COMMON], check=False)
    if args.worker:
        {"raw": worker_raw, "hf": worker_hf}[args.worker](cfg, args.steps, args.out, args.compiled)
        return
    args.steps = args.steps or (2000 if args.size == "tiny" else 80)  # tiny: milliseconds a step, turns of seconds
    if args.steps <= args.warmup + 1:
        parser.error("--steps must be larger than --warmup + 1")
    if args.turn <= 0:
        parser.error("--turn must be positive")
    loops = args.variants.split(",")
    if not loops or set(loops) - set(STEPS_FILE) or len(set(loops)) < len(loops):
        parser.error(f"--variants: a comma-separated subset of {','.join(STEPS_FILE)}, each once")
    mode = args.compile or ("off" if args.size == "cpu" else "both")
    suffixes = {"off": [""], "on": [COMPILED], "both": ["", COMPILED]}[mode]
    variants = [loop + suffix for suffix in suffixes for loop in loops]
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, exit_on_signal)

    began = time.time()
    tokens_per_step = cfg.data.batch_size * cfg.data.seq_len
    rounds, loads = [], []  # per round: variant -> result; the 1-minute load average at its end
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            workdir = Path(tmp) / f"round{round_}"
            workdir.mkdir()
            runs = run_round(variants, args.size, args.steps, args.turn, workdir)
            rounds.append({run.variant: run.result(tokens_per_step, args.warmup) for run in runs})
            loads.append(os.getloadavg()[0])
            print(f"round {round_ + 1}/{args.rounds} (load average {loads[-1]:.1f}): " + ", ".join(
                f"{v} {r['tokens_per_s']:,.0f} tokens/s ({r['timed_steps']} steps timed, {r['turns']} turns)"
                for v, r in rounds[-1].items()), file=sys.stderr)

    results = {v: summarize([r[v] for r in rounds]) for v in variants}
    for r in results.values():  # the same model and tokens for all: one FLOPs count
        r["mfu"] = model_flops_utilisation(cfg, r["tokens_per_s"])
        r["ms_per_step"] = 1000 * tokens_per_step / r["tokens_per_s"]
    # first, what the script is for: what trainloop costs beside the raw loop, then beside the HF Trainer
    paired = {}
    for base in ("raw", "hf"):
        for suffix in suffixes:
            ours, theirs = "trainloop" + suffix, base + suffix
            if ours not in results or theirs not in results:
                continue
            paired[f"{ours}/{theirs}"] = [r[ours]["tokens_per_s"] / r[theirs]["tokens_per_s"] for r in rounds]
            print(f"{ours} / {theirs}: tokens/s x{results[ours]['tokens_per_s'] / results[theirs]['tokens_per_s']:.3f}, "
                  f"peak memory x{results[ours]['peak_memory_gib'] / results[theirs]['peak_memory_gib']:.3f}; "
                  f"paired per round {', '.join(f'x{x:.3f}' for x in paired[f'{ours}/{theirs}'])}, "
                  f"median x{statistics.median(paired[f'{ours}/{theirs}']):.3f}; "
                  f"{results[ours]['ms_per_step']:.2f} ms/step against {results[theirs]['ms_per_step']:.2f}")
    print(f"\n{args.size} size, {args.steps} steps x {args.rounds} rounds, turns of {args.turn:g} s, "
          f"{tokens_per_step} tokens/step; tokens/s over the steps that ran whole inside one turn, "
          f"after {args.warmup} warm-up steps and the first step of each turn (median over rounds)\n")
    print("| variant | ms/step | tokens/s | MFU | runs | peak memory (GiB) | start to 1st step (s) |")
    print("|---|---:|---:|---:|---|---:|---:|")
    for v, r in results.items():
        mfu = "-" if r["mfu"] is None else f"{r['mfu']:.1%}"
        print(f"| {v} | {r['ms_per_step']:.2f} | {r['tokens_per_s']:,.0f} | {mfu} | {r['all_tokens_per_s']} | {r['peak_memory_gib']:.2f} | "
              f"{r['first_step_s']:.1f} |")
    # the running variant itself counts for about as many as its compute threads
    print(f"\n{time.time() - began:.0f} s in all; 1-minute load average at the end of each round: "
          f"{', '.join(f'{x:.1f}' for x in loads)} on {os.cpu_count()} CPUs")
    if args.json:
        args.json.write_text(json.dumps({"size": args.size, "steps": args.steps, "rounds": args.rounds,
                                         "turn_s": args.turn, "warmup": args.warmup, "results": results,
                                         "per_round": rounds, "paired": paired,
                                         "load_average_after_round": loads}, indent=2))


if __name__ == "__main__":
    main()
