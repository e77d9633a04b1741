"""Every path only a GPU can show, in one command, with one markdown report (issue 28, item 6).

    bash scripts/gpu_check.sh [--out DIR] [--only NAME ...] [--quick] [--budget SECONDS]

Each check is a short trainloop run (or one of the benchmark scripts) in its own process, with
its own timeout, inside one time budget (default 480 s: 8 minutes on one GPU). From each
run's metrics.jsonl the report takes tokens/s, MFU (where the GPU's peak is known), the loss and
the peak memory (torch.cuda.max_memory_allocated on a GPU, the sampled resident set on a CPU).
A check ran, failed (with the last lines of its output) or was skipped (with why); none is left
out. On a machine without a CUDA GPU the checks run at a tiny size, and those only a GPU can show
are skipped, each with its reason; --quick (what tests/test_gpu_check.py runs in CI) runs two of
them and names every other as skipped. The exit code is 1 if any check failed, else 0.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))

# A ~100M-parameter Llama, 8 x 1024 tokens a step: big enough for the GPU paths to differ, small
# enough that a check takes well under a minute (most of it start-up).
GPU_MODEL = ["model.num_layers=8", "model.hidden_size=1024", "model.num_heads=16"]
GPU_RUN = ["data.seq_len=1024", "data.batch_size=8", "trainer.max_steps=30", "trainer.log_every=10",
           "trainer.eval_batches=2", "logging.telemetry_every=10"]
GPU_BASE = [*GPU_MODEL, *GPU_RUN]
CPU_BASE = ["+preset=smoke", "data.seq_len=32", "data.batch_size=2", "trainer.max_steps=4", "trainer.log_every=2",
            "trainer.eval_batches=1", "logging.telemetry_every=2"]
EVERY_RUN = ["logging.progress_bar=false", "logging.trackers=[]"]
# the chunked loss at a Llama-3 vocabulary: 2,048 tokens x 128,256 x 4 bytes is 1 GiB of logits
BIG_VOCAB_GPU = ["model.vocab_multiple=128256", "model.max_position_embeddings=2048", "model.num_layers=4", "model.hidden_size=1024", "model.num_heads=16",
                 "data.seq_len=2048", "data.batch_size=1", "trainer.max_steps=10", "trainer.log_every=5",
                 "trainer.eval_batches=1", "logging.telemetry_every=5", "precision=bf16"]
BIG_VOCAB_CPU = ["+preset=smoke", "model.vocab_multiple=32768", "data.seq_len=256", "data.batch_size=1",
                 "trainer.max_steps=3", "trainer.log_every=1", "trainer.eval_batches=1", "logging.telemetry_every=1"]


@dataclass
class Machine:
    cuda: bool
    name: str
    capability: tuple[int, int] | None
    flash_attn: bool


@dataclass
class Check:
    name: str
    shows: str
    gpu: list[str]  # trainloop overrides on a GPU (after GPU_BASE unless `base` is False), or a command
    cpu: list[str] | None = None  # the tiny CPU form; None: skipped on a CPU, for `cpu_why`
    cpu_why: str = ""
    command: bool = False  # gpu/cpu are a command line (argv after python), not trainloop overrides
    base: bool = True
    timeout: float = 150
    quick: bool = False  # in the --quick CPU form
    adapt: Callable[[Machine, list[str]], tuple[list[str], str]] | None = None  # overrides and a note, per machine
    figures: Callable[[Path], dict] | None = None  # for a command: its figures, from its output dir
    compare_to: str | None = None  # the check whose peak memory this one's is put against


def _flash(machine: Machine, overrides: list[str]) -> tuple[list[str], str]:
    if machine.flash_attn:
        return overrides, ""
    return [o.replace("flash_attention_2", "sdpa") for o in overrides], "flash-attn is not installed: ran sdpa"


def _fp8(machine: Machine, overrides: list[str]) -> tuple[list[str], str]:
    if not machine.cuda:
        return overrides, "emulated: a CPU has no float8 matmuls"
    if machine.capability < (8, 9):
        return [*overrides, "precision.fp8_emulate=true"], f"compute capability {machine.capability}: emulated"
    return overrides, "float8 tensor cores (torch._scaled_mm)"


def _bench_figures(out: Path) -> dict:
    results = json.loads((out / "bench.json").read_text())["results"]
    return {"tokens/s": ", ".join(f"{v} {r['tokens_per_s']:,.0f}" for v, r in results.items()),
            "peak memory": ", ".join(f"{v} {r['peak_memory_gib']:.2f} GiB" for v, r in results.items()),
            "MFU": ", ".join(f"{v} {r['mfu']:.1%}" for v, r in results.items() if r.get("mfu") is not None)}


def _attention_figures(out: Path) -> dict:
    rows = json.loads((out / "attention.json").read_text())["kernel"]
    return {"note": "; ".join(f"{r['path']} {r['tokens']:,}: " + (f"not run ({r['skipped'][:60]})" if "skipped" in r else
                                                                 f"{r['tokens_per_s']:,.0f} tok/s, "
                                                                 f"{r['peak_bytes'] / 2**20:,.0f} MiB") for r in rows)}


def _methods_figures(out: Path) -> dict:
    found = json.loads((out / "methods.json").read_text())
    rows = [f"{r['method']}: " + (f"not run ({r['skipped'][:60]})" if "skipped" in r else
                                f"{r['speed']:,.0f} tok/s, {r['peak_bytes'] / 2**20:,.0f} MiB")
            for r in found["results"]]
    return {"note": "; ".join(rows)}


# bench_methods' GPU rows that the checks above do not already run, as that script names them
GPU_METHODS = ["pinned memory", "paged_adamw8bit", "+preset=memory_saver", "+preset=speed"]
GPT2 = ["+preset=gpt2_124m"]  # as users run it: the largest micro-batch that fits, compiled

# In this order: bench.py first (the framework's cost beside a raw loop and the HF Trainer is what a
# lent GPU is asked for first), then the quick trainloop paths, compile, DeepSpeed's op build and
# bench_methods last; a check the rest of the budget cannot hold is reported as skipped, saying so.
CHECKS = [
    Check("bench.py --size gpt2", "trainloop against a raw PyTorch loop and HF Trainer, eager and compiled, one round",
          ["scripts/bench.py", "--size", "gpt2", "--compile", "both", "--rounds", "1", "--steps", "30", "--warmup", "8",
           "--json", "OUT/bench.json"], command=True, figures=_bench_figures, timeout=300,
          cpu_why="--size gpt2 is a GPU shape (the CPU figures are BENCHMARKS.md's, from --size cpu)"),
    Check("bf16", "bf16 autocast; the reference the memory figures below compare with", ["precision=bf16"],
          cpu=["precision=bf16"], quick=True),
    Check("fp16", "fp16 autocast with loss scaling", ["precision=fp16"], cpu_why="fp16 autocast needs a CUDA GPU"),
    Check("tf32", "fp32 weights, TF32 tensor-core matmuls", ["precision=fp32", "precision.tf32=true"],
          cpu_why="TF32 is a tensor-core format of Ampere+ GPUs"),
    Check("adamw fused", "torch's fused AdamW kernel", ["precision=bf16", "optimizer.impl=fused"],
          cpu=["precision=bf16", "optimizer.impl=fused"]),
    Check("adamw8bit", "bitsandbytes' 8-bit AdamW (CUDA kernels)", ["precision=bf16", "optimizer=adamw8bit"],
          cpu=["precision=bf16", "optimizer=adamw8bit"]),
    Check("flash attention", "flash-attn's FlashAttention-2 (sdpa where flash-attn is not installed)",
          ["precision=bf16", "model.attn_implementation=flash_attention_2"], adapt=_flash,
          cpu_why="flash-attn runs on CUDA GPUs only"),
    Check("fp8", "torchao float8 linear layers in the blocks (precision=fp8), compiled on a GPU",
          ["precision=fp8", "compile=inductor"], cpu=["precision=fp8"], adapt=_fp8, quick=True, timeout=300),
    Check("activation offload", "saved activations in pinned host memory (trainer.activation_offload)",
          ["precision=bf16", "trainer.activation_offload=true"], cpu=["precision=bf16", "trainer.activation_offload=true"],
          compare_to="bf16"),
    Check("full loss, big vocabulary", "the reference for the chunked loss: the whole logits at once, "
          "vocabulary 128,256 x 2,048 tokens on a GPU (32,768 x 256 on a CPU)", BIG_VOCAB_GPU,
          cpu=BIG_VOCAB_CPU, base=False),
    Check("chunked loss, big vocabulary", "the output layer and cross-entropy 1,024 tokens at a time "
          "(trainer.loss_chunk_tokens; 64 on a CPU), the same shape", [*BIG_VOCAB_GPU, "trainer.loss_chunk_tokens=1024"],
          cpu=[*BIG_VOCAB_CPU, "trainer.loss_chunk_tokens=64"], base=False, compare_to="full loss, big vocabulary"),
    Check("fsdp2", "FSDP2 on one device (DTensor shards, bf16 gathers)", ["precision=bf16", "fsdp=full_shard"],
          cpu=["precision=bf16", "fsdp=full_shard"]),
    Check("qlora 4-bit", "a pretrained base in 4-bit NF4 (bitsandbytes) under LoRA adapters",
          ["+preset=qlora", "model.name_or_path=MODEL_DIR", *GPU_RUN], base=False,  # the GPU model, saved
          cpu_why="bitsandbytes' 4-bit matmul on a CPU is the slow reference path (bench_methods' qlora row: 0.05x)"),
    Check("gpt2 MFU", "+preset=gpt2_124m as users run it (auto batch size, compiled), through trainloop: MFU",
          [*GPT2, "trainer.max_steps=40", "trainer.log_every=20", "trainer.eval_batches=2", "logging.telemetry_every=20"],
          base=False, cpu_why="MFU needs a GPU's known peak; the gpt2 shape is a GPU size"),
    Check("compile", "torch.compile (inductor, Triton kernels on a GPU)", ["precision=bf16", "compile=inductor"],
          cpu=["precision=bf16", "compile=inductor"], timeout=300),
    Check("zero3 offload", "DeepSpeed ZeRO-3, parameters and optimizer state offloaded to CPU",
          ["precision=bf16", "+preset=zero3_offload"], timeout=300,
          cpu_why="DeepSpeed's CPU Adam compiles on first use (minutes on 2 cores); tests/ cover ZeRO-3 on CPU"),
    Check("document attention", "packed documents in bf16 through one varlen flash kernel and through sdpa once a "
          "document, against transformers' dense block-causal mask, 2k/8k/32k tokens (scripts/bench_attention.py)",
          ["scripts/bench_attention.py", "--parts", "kernel", "--json", "OUT/attention.json"], command=True,
          figures=_attention_figures, timeout=300,
          cpu_why="its CPU table is BENCHMARKS.md's (python scripts/bench_attention.py, minutes on 2 cores)"),
    Check("varlen attention", "the varlen kernel's forward and gradients equal the dense mask's (bf16) and the "
          "loop's (fp32): tests/test_attention.py's GPU test",
          ["-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_attention.py", "-k", "on_a_gpu"], command=True,
          timeout=120, cpu_why="CUDA's kernel; tests/test_attention.py holds the CPU kernel to the dense mask"),
    Check("bench_methods.py", "the GPU rows of bench_methods.py the checks above do not run, against fp32 AdamW",
          ["scripts/bench_methods.py", "--steps", "6", "--warmup", "2", "--only", *GPU_METHODS,
           "--json", "OUT/methods.json"], command=True, figures=_methods_figures, timeout=300,
          cpu_why="its GPU-only rows say 'not run' on a CPU (its CPU table is BENCHMARKS.md's)"),
]


def read_machine() -> Machine:
    import importlib.util

    import torch

    if not torch.cuda.is_available():
        import platform

        return Machine(False, f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores), "
                              f"torch {torch.__version__}", None, False)
    return Machine(True, f"{torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}",
                   torch.cuda.get_device_capability(), importlib.util.find_spec("flash_attn") is not None)


def run_figures(run_dir: Path) -> dict:
    """tokens/s, MFU and the loss of the last train line; the peak memory over the telemetry lines."""
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [m for m in lines if "loss" in m and "tokens_per_s" in m]
    figures = {}
    if train:
        last = train[-1]
        figures["tokens/s"] = f"{last['tokens_per_s']:,.0f}"
        figures["loss"] = f"{last['loss']:.4f} (step {last['step']})"
        if last.get("mfu") is not None:
            figures["MFU"] = f"{last['mfu']:.1%}"
    gpu = [m["gpu_mem_peak_allocated_bytes"] for m in lines if "gpu_mem_peak_allocated_bytes" in m]
    rss = [m["rss_bytes"] for m in lines if "rss_bytes" in m]
    if gpu:
        figures["peak memory"], figures["peak bytes"] = f"{max(gpu) / 2**30:.2f} GiB allocated", max(gpu)
    elif rss:
        figures["peak memory"], figures["peak bytes"] = f"{max(rss) / 2**20:,.0f} MiB RSS (sampled)", max(rss)
    return figures


def save_tiny_model(directory: Path) -> None:
    """The GPU checks' model (GPU_MODEL) with its initial weights and tokenizer, as a local model
    directory: what the QLoRA check loads in 4 bits (no download)."""
    from trainloop.config.compose import compose_config
    from trainloop.data.tokenizer import build_tokenizer
    from trainloop.model.builder import build_model, build_model_config

    if (directory / "config.json").exists():
        return
    cfg = compose_config(GPU_MODEL)
    tokenizer = build_tokenizer(cfg.data.tokenizer, cfg.model.name_or_path)
    build_model(cfg.model, build_model_config(cfg.model, len(tokenizer))).save_pretrained(directory)
    tokenizer.save_pretrained(directory)


@dataclass
class Outcome:
    check: Check
    status: str  # ran, failed, skipped
    why: str = ""
    command: str = ""
    seconds: float = 0.0
    figures: dict = field(default_factory=dict)
    tail: str = ""


def run_check(check: Check, machine: Machine, out: Path, quick: bool, left: float) -> Outcome:
    if not machine.cuda and check.cpu is None:
        return Outcome(check, "skipped", f"no CUDA GPU: {check.cpu_why}")
    if quick and not check.quick:
        return Outcome(check, "skipped", "--quick runs only " + ", ".join(c.name for c in CHECKS if c.quick))
    timeout = min(check.timeout, left)
    if timeout < 30:
        return Outcome(check, "skipped", f"the time budget is spent ({left:.0f} s left)")
    slug = "".join(c if c.isalnum() else "_" for c in check.name)
    work = out / "runs" / slug
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    note = ""
    if check.command:
        argv = [sys.executable, *(str(REPO / a) if a.startswith("scripts/") else a.replace("OUT", str(work))
                                  for a in check.gpu)]
    else:
        overrides = check.gpu if machine.cuda else check.cpu
        base = (GPU_BASE if machine.cuda else CPU_BASE) if check.base else []
        overrides = [*base, *overrides, *EVERY_RUN]
        if check.adapt is not None:
            overrides, note = check.adapt(machine, overrides)
        if any("MODEL_DIR" in o for o in overrides):
            save_tiny_model(out / "model")
            overrides = [o.replace("MODEL_DIR", str(out / "model")) for o in overrides]
        argv = [sys.executable, "-m", "trainloop", *overrides, f"hydra.run.dir={work}"]
    shown = " ".join(argv[1:]).replace(str(REPO) + "/", "")
    start = time.monotonic()
    with open(work / "output.log", "w") as log:
        try:
            proc = subprocess.run(argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, timeout=timeout,
                                  env={**os.environ, "PYTHONUNBUFFERED": "1"})
            code = proc.returncode
        except subprocess.TimeoutExpired:
            code = None
    seconds = time.monotonic() - start
    for written in ("checkpoints", "final"):  # ~1.5 GB a check at the GPU size; the figures are in metrics.jsonl
        shutil.rmtree(work / written, ignore_errors=True)
    tail = "\n".join((work / "output.log").read_text(errors="replace").splitlines()[-15:])
    if code != 0:
        why = f"timed out after {timeout:.0f} s" if code is None else f"exit code {code}"
        return Outcome(check, "failed", why, shown, seconds, tail=tail)
    try:
        figures = check.figures(work) if check.figures else run_figures(work)
    except (OSError, KeyError, ValueError) as err:
        return Outcome(check, "failed", f"ran, but its figures could not be read: {err}", shown, seconds, tail=tail)
    if note:
        figures["note"] = note + ("; " + figures["note"] if "note" in figures else "")
    return Outcome(check, "ran", "", shown, seconds, figures)


def report(outcomes: list[Outcome], machine: Machine, seconds: float, quick: bool) -> str:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    counts = {s: sum(o.status == s for o in outcomes) for s in ("ran", "failed", "skipped")}
    lines = [
        "# trainloop GPU check", "",
        f"- machine: {machine.name}" + (f", compute capability {machine.capability[0]}.{machine.capability[1]}"
                                        if machine.capability else ""),
        f"- commit {commit.stdout.strip() or '?'}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
        f"{seconds:.0f} s in all" + (" (--quick)" if quick else ""),
        f"- {counts['ran']} ran, {counts['failed']} failed, {counts['skipped']} skipped", "",
        "| check | status | s | tokens/s | peak memory | MFU | loss | note |",
        "|---|---|---:|---|---|---|---|---|",
    ]
    for o in outcomes:
        f = o.figures
        note = o.why if o.status != "ran" else f.get("note", "")
        lines.append(f"| {o.check.name} | {o.status} | {o.seconds:.0f} | {f.get('tokens/s', '')} | "
                     f"{f.get('peak memory', '')} | {f.get('MFU', '')} | {f.get('loss', '')} | {note.replace('|', '/')} |")
    lines += ["", "## What each check runs", ""]
    for o in outcomes:
        lines.append(f"- **{o.check.name}** ({o.status}): {o.check.shows}"
                     + (f"\n  `{o.command}`" if o.command else ""))
    failed = [o for o in outcomes if o.status == "failed"]
    if failed:
        lines += ["", "## Failures", ""]
        for o in failed:
            lines += [f"### {o.check.name}: {o.why}", "", f"`{o.command}`", "", "```", o.tail, "```", ""]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO / "gpu_check", help="the report and each check's run go here")
    parser.add_argument("--only", nargs="*", help="check names to run (the others are reported as skipped)")
    parser.add_argument("--quick", action="store_true", help="the CPU form CI runs: two checks, the rest skipped")
    parser.add_argument("--budget", type=float, default=480, help="seconds for all checks together")
    args = parser.parse_args(argv)
    unknown = set(args.only or ()) - {c.name for c in CHECKS}
    if unknown:
        parser.error(f"no such check: {', '.join(sorted(unknown))}; the checks: {', '.join(c.name for c in CHECKS)}")
    args.out.mkdir(parents=True, exist_ok=True)
    machine = read_machine()
    start = time.monotonic()
    outcomes = []
    for check in CHECKS:
        if args.only is not None and check.name not in args.only:
            outcomes.append(Outcome(check, "skipped", "not in --only"))
            continue
        outcome = run_check(check, machine, args.out, args.quick, args.budget - (time.monotonic() - start))
        reference = next((o for o in outcomes if o.check.name == check.compare_to), None)
        if reference is not None and "peak bytes" in reference.figures and "peak bytes" in outcome.figures:
            ratio = f"peak memory x{outcome.figures['peak bytes'] / reference.figures['peak bytes']:.2f} of {reference.check.name}'s"
            outcome.figures["note"] = "; ".join(filter(None, [outcome.figures.get("note"), ratio]))
        print(f"{check.name:28s} {outcome.status:8s} {outcome.seconds:5.0f} s  {outcome.why}", flush=True)
        outcomes.append(outcome)
    path = args.out / "gpu_check_report.md"
    path.write_text(report(outcomes, machine, time.monotonic() - start, args.quick))
    print(f"report: {path}")
    return 1 if any(o.status == "failed" for o in outcomes) else 0


if __name__ == "__main__":
    sys.exit(main())
