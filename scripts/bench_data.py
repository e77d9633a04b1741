"""Data at pre-training scale, measured in one invocation on this machine.

    python scripts/bench_data.py [--big-mb 1024] [--small-mb 10] [--throughput-mb 100] [--steps 50]
                                 [--num-proc N] [--workdir DIR] [--json OUT]

1. Generates text corpora (jsonl, one document per row) of --small-mb, --throughput-mb and
   --big-mb: documents of 1-8 KB cut from Python's own documentation at seeded offsets, so the
   tokens are real text.
2. Prepare throughput on the --throughput-mb corpus: `python -m trainloop.prepare` (tokenize with
   `datasets.map` over --num-proc processes, write the memory-mapped shards) against
   `datasets.map` alone with the same tokenizer function and processes (the tokens, not written
   as shards). Tokens/s, and per process. Each command gets a fresh `datasets` cache, so neither
   reads the other's work. The big corpus's prepare is timed too.
3. Training from shards: the same run (the default tiny model, --steps steps, batch 8 x 128
   tokens) from the prepared small and big corpora, each in a fresh process: its peak resident set
   (the kernel's ru_maxrss for that process) and the share of step time spent waiting for data
   (`data_wait_frac` in metrics.jsonl). The big run's peak RSS is given as a ratio to the small's.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RUN = ["data.seq_len=128", "data.batch_size=8", "trainer.log_every=1", "trainer.eval_every=1000000",
       "trainer.eval_batches=4", "checkpoint.every_steps=null", "checkpoint.save_final_model=false",
       "logging.progress_bar=false"]


def write_corpus(folder: Path, megabytes: int, seed: int = 0) -> int:
    """Documents of 1-8 KB cut from pydoc's topics at seeded offsets, 64 MB per jsonl file; bytes written."""
    from pydoc_data.topics import topics

    source = "\n\n".join(topics[k] for k in sorted(topics))
    rng, written, target = random.Random(seed), 0, megabytes * 2**20
    folder.mkdir(parents=True, exist_ok=True)
    part, out = 0, None
    while written < target:
        if out is None or out.tell() > 64 * 2**20:
            if out:
                out.close()
            out, part = open(folder / f"part_{part:04d}.jsonl", "w"), part + 1
        length = rng.randint(1024, 8192)
        start = rng.randrange(len(source) - length)
        line = json.dumps({"text": source[start:start + length]}) + "\n"
        out.write(line)
        written += len(line)
    out.close()
    return written


def child_env(cache: Path) -> dict:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_CACHE": str(cache), "TOKENIZERS_PARALLELISM": "false",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}


def timed(args: list[str], env: dict, log: Path) -> tuple[float, int]:
    """Run a command to the end; its wall time and its own peak RSS in bytes (wait4's rusage)."""
    start = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen(args, env=env, stdout=out, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
    elapsed = time.perf_counter() - start
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        sys.exit(f"{' '.join(args)} exited {code}; the end of {log}:\n{log.read_text()[-3000:]}")
    return elapsed, usage.ru_maxrss * 1024


MAP_ALONE = """
import sys
from trainloop.config.compose import compose_config
from trainloop.data.loaders import build_tokenizer, load_examples, tokenize_examples
cfg = compose_config(sys.argv[1:])
tokens = tokenize_examples(cfg.data, build_tokenizer(None, None), load_examples(cfg.data))
print(sum(len(t["input_ids"].combine_chunks().flatten()) for t in tokens.with_format("arrow").iter(10000)))
"""


def load_once(corpus: Path, data: list[str], cache: Path, work: Path) -> None:
    """Read the jsonl into `datasets`' Arrow cache: the same for every command after it, done first."""
    timed([sys.executable, "-c", "import sys\nfrom trainloop.config.compose import compose_config\n"
           "from trainloop.data.loaders import load_examples\nload_examples(compose_config(sys.argv[1:]).data)", *data],
          child_env(cache), work / f"load_{corpus.name}.log")


def prepare(corpus: Path, out: Path, num_proc: int, work: Path, cache: Path) -> tuple[float, dict]:
    data = ["data=files", f"data.path={corpus}", f"data.num_proc={num_proc}"]
    seconds, _ = timed([sys.executable, "-m", "trainloop.prepare", str(out), "--no-progress", *data],
                       child_env(cache), work / f"prepare_{out.name}.log")
    return seconds, json.loads((out / "manifest.json").read_text())


def prepare_throughput(corpus: Path, work: Path, num_proc: int) -> dict:
    data = ["data=files", f"data.path={corpus}", f"data.num_proc={num_proc}"]
    load_once(corpus, data, work / "cache_load", work)
    shutil.copytree(work / "cache_load", work / "cache_map")
    shutil.copytree(work / "cache_load", work / "cache_prepare")
    map_s, _ = timed([sys.executable, "-c", MAP_ALONE, *data], child_env(work / "cache_map"), work / "map.log")
    tokens = int((work / "map.log").read_text().split()[-1])
    prep_s, manifest = prepare(corpus, work / "throughput_shards", num_proc, work, work / "cache_prepare")
    assert manifest["tokens"] == tokens, (manifest["tokens"], tokens)
    return {"tokens": tokens, "num_proc": num_proc, "map_alone_s": map_s, "prepare_s": prep_s,
            "map_alone_tokens_per_s": tokens / map_s, "prepare_tokens_per_s": tokens / prep_s,
            "prepare_vs_map_alone": map_s / prep_s}


def evict(folder: Path) -> None:
    """Drop a folder's files from the page cache, so that a run reads them from disk as a corpus
    larger than RAM would be (posix_fadvise DONTNEED: no root needed; clean pages only)."""
    for path in folder.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def train_from(shards: Path, steps: int, work: Path, name: str, num_workers: int) -> dict:
    run_dir = work / f"run_{name}"
    shutil.rmtree(run_dir, ignore_errors=True)
    evict(shards)
    args = [sys.executable, "-m", "trainloop", "data=prepared", f"data.path={shards}", *RUN,
            f"data.num_workers={num_workers}", f"trainer.max_steps={steps}", f"hydra.run.dir={run_dir}"]
    wall, peak = timed(args, child_env(work / "cache_train"), work / f"train_{name}.log")
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    waits = [r["data_wait_frac"] for r in lines if "data_wait_frac" in r]
    # the first step also waits for the first batch: reported apart
    return {"peak_rss_mb": peak / 2**20, "wall_s": wall, "data_wait_frac_max": max(waits[1:]),
            "data_wait_frac_mean": sum(waits[1:]) / len(waits[1:]), "data_wait_frac_first_step": waits[0],
            "steps": len(waits), "num_workers": num_workers}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--big-mb", type=int, default=1024)
    parser.add_argument("--small-mb", type=int, default=10)
    parser.add_argument("--throughput-mb", type=int, default=100)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--num-workers", type=int, default=2, help="DataLoader workers of the training runs")
    parser.add_argument("--train-only", action="store_true",
                        help="reuse the corpora and shards of an earlier run in --workdir; only train")
    parser.add_argument("--num-proc", type=int, default=os.cpu_count())
    parser.add_argument("--workdir", type=Path, help="keep the corpora, shards and logs here (default: a temp dir)")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="bench_data_"))
    work.mkdir(parents=True, exist_ok=True)
    results = {"command": " ".join(["python", "scripts/bench_data.py", *sys.argv[1:]]),
               "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
               "date": time.strftime("%Y-%m-%d")}
    if not args.train_only:
        for name, mb in (("small", args.small_mb), ("throughput", args.throughput_mb), ("big", args.big_mb)):
            written = write_corpus(work / f"{name}_corpus", mb, seed=mb)
            results[f"{name}_corpus_mb"] = written / 2**20
            print(f"{name} corpus: {written / 2**20:.0f} MB of text in {work / f'{name}_corpus'}", flush=True)
        results["prepare"] = p = prepare_throughput(work / "throughput_corpus", work, args.num_proc)
        print(f"prepare {p['tokens']:,} tokens: {p['prepare_tokens_per_s']:,.0f} tokens/s "
              f"({p['prepare_tokens_per_s'] / p['num_proc']:,.0f} per process, {p['num_proc']} processes); "
              f"datasets.map alone {p['map_alone_tokens_per_s']:,.0f} tokens/s; "
              f"prepare/map-alone speed {p['prepare_vs_map_alone']:.2f}", flush=True)
        for name in ("small", "big"):
            seconds, manifest = prepare(work / f"{name}_corpus", work / f"{name}_shards", args.num_proc, work,
                                        work / f"cache_{name}")
            results[f"prepare_{name}"] = {"s": seconds, "tokens": manifest["tokens"], "shards": len(manifest["shards"]),
                                          "tokens_per_s": manifest["tokens"] / seconds}
            print(f"prepared the {name} corpus: {manifest['tokens']:,} tokens in {seconds:.0f} s "
                  f"({manifest['tokens'] / seconds:,.0f} tokens/s, loading the jsonl included)", flush=True)
    for name in ("small", "big"):
        results[f"train_{name}"] = r = train_from(work / f"{name}_shards", args.steps, work, name, args.num_workers)
        print(f"train {args.steps} steps from the {name} corpus ({args.num_workers} workers, shards not in the page cache): peak RSS {r['peak_rss_mb']:.0f} MB, "
              f"data wait {100 * r['data_wait_frac_mean']:.2f}% of step time (max {100 * r['data_wait_frac_max']:.2f}%)",
              flush=True)
    results["peak_rss_big_over_small"] = results["train_big"]["peak_rss_mb"] / results["train_small"]["peak_rss_mb"]
    print(f"peak RSS, big corpus / small corpus: {results['peak_rss_big_over_small']:.3f}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    if args.workdir is None:
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
