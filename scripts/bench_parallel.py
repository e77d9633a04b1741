"""DDP, ZeRO-3, FSDP2, FSDP2 x TP, pipelines and context parallelism on N processes, measured in one
invocation on this machine.

    python scripts/bench_parallel.py [--nproc 2] [--warmup 2] [--steps 3] [--only ddp fsdp]
                                     [--json OUT] [overrides ...]

Each strategy (DDP, ZeRO-3 with DeepSpeed's default buckets and with 5M-element ones, FSDP2, FSDP2
with tensor parallelism over 2 of the processes, a pipeline of N stages under 1F1B and GPipe, and
2 stages with FSDP2 over the rest) is
one `torchrun --nproc_per_node N` launch of this script (gloo on CPU, NCCL on
GPUs) training the same model (default: a 57M-parameter Llama, 6 blocks of 768, fp32 AdamW) on
the same batch of 2 x 128 tokens per process, through trainloop's own builders
(trainloop.tools.measure.measure_training: DDP and DeepSpeed ZeRO-3 through accelerate, FSDP2 through
trainloop.parallel.sharding, as run.py prepares them). Per process, the largest over the processes:
  - training peak: over the warm-up steps, on CPU the peak resident set (VmHWM, reset through
    /proc/self/clear_refs just before the model is built) minus the resident set at that moment,
    with glibc unmapping freed tensors so that the resident set follows the live ones; on a GPU
    torch.cuda.max_memory_allocated. Parameters, gradients, optimizer state, gathered blocks,
    activations and the full model each process builds before it is sharded; not the libraries;
  - peak RSS: the whole process's peak resident set at the end (python, torch, the data and the
    libraries included; glibc's usual heap in the timed steps);
  - planned: `python -m trainloop.plan`'s prediction of the training peak for the same config;
  - tokens/s: the global batch's tokens over the median wall-clock time of the timed steps.
Ratios are against DDP's figures of this same invocation; the context-parallel rows' (one sequence of
8,192 tokens per data-parallel rank, 4 blocks) against cp 1's; the mixture's (MOE: 8 experts) at ep 2 against
FSDP2 alone's on the same mixture.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MODEL = ["model.num_layers=6", "model.hidden_size=768", "model.num_heads=12", "data.seq_len=128",
         "data.batch_size=2", "optimizer=adamw", "precision=fp32", "trainer.gradient_accumulation_steps=1"]
LONG = ["model.num_layers=4", "data.seq_len=8192", "model.max_position_embeddings=8192", "data.batch_size=1",
        "data.packing=stream", "data.validation_fraction=0.1"]
# a mixture whose experts are most of it: 2 blocks of 512, 8 experts of 2,048 each, top 2 (51M parameters, 50M
# of them in the experts)
MOE = ["model.arch=mixtral", "model.num_experts=8", "model.num_layers=2", "model.hidden_size=512",
       "model.num_heads=8", "model.intermediate_size=2048"]
PIPELINE = ["model.tie_embeddings=false", "parallel.pp_size={nproc}", "trainer.gradient_accumulation_steps={micro}"]
# name -> (label, preset, the strategy's own overrides; {nproc}: the processes, {micro}: 2 per process)
STRATEGIES = {
    "ddp": ("DDP", "ddp", []),
    "zero3": ("DeepSpeed ZeRO-3", "zero3", []),
    # DeepSpeed's default buckets (500M elements reduced, 50M prefetched) hold more than a small model
    "zero3_small_buckets": ("DeepSpeed ZeRO-3, buckets of 5M elements", "zero3",
                            ["deepspeed.reduce_bucket_size=5000000", "deepspeed.stage3_prefetch_bucket_size=5000000"]),
    "fsdp": ("FSDP2 (fully_shard)", "fsdp", []),
    # parallel.tp_size=2: on 2 processes 1 dp_shard x 2 tp, on 4 processes 2 x 2
    "tp": ("FSDP2 x TP (parallel.tp_size=2)", "tp", []),
    "tp_sp": ("FSDP2 x TP + sequence parallelism", "tp", ["parallel.sequence_parallel=true"]),
    # parallel.pp_size = the processes (one stage each), 2 micro-batches per stage a step (the pipeline's
    # step needs at least one per stage); the embeddings untied (a stage holds one of them: 0.4% of this model)
    "pp_1f1b": ("pipeline, 1F1B (parallel.pp_size=N)", "ddp", PIPELINE),
    "pp_gpipe": ("pipeline, GPipe (parallel.pp_size=N)", "ddp", [*PIPELINE, "parallel.pp_schedule=gpipe"]),
    # 2 stages, FSDP2 over the other N / 2 processes (dp_shard), 4 micro-batches: each one's gradients
    # reduce-scattered into the shards (fsdp.sync_each_batch=true), or the stage's unsharded ones held
    # and reduce-scattered once, after the last (false: torch's PipelineStage's own way)
    "pp2_fsdp": ("pipeline 2 stages x FSDP2 (dp_shard N/2)", "fsdp",
                 ["model.tie_embeddings=false", "parallel.pp_size=2", "trainer.gradient_accumulation_steps=4"]),
    "pp2_fsdp_once": ("the same, reduce-scattered once a step", "fsdp",
                      ["model.tie_embeddings=false", "parallel.pp_size=2", "trainer.gradient_accumulation_steps=4",
                       "fsdp.sync_each_batch=false"]),
    # context parallelism at a long sequence: 4 blocks, one sequence of 8,192 tokens per data-parallel rank
    # (a stream of tokens: sdpa's causal kernel, no mask), its ranks each holding 1/cp of it; compared
    # with cp 1 (DDP) on the same processes. --nproc 4 for cp 4
    "cp1": ("8,192 tokens: DDP (parallel.cp_size=1)", "ddp", LONG),
    "cp2": ("8,192 tokens: context parallel, cp_size=2", "ddp", [*LONG, "parallel.cp_size=2"]),
    "cp4": ("8,192 tokens: context parallel, cp_size=4", "ddp", [*LONG, "parallel.cp_size=4"]),
    # expert parallelism on the mixture: FSDP2 alone gathers every block's 8 experts; at ep 2 each process
    # holds 4 of them whole and the tokens come to them (all-to-all); against FSDP2 alone on the same processes
    "moe_fsdp": ("mixture, 8 experts: FSDP2", "fsdp", MOE),
    "moe_ep2": ("mixture, 8 experts: FSDP2 x EP (parallel.ep_size=2)", "ep", MOE),
}
# the row each row's ratios are against; the others: ddp
BASELINE = {"cp1": "cp1", "cp2": "cp1", "cp4": "cp1", "moe_fsdp": "moe_fsdp", "moe_ep2": "moe_fsdp"}


def worker(name: str, warmup: int, steps: int, overrides: list[str]) -> dict:
    from trainloop.config.compose import compose_config
    from trainloop.tools.measure import measure_training
    from trainloop.tools.plan import compare, plan_memory
    from trainloop.tools.shape import model_shape

    _, preset, own = STRATEGIES[name]
    nproc = int(os.environ.get("WORLD_SIZE", "1"))
    own = [o.format(nproc=nproc, micro=2 * nproc) for o in own]
    cfg = compose_config([f"+preset={preset}", *MODEL, *own, *overrides])
    measured = measure_training(cfg, warmup, timed_steps=steps)
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    world = len(measured.get("per_process", [measured]))
    plan = plan_memory(cfg, model_shape(cfg), world, device)
    return {"num_params": plan.num_params, "world_size": world, "device": device, **compare(plan, measured)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_strategy(name: str, nproc: int, warmup: int, steps: int, overrides: list[str]) -> dict:
    torchrun = str(Path(sys.executable).parent / "torchrun")
    cmd = [torchrun, "--nproc_per_node", str(nproc), "--master_addr", "127.0.0.1", "--master_port",
           str(free_port()), __file__, "--worker", name, "--warmup", str(warmup), "--steps", str(steps),
           "--", *overrides]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "HF_DATASETS_DISABLE_PROGRESS_BARS": "1", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env, timeout=3600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = proc.stderr.strip().splitlines()[-3:] if proc.stderr.strip() else []
        return {"failed": f"exit {proc.returncode}: " + " | ".join(tail)[-400:]}
    return json.loads(lines[-1])


def summary(result: dict) -> dict:
    """The largest figure over the processes, and the median step."""
    procs = result["per_process"]
    gpu = "gpu_training_bytes" in procs[0]
    seconds = statistics.median(s for p in procs for s in p["step_seconds"])
    return {"training_peak": max(p["gpu_training_bytes" if gpu else "cpu_training_bytes"] for p in procs),
            "peak_rss": max(p["peak_rss"] for p in procs), "rss_before": max(p["rss_before"] for p in procs),
            "planned": max(p["predicted_bytes"] for p in procs), "tokens_per_s": procs[0]["tokens_per_step"] / seconds,
            "step_s": seconds, "memory_kind": "torch.cuda.max_memory_allocated" if gpu else
            "VmHWM - VmRSS before the model (glibc unmaps freed tensors)"}


def mib(n: float) -> str:
    return f"{n / 2**20:,.0f} MiB"


def table(results: dict[str, dict]) -> str:
    """Each row's ratios against DDP's of the same invocation (the context-parallel rows': against cp 1's, the
    mixture's against FSDP2's on it)."""
    lines = ["| strategy | tokens/s | training peak per process | vs DDP | planned | peak RSS per process | vs DDP "
             "| RSS before the model |", "|---|---|---|---|---|---|---|---|"]
    for name, result in results.items():
        if "failed" in result:
            lines.append(f"| {STRATEGIES[name][0]} | failed: {result['failed']} | | | | | | |")
            continue
        s = summary(result)
        base = results.get(BASELINE.get(name, "ddp"))
        base = summary(base) if base and "failed" not in base else None
        ratio = (lambda k: f"{s[k] / base[k]:.2f}x") if base else (lambda k: "-")
        lines.append(f"| {STRATEGIES[name][0]} | {s['tokens_per_s']:,.0f} | {mib(s['training_peak'])} | "
                     f"{ratio('training_peak')} | {mib(s['planned'])} | {mib(s['peak_rss'])} | {ratio('peak_rss')} | "
                     f"{mib(s['rss_before'])} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2, help="processes per strategy")
    parser.add_argument("--warmup", type=int, default=2,
                        help="untimed steps first, at least 2 (the second is the first with optimizer state); "
                             "the training peak is measured over them")
    parser.add_argument("--steps", type=int, default=3, help="timed steps after the warm-up")
    parser.add_argument("--only", nargs="*", choices=sorted(STRATEGIES), help="strategies to run (default: all)")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--worker", choices=sorted(STRATEGIES), help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", help="config overrides on top of the benchmark model")
    args = parser.parse_args()
    if args.warmup < 2:
        parser.error("--warmup must be at least 2: the second step is the first with optimizer state in memory")
    if args.worker:
        result = worker(args.worker, args.warmup, args.steps, args.overrides)
        if int(os.environ.get("RANK", "0")) == 0:
            print(json.dumps(result))
        return

    import torch

    started = time.time()
    command = "python scripts/bench_parallel.py " + " ".join(sys.argv[1:])
    results = {}
    for name in (n for n in STRATEGIES if not args.only or n in args.only):
        results[name] = run_strategy(name, args.nproc, args.warmup, args.steps, args.overrides)
        r = results[name]
        print(f"{STRATEGIES[name][0]:42s} " + (f"failed: {r['failed']}" if "failed" in r else
              "{tokens_per_s:9,.0f} tokens/s  training peak {tp}  peak RSS {rss}".format(
                  tp=mib(summary(r)["training_peak"]), rss=mib(summary(r)["peak_rss"]), **summary(r))), flush=True)
    done = next((r for r in results.values() if "failed" not in r), None)
    on_cuda = torch.cuda.is_available()
    machine = (torch.cuda.get_device_name() if on_cuda else
               f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)")
    print()
    print(f"trainloop bench_parallel: {machine}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}, "
          f"{args.nproc} processes ({'nccl' if on_cuda else 'gloo'}), "
          + (f"model {done['num_params'] / 1e6:.1f}M parameters, " if done else "")
          + f"{args.warmup} warm-up + {args.steps} timed steps, {time.time() - started:.0f} s in all, "
          f"load average at the end {os.getloadavg()[0]:.1f}")
    print(f"command: {command}")
    if done:
        print(f"training peak = {summary(done)['memory_kind']}; peak RSS = the whole process (VmHWM)")
    print()
    print(table(results))
    if args.json:
        Path(args.json).write_text(json.dumps({
            "command": command, "machine": machine, "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
            "nproc": args.nproc, "warmup": args.warmup, "steps": args.steps, "overrides": [*MODEL, *args.overrides],
            "results": {n: {**r, **({} if "failed" in r else {"summary": summary(r)})} for n, r in results.items()},
        }, indent=2))


if __name__ == "__main__":
    main()
