"""Each efficiency method against plain fp32 AdamW, measured in one invocation on this machine.

    python scripts/bench_methods.py [--steps 12] [--warmup 3] [--only NAME ...] [--json OUT]

Every method runs in a fresh process (the same model, data, seed and loop as the baseline, with
the method's config overrides on top), so that each has its own peak memory:
  - speed: training tokens per step over the median time of the timed steps, which follow
    warm-up steps (compilation happens there). On CPU each method gets one compute thread and the
    time is the process's CPU time, which other processes on a shared machine hardly change (its
    wall-clock tokens/s is shown too); on a GPU, wall-clock time;
  - peak memory over the warm-up steps: on CPU, the peak resident set (VmHWM, reset through
    /proc/self/clear_refs just before the model is built) minus the resident set at that moment,
    with glibc told to give every allocation of 64 KiB or more its own mapping so that freed
    tensors leave the resident set (the timed steps run with its usual heap); on a GPU, the peak
    of torch.cuda.max_memory_allocated over the same span. Model, gradients, optimizer state,
    activations (and compilation), not the data or the libraries;
  - optimizer state bytes per parameter, counted on the live optimizer after the run.
Ratios are against the baseline of this same invocation, run first and last: the mean of the two
is the reference, their difference the noise floor.
A method this machine cannot run gets a row that says why, in trainloop's own words.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from trainloop.memory.proc import reset_peak_rss, status_bytes

REPO = Path(__file__).resolve().parent.parent
# The default tiny Llama (4 blocks, 256 wide, ~4.3M parameters) on 128-token blocks, batch 8.
BASE = ["data.seq_len=128", "data.batch_size=8", "trainer.gradient_accumulation_steps=1",
        "logging.progress_bar=false"]


@dataclass
class Method:
    name: str
    row: str  # the guide's table row it belongs to
    overrides: list[str] = field(default_factory=list)
    needs_cuda: str | None = None  # why it is meaningless without a CUDA GPU
    reference: str | None = None  # the method its ratios are taken against (None: the baseline)


# The guide's table: method -> (improves training speed, optimizes memory utilization).
GUIDE = {
    "Batch size choice": ("Yes", "Yes"),
    "Gradient accumulation": ("No", "Yes"),
    "Gradient checkpointing": ("No", "Yes"),
    "Mixed precision training": ("Yes", "(No)"),
    "Optimizer choice": ("Yes", "Yes"),
    "Data preloading": ("Yes", "No"),
    "DeepSpeed Zero": ("No", "Yes"),
    "torch.compile": ("Yes", "No"),
}

LONG = ["model.max_position_embeddings=2048", "data.seq_len=2048", "data.batch_size=1"]
LOSS_CHUNK = 256  # tokens per chunk: 256 x 128,256 fp32 logits are 125 MiB, an eighth of the sequence's

METHODS = [
    Method("baseline", "", []),
    Method("batch 16 (2x)", "Batch size choice", ["data.batch_size=16"]),
    Method("batch 2 x accumulate 4", "Gradient accumulation", ["data.batch_size=2", "trainer.gradient_accumulation_steps=4"]),
    Method("gradient checkpointing", "Gradient checkpointing", ["model.gradient_checkpointing=true"]),
    Method("activation offload", "Gradient checkpointing", ["trainer.activation_offload=true"],
           needs_cuda="saved activations go to pinned host memory: on a CPU they are in host memory already"),
    Method("activation offload + checkpointing", "Gradient checkpointing",
           ["trainer.activation_offload=true", "model.gradient_checkpointing=true"],
           needs_cuda="saved activations go to pinned host memory: on a CPU they are in host memory already"),
    Method("bf16", "Mixed precision training", ["precision=bf16"]),
    Method("fp16", "Mixed precision training", ["precision=fp16"]),
    Method("tf32", "Mixed precision training", ["precision.tf32=true"],
           needs_cuda="TF32 is a tensor-core format of Ampere+ GPUs; on CPU it changes nothing"),
    Method("fp8", "Mixed precision training", ["precision=fp8"],
           needs_cuda="float8 matmuls need a GPU of compute capability 8.9+; a CPU only emulates them, slower than bf16"),
    Method("adamw foreach", "Optimizer choice", ["optimizer.impl=foreach"]),
    # the baseline's AdamW is torch's fused kernel (optimizer.impl=auto): the row beside it is the for-loop
    Method("adamw for-loop", "Optimizer choice", ["optimizer.impl=for_loop"]),
    Method("adafactor", "Optimizer choice", ["optimizer=adafactor"]),
    Method("adamw8bit", "Optimizer choice", ["optimizer=adamw8bit"]),
    Method("paged_adamw8bit", "Optimizer choice", ["optimizer=paged_adamw8bit"]),
    Method("sgd", "Optimizer choice", ["optimizer=sgd"]),
    Method("2 loader workers", "Data preloading", ["data.num_workers=2", "data.persistent_workers=true"]),
    Method("pinned memory", "Data preloading", ["data.pin_memory=true"],
           needs_cuda="page-locked host memory only speeds host-to-GPU copies"),
    Method("ZeRO", "DeepSpeed Zero", [], needs_cuda=None),
    Method("compile inductor", "torch.compile", ["compile=inductor"]),
    Method("compile inductor, regional", "torch.compile", ["compile=inductor", "compile.regional=true"]),
    Method("eager attention", "(attention)", ["model.attn_implementation=eager"]),
    Method("flash_attention_2", "(attention)", ["model.attn_implementation=flash_attention_2"]),
    Method("lora r=16", "(adapters)", ["adapter=lora", "adapter.r=16", "adapter.alpha=32"]),
    # the same tiny model, saved once by the driver (MODEL_DIR): quantization needs pretrained weights
    Method("qlora r=16 (4-bit NF4, bf16)", "(adapters)", ["model=hf", "model.name_or_path=MODEL_DIR", "adapter=lora",
           "adapter.r=16", "adapter.alpha=32", "model.quantization=4bit", "precision=bf16"]),
    Method("+preset=memory_saver", "(presets)", ["+preset=memory_saver"]),
    Method("+preset=speed", "(presets)", ["+preset=speed"]),
    # the loss over a large vocabulary: one 2,048-token sequence, the vocabulary padded to 32,000 and
    # 128,256 rows (model.vocab_multiple), the full logits against trainer.loss_chunk_tokens
    *(Method(f"{loss} loss, vocab {name}, seq 2048", "(loss at a large vocabulary)",
             [f"model.vocab_multiple={vocab}", *LONG] + ([f"trainer.loss_chunk_tokens={LOSS_CHUNK}"] if loss == "chunked" else []),
             reference=None if loss == "full" else f"full loss, vocab {name}, seq 2048")
      for name, vocab in (("32k", 32000), ("128k", 128256)) for loss in ("full", "chunked")),
]
ZERO_WHY = ("ZeRO partitions optimizer state, gradients and parameters across processes (and offload "
            "moves them off the GPU): one process has nothing to partition; `python -m trainloop.plan "
            "+preset=zero3` predicts the per-process figures")


# --- one method, in its own process -----------------------------------------------------------

def worker(overrides: list[str], steps: int, warmup: int, data_file: str) -> dict:
    from trainloop.config.compose import ConfigError, compose_config, validate

    cfg = compose_config([*BASE, *overrides], check=False)
    try:
        validate(cfg)
        return _train(cfg, steps, warmup, data_file)
    except ConfigError as err:
        return {"skipped": str(err).replace("\n", " ")}


def _train(cfg, steps: int, warmup: int, data_file: str) -> dict:
    import gc

    import torch
    from omegaconf import OmegaConf

    from trainloop.build import build
    from trainloop.data.loaders import PackedBlocks
    from trainloop.memory.offload import ActivationOffload
    from trainloop.model.adapter import apply_adapter
    from trainloop.model.builder import build_model, build_model_config
    from trainloop.objectives import build_objective
    from trainloop.optim.optimizers import build_optimizer, optimizer_state_bytes
    from trainloop.parallel import build_strategy
    from trainloop.parallel.accelerator import build_accelerator
    from trainloop.step import train_step
    from trainloop.tools.measure import track_live_memory

    accelerator = build_accelerator(cfg)
    strategy = build_strategy(cfg, accelerator)
    on_cuda = accelerator.device.type == "cuda"
    data = torch.load(data_file)  # tokenized once by the driver: the same blocks for every method
    blocks = PackedBlocks(reblock(data["train"], cfg.data.seq_len))

    # Load the code paths first (model classes, the optimizer's library, autocast and autograd
    # kernels, thread pools) on a one-block model, so that what is measured is the method's
    # memory and not the libraries it imports.
    small = OmegaConf.merge(cfg.model, {"num_layers": 1, "gradient_checkpointing": False})
    scrap = build_model(small, build_model_config(small, data["vocab_size"]), cfg.precision.name).to(accelerator.device)
    if cfg.adapter.name != "none":
        scrap = apply_adapter(OmegaConf.merge(cfg, {"model": small}), scrap)
    scrap_optimizer = build_optimizer(cfg.optimizer, scrap, on_cuda=on_cuda)
    ids = data["train"][:2, :128].to(accelerator.device)
    # the run's step on it, this process alone (accelerate has not wrapped it: autocast is added)
    train_step(strategy, build_objective(cfg, accelerator.device), scrap, scrap_optimizer,
               [{"input_ids": ids, "labels": ids}], max_grad_norm=cfg.trainer.max_grad_norm,
               forward_context=accelerator.autocast, alone=True)
    del scrap, scrap_optimizer, ids
    gc.collect()

    marks = {}

    def start_measuring() -> None:  # the data is in memory; the model is built next
        if on_cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            marks["before"] = torch.cuda.memory_allocated()
        else:
            marks["libc"] = track_live_memory(True)
            marks["exact_peak"] = reset_peak_rss()
            marks["before"] = status_bytes("VmRSS")

    # The run's own build (adapter, compile, strategy, optimizer, in the run's order) and its objective's loss.
    built = build(cfg, strategy, blocks=(blocks, blocks), before_model=start_measuring)
    model, optimizer, objective = built.model, built.optimizer, built.objective
    before, libc, exact_peak = marks["before"], marks.get("libc"), marks.get("exact_peak")

    accumulation = built.accumulation
    batches = iter(built.train_loader)
    offload = ActivationOffload(cfg.trainer.activation_offload, accelerator.device)  # the run's forward context
    model.train()
    step_times, step_cpu = [], []
    for step in range(warmup + steps):
        if step == warmup:  # the warm-up steps hold the peak: state and activations, compilation
            if on_cuda:
                peak = torch.cuda.max_memory_allocated() - before
                memory_kind = "torch.cuda.max_memory_allocated"
            else:
                peak = (status_bytes("VmHWM") if exact_peak else _maxrss()) - before
                memory_kind = ("VmHWM - VmRSS" if exact_peak else "ru_maxrss - VmRSS") + \
                    (", glibc mmap threshold 64 KiB" if libc else "")
                if libc:
                    track_live_memory(False)  # glibc's usual heap for the timed steps
        t0, c0 = time.perf_counter(), time.process_time()
        group = [{key: value.to(accelerator.device) for key, value in next(batches).items()}
                 for _ in range(accumulation)]
        step_loss = train_step(strategy, objective, model, optimizer, group,  # the run's step (trainloop.step)
                               max_grad_norm=cfg.trainer.max_grad_norm, forward_context=offload).loss
        last_loss = float(step_loss)  # also waits for the device
        step_times.append(time.perf_counter() - t0)
        step_cpu.append(time.process_time() - c0)
    # The median step: a neighbour's burst on a shared machine moves it less than the mean.
    median_step = statistics.median(step_times[warmup:])
    state = optimizer_state_bytes(optimizer)
    tokens_per_step = accumulation * built.batch_size * cfg.data.seq_len
    # On CPU the speed is tokens per CPU-second of this one-thread process: what other processes
    # on a shared machine take from it changes its wall time, hardly its CPU time.
    speed = tokens_per_step / (median_step if on_cuda else statistics.median(step_cpu[warmup:]))
    return {"speed": speed, "speed_kind": "tokens/s" if on_cuda else "tokens per CPU-second, 1 thread",
            "tokens_per_s": tokens_per_step / median_step, "peak_bytes": peak, "memory_kind": memory_kind,
            "state_bytes_per_param": state.per_param, "warmup_s": sum(step_times[:warmup]), "loss": last_loss,
            "params": state.params, "device": str(accelerator.device)}


def reblock(blocks, seq_len: int):
    """The driver's blocks cut into blocks of seq_len tokens (the same text, end to end)."""
    if blocks.shape[1] == seq_len:
        return blocks
    flat = blocks.flatten()
    return flat[: len(flat) // seq_len * seq_len].view(-1, seq_len)


def _maxrss() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# --- the driver ---------------------------------------------------------------------------------

def tokenize_once(path: Path) -> None:
    """The training blocks every method trains on, written once for all the worker processes."""
    import torch

    from trainloop.config.compose import compose_config
    from trainloop.data.loaders import build_datasets, build_tokenizer

    cfg = compose_config(BASE, check=False)
    tokenizer = build_tokenizer(cfg.data.tokenizer, cfg.model.name_or_path)
    train_set, _ = build_datasets(cfg.data, tokenizer, cfg.trainer.seed)
    torch.save({"train": train_set.blocks, "vocab_size": len(tokenizer)}, path)
    save_tiny_model(cfg, tokenizer, path.parent / "model")


def save_tiny_model(cfg, tokenizer, directory: Path) -> None:
    """The baseline's model with its seeded initial weights and its tokenizer, as a local model
    directory (MODEL_DIR in a method's overrides): what the qlora row quantizes."""
    from accelerate.utils import set_seed

    from trainloop.model.builder import build_model, build_model_config

    set_seed(cfg.trainer.seed)
    build_model(cfg.model, build_model_config(cfg.model, len(tokenizer))).save_pretrained(directory)
    tokenizer.save_pretrained(directory)


def run_method(method: Method, steps: int, warmup: int, on_cuda: bool, data_file: Path) -> dict:
    if method.name == "ZeRO":
        return {"skipped": ZERO_WHY}
    if method.needs_cuda and not on_cuda:
        return {"skipped": f"needs a CUDA GPU: {method.needs_cuda}"}
    cmd = [sys.executable, __file__, "--worker", "--steps", str(steps), "--warmup", str(warmup),
           "--data-file", str(data_file), "--",
           *(o.replace("MODEL_DIR", str(data_file.parent / "model")) for o in method.overrides)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1",
           "HF_DATASETS_DISABLE_PROGRESS_BARS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env, timeout=1800)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {"skipped": f"failed (exit {proc.returncode}): " + proc.stderr.strip().splitlines()[-1][:300]
                if proc.stderr.strip() else f"failed (exit {proc.returncode})"}
    return json.loads(lines[-1])


def fmt_ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def table(rows: list[tuple[Method, dict]], reference: dict) -> str:
    lines = ["| guide row | guide: speed | guide: memory | method | speed | speed ratio | wall tokens/s "
             "| peak memory | memory ratio | optimizer state B/param | warm-up s | last micro-batch loss |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    results = {method.name: r for method, r in rows}
    for method, r in rows:
        against = results.get(method.reference, {}) if method.reference else reference
        speed, memory = GUIDE.get(method.row, ("", ""))
        row = method.row or "(baseline: fp32 AdamW, SDPA, no compile)"
        if "skipped" in against:
            r = {"skipped": f"its reference ({method.reference}) did not run"}
        if "skipped" in r:
            lines.append(f"| {row} | {speed} | {memory} | {method.name} | not run here: {r['skipped']} "
                         "| | | | | | | |")
            continue
        lines.append(
            f"| {row} | {speed} | {memory} | {method.name} | {r['speed']:,.0f} "
            f"| {fmt_ratio(r['speed'] / against['speed'])} | {r['tokens_per_s']:,.0f} "
            f"| {r['peak_bytes'] / 2**20:,.1f} MiB | {fmt_ratio(r['peak_bytes'] / against['peak_bytes'])} "
            f"| {r['state_bytes_per_param']:.2f} | {r['warmup_s']:.1f} | {r['loss']:.3f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10, help="timed optimizer steps per method")
    parser.add_argument("--warmup", type=int, default=3,
                        help="untimed steps first, at least 2: compilation and the memory peak happen here")
    parser.add_argument("--only", nargs="*", help="method names to run (the baseline always runs)")
    parser.add_argument("--json", help="also write the raw results here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--data-file", help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.warmup < 2:
        parser.error("--warmup must be at least 2: the second step is the first with optimizer state in memory")
    if args.worker:
        print(json.dumps(worker(args.overrides, args.steps, args.warmup, args.data_file)))
        return

    import torch

    on_cuda = torch.cuda.is_available()
    wanted = set(args.only or [])
    wanted |= {m.reference for m in METHODS if m.name in wanted and m.reference}  # a ratio needs its reference
    methods = [m for m in METHODS if m.name != "baseline" and (not args.only or m.name in wanted)]
    started = time.time()
    data_file = Path(tempfile.mkdtemp(prefix="bench_methods_")) / "blocks.pt"
    tokenize_once(data_file)
    run = partial(run_method, steps=args.steps, warmup=args.warmup, on_cuda=on_cuda, data_file=data_file)

    def report(name: str, result: dict) -> None:
        print(f"{name:36s} " + (f"not run: {result['skipped'][:100]}" if "skipped" in result else
              f"{result['speed']:9,.0f} {result['speed_kind']}  {result['peak_bytes'] / 2**20:8.1f} MiB"), flush=True)

    first = run(METHODS[0])
    if "skipped" in first:
        sys.exit(f"the baseline did not run: {first['skipped']}")
    report("baseline", first)
    results = []
    for method in methods:
        results.append((method, run(method)))
        report(method.name, results[-1][1])
    last = run(METHODS[0])  # the baseline again: the two bracket the others, their spread is the noise
    report("baseline", last)
    shutil.rmtree(data_file.parent)
    reference = {**first, **{k: (first[k] + last[k]) / 2 for k in ("speed", "tokens_per_s", "peak_bytes")}}

    cores = os.cpu_count()
    device = torch.cuda.get_device_name() if on_cuda else f"CPU ({platform.processor() or platform.machine()}, {cores} cores)"
    print()
    print(f"trainloop bench_methods: {device}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}, "
          f"{args.steps} timed steps after {args.warmup} warm-up, model {first['params']:,} parameters, "
          f"batch 8 x 128 tokens, {time.time() - started:.0f} s in all, load average at the end "
          f"{os.getloadavg()[0]:.1f}")
    print(f"speed = {first['speed_kind']} (median step); memory = {first['memory_kind']}")
    if any(m.reference for m in methods):
        print("a row with a reference (the chunked loss's: the full loss at its vocabulary, both 1 x 2,048 tokens) has its ratios against "
              "that row, not the baseline")
    print(f"baseline first and last: {first['speed']:,.0f} and {last['speed']:,.0f} "
          f"({abs(first['speed'] - last['speed']) / reference['speed']:.0%} apart), "
          f"{first['peak_bytes'] / 2**20:.1f} and {last['peak_bytes'] / 2**20:.1f} MiB")
    print()
    print(table([(METHODS[0], reference), *results], reference))
    if args.json:
        Path(args.json).write_text(json.dumps({"baselines": [first, last], "results": [
            {"method": m.name, "row": m.row, "overrides": m.overrides, **r} for m, r in results]}, indent=2))


if __name__ == "__main__":
    main()
