"""Attention over packed documents: the dense block-causal mask against trainloop's document attention
(trainloop/model/attention.py, issue 61), measured in one invocation on this machine.

    python scripts/bench_attention.py [--parts kernel run cp] [--lengths 2048 8192 32768] [--steps 3]
                                      [--repeat N] [--json OUT]

Three parts (kernel and run by default), each case in a fresh process, so that each has its own peak memory:
  - the kernel: the smoke preset's model (2 blocks, 64 wide, fp32; on a CUDA GPU where there is one, under
    bf16 autocast, the flash kernels' precision, its peak then torch's allocated memory, and a third path,
    "loop", sdpa once a document, beside the one varlen kernel the documents take) on one block of the
    default corpus's packed documents, a training step (forward and backward) at each length, through transformers' sdpa
    with its dense mask (it reads the packed rows from the position ids and builds a (seq x seq) mask) and
    through the document attention. Tokens/s over the median of the timed steps; peak memory over the
    steps: the peak resident set (VmHWM, reset just before the first step) minus the resident set then,
    with glibc told to give every allocation of 64 KiB or more its own mapping, so that freed tensors leave
    the resident set. A dense case whose mask would not fit in half the memory the system has left gets a
    row that says so;
  - the run (issue 61's first acceptance check): `python -m trainloop +preset=smoke` at 4,096, 8,192 and
    16,384 tokens, its peak resident set measured from outside (wait4's ru_maxrss): the growth from 8k to
    16k over the growth from 4k to 8k, 2 where memory is linear in the sequence, 4 where a (seq x seq) term
    leads. With the run's own malloc (jemalloc, which `python -m trainloop` preloads where it is installed:
    trainloop/__main__.py) at 1 (the issue's size), 2 and 4 blocks a step; at 1 with glibc's heap
    (TRAINLOOP_MALLOC=glibc: it keeps what is freed and fits later tensors into its holes as the order of the
    allocations allows, so the ratio wanders from run to run) and with glibc giving every tensor its own
    mapping, whose resident set is the live tensors'; each `--repeat` times, and then the ratio of each
    length's median peak;
  - cp (the second check): the issue's run for it, 4 blocks 512 wide (model.num_layers=4
    model.hidden_size=512 on the smoke preset: the size whose dense-mask figures the issue gives, 3,286 and
    2,348 MiB, x0.71; measured again here at af8e0f0, 3,176 and 2,186 MiB, x0.69), one block a step, under
    FSDP2 on one process and with parallel.cp_size=2 on two, at 512 and 8,192 tokens, the run's own malloc:
    each rank's growth over one process's, `--repeat` times.
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

from trainloop.__main__ import with_trainloops_malloc

REPO = Path(__file__).resolve().parent.parent
PATHS = ("dense", "documents")  # and on a CUDA GPU "loop": sdpa once a document, what fp32 or an older torch takes
RUN = {k: v for k, v in os.environ.items() if k not in ("MALLOC_MMAP_THRESHOLD_", "TRAINLOOP_MALLOC")}  # a user's run
GLIBC = {**RUN, "TRAINLOOP_MALLOC": "glibc"}  # glibc's own heap
LIVE = {**GLIBC, "MALLOC_MMAP_THRESHOLD_": str(64 * 1024)}  # every tensor mapped: the resident set is the live one
LENGTHS = (4096, 8192, 16384)
CP_MODEL = ("model.num_layers=4", "model.hidden_size=512")  # the "4 blocks of 512" for its second check


def one_case(path: str, length: int, steps: int) -> dict:
    """A training step of the smoke model on one packed block of `length` tokens, through `path`: on a CUDA GPU
    where there is one (peak: torch's allocated memory), else on one CPU thread (peak: the resident set)."""
    import torch
    from transformers import AutoModelForCausalLM

    from trainloop.config.compose import compose_config
    from trainloop.data.loaders import build_datasets, build_tokenizer
    from trainloop.memory.proc import reset_peak_rss, status_bytes
    from trainloop.model.attention import SDPA_DOCUMENTS, documents_of, use
    from trainloop.model.builder import build_model_config

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    torch.set_num_threads(1)
    cfg = compose_config(["+preset=smoke", f"data.seq_len={length}", f"model.max_position_embeddings={length}"])
    tokenizer = build_tokenizer(None, None)
    blocks, _ = build_datasets(cfg.data, tokenizer, cfg.trainer.seed)
    positions = blocks.tensors["position_ids"]
    block = int(documents_of(positions)[:, -1].argmax())  # the block of the most documents
    batch = blocks.__getitems__([block])
    if "documents" not in batch:
        raise SystemExit(f"no block of the default corpus holds two documents at {length} tokens")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(build_model_config(cfg.model, len(tokenizer)), attn_implementation="sdpa")
    model.to(device)
    inputs = {key: batch[key].to(device) for key in ("input_ids", "position_ids", "labels")}
    if path in ("documents", "loop"):
        use(model, SDPA_DOCUMENTS, "the benchmark")
        inputs["documents"] = batch["documents"]  # on the host, where the loop leaves it
    if path == "loop":  # this process only: the per-document loop where varlen would run
        import trainloop.model.attention as attention

        attention._varlen_attn = None
    times = []
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
    else:
        start = status_bytes("VmRSS")
        reset_peak_rss()
    for _ in range(steps + 1):
        begin = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda):  # the flash kernels' precision
            loss = model(**inputs).loss
        loss.backward()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - begin)
    peak = torch.cuda.max_memory_allocated() if cuda else status_bytes("VmHWM")
    return {"path": path, "tokens": length, "documents": int(batch["documents"].max()) + 1, "device": str(device),
            "tokens_per_s": length / statistics.median(times[1:]), "peak_bytes": peak - start}


def child(args: list[str], env: dict = LIVE, timeout: float = 1800) -> tuple[int, str, int]:
    """Run `args`; (exit code, stdout, its peak resident set in bytes as the kernel counts it, of it and the
    processes it waited for)."""
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, env=env)
        deadline = time.monotonic() + timeout
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.monotonic() > deadline:
                proc.kill()
                pid, status, usage = os.wait4(proc.pid, 0)
                break
            time.sleep(0.2)
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        return proc.returncode, out.read(), usage.ru_maxrss * 1024


def kernel_rows(lengths: list[int], steps: int) -> list[dict]:
    import torch

    from trainloop.memory.proc import mem_available

    rows = []
    for length in lengths:
        for path in PATHS + (("loop",) if torch.cuda.is_available() else ()):
            mask = 4 * length * length  # sdpa's additive float mask, one row
            if path == "dense" and not torch.cuda.is_available() and 2 * mask > (mem_available() or 0) / 2:
                rows.append({"path": path, "tokens": length,
                             "skipped": f"its mask alone ({mask / 2**30:.1f} GiB, kept by each layer too) would not "
                                        "fit in half the memory this machine has left"})
                continue
            code, out, _ = child([sys.executable, __file__, "--one", path, str(length), "--steps", str(steps)])
            line = [x for x in out.splitlines() if x.startswith("{")]
            rows.append(json.loads(line[-1]) if code == 0 and line else
                        {"path": path, "tokens": length, "skipped": f"exit {code}: {out.strip()[-300:]}"})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def run_peak(length: int, *overrides: str, presets: str = "smoke", processes: int = 1, batch: int = 2,
             env: dict = RUN) -> int:
    """Peak resident set of a 2-step trainloop run at `length` tokens, `batch` blocks a step, measured from
    outside."""
    with tempfile.TemporaryDirectory() as run_dir:
        launcher = ([sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={processes}",
                     "--master_port=29661", "-m", "trainloop"] if processes > 1 else [sys.executable, "-m", "trainloop"])
        code, out, peak = child([*launcher, f"+preset={presets}", f"data.seq_len={length}",
                                 f"model.max_position_embeddings={length}", f"data.batch_size={batch}",
                                 "trainer.max_steps=2", "trainer.eval_every=2", "trainer.eval_batches=1",
                                 "checkpoint.save_final_model=false", "logging.progress_bar=false", *overrides,
                                 f"hydra.run.dir={run_dir}"], env)
        if code != 0:
            raise SystemExit(f"the run at {length} tokens failed (exit {code}):\n{out[-2000:]}")
        return peak


# what python -m trainloop takes in RUN (trainloop/__main__.py)
RUN_MALLOC = "jemalloc" if "jemalloc" in with_trainloops_malloc(RUN).get("LD_PRELOAD", "") else "glibc"
HEAPS = {"run": f"the run's own malloc ({RUN_MALLOC})", "glibc": "glibc's own heap (TRAINLOOP_MALLOC=glibc)",
         "live": "every tensor of 64 KiB or more mapped (MALLOC_MMAP_THRESHOLD_=65536): the live tensors"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192, 32768])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=1,
                        help="measure each case of the run and cp parts this many times")
    parser.add_argument("--parts", nargs="+", choices=("kernel", "run", "cp"), default=["kernel", "run"])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--one", nargs=2, metavar=("PATH", "LENGTH"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(one_case(args.one[0], int(args.one[1]), args.steps)))
        return 0

    report = {}
    if "kernel" in args.parts:
        report["kernel"] = kernel_rows(args.lengths, args.steps)
        print_kernel(report["kernel"], args.lengths)
    if "run" in args.parts:
        report["run"] = []
        print("\ntrainloop, one process, the smoke model (2 blocks of 64), peak RSS from outside; growth 8k->16k "
              "over growth 4k->8k (linear: 2, quadratic: 4; the check: at most 2.3)")
        envs = {"run": RUN, "glibc": GLIBC, "live": LIVE}
        for batch, heap in [case for case in ((1, "run"), (2, "run"), (4, "run"), (1, "glibc"), (1, "live"))
                            for _ in range(args.repeat)]:
            peaks = {n: run_peak(n, batch=batch, env=envs[heap]) for n in LENGTHS}
            growth = (peaks[16384] - peaks[8192]) / (peaks[8192] - peaks[4096])
            report["run"].append({"batch": batch, "heap": heap, "peak_bytes": peaks, "growth_ratio": growth})
            print(f"  data.batch_size={batch}, {HEAPS[heap]}: " +
                  ", ".join(f"{k:,} tokens {v / 2**30:.3f} GiB" for k, v in peaks.items()) + f"; x{growth:.2f}",
                  flush=True)
        if args.repeat > 1:  # with glibc's heap one length's peak wanders by 20 to 100 MB: its median over the runs
            print(f"  each length's median peak over the {args.repeat} runs:")
            for batch, heap in dict.fromkeys((r["batch"], r["heap"]) for r in report["run"]):
                runs = [r["peak_bytes"] for r in report["run"] if (r["batch"], r["heap"]) == (batch, heap)]
                mid = {n: statistics.median(run[n] for run in runs) for n in LENGTHS}
                growth = (mid[16384] - mid[8192]) / (mid[8192] - mid[4096])
                report.setdefault("run_median", []).append({"batch": batch, "heap": heap, "peak_bytes": mid,
                                                            "growth_ratio": growth})
                print(f"  data.batch_size={batch}, {HEAPS[heap]}: " +
                      ", ".join(f"{k:,} tokens {v / 2**30:.3f} GiB" for k, v in mid.items()) + f"; x{growth:.2f}")
    if "cp" in args.parts:
        report["cp"] = []
        print(f"\nFSDP2, {' '.join(CP_MODEL)}, one block a step, {HEAPS['run']}: growth from 512 to 8,192 tokens "
              "of one process and of each rank of parallel.cp_size=2 (the check: at most 0.6x)")
        for _ in range(args.repeat):
            one = {n: run_peak(n, *CP_MODEL, presets="[smoke,fsdp]", batch=1) for n in (512, 8192)}
            split = {n: run_peak(n, *CP_MODEL, "parallel.cp_size=2", presets="[smoke,fsdp]", processes=2, batch=1)
                     for n in (512, 8192)}
            share = (split[8192] - split[512]) / (one[8192] - one[512])
            report["cp"].append({"one_process": one, "cp2_rank": split, "share": share})
            print(f"  one process {(one[8192] - one[512]) / 2**20:,.0f} MiB, each rank of cp=2 "
                  f"{(split[8192] - split[512]) / 2**20:,.0f} MiB: x{share:.2f}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


def print_kernel(rows: list[dict], lengths: list[int]) -> None:
    loop = any(r["path"] == "loop" for r in rows)
    print("\n| tokens | documents | dense tokens/s | documents tokens/s | documents/dense | dense peak | documents peak |"
          + (" loop tokens/s |" if loop else ""))
    print("|---:|---:|---:|---:|---:|---:|---:|" + ("---:|" if loop else ""))
    for length in lengths:
        dense, documents = (next(r for r in rows if r["tokens"] == length and r["path"] == path)
                            for path in PATHS)
        cells = [f"{length:,}", str(documents.get("documents", ""))]
        for row in (dense, documents):
            cells.append(row["skipped"] if "skipped" in row else f"{row['tokens_per_s']:,.0f}")
        measured = "skipped" not in dense and "skipped" not in documents
        cells.append(f"x{documents['tokens_per_s'] / dense['tokens_per_s']:.2f}" if measured else "")
        cells += ["" if "skipped" in row else f"{row['peak_bytes'] / 2**20:,.0f} MiB" for row in (dense, documents)]
        loop = next((r for r in rows if r["tokens"] == length and r["path"] == "loop"), None)
        if loop is not None:  # a GPU: the varlen kernel against sdpa once a document
            cells.append(loop.get("skipped") or f"{loop['tokens_per_s']:,.0f} (documents x"
                                                 f"{documents.get('tokens_per_s', 0) / loop['tokens_per_s']:.2f})")
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    sys.exit(main())
