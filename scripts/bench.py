"""Does trainloop cost anything over a raw PyTorch loop, and how does it compare with the HF Trainer?

Trains the same model on the same data with the same hyperparameters three ways, each run in a
fresh process, alternating (raw, trainloop, hf, raw, ...) so the machine's drift hits all alike:
  raw        a minimal hand-written PyTorch loop (no accelerate, no Hydra)
  trainloop  `python -m trainloop` itself
  hf         transformers.Trainer
All three log the loss every step (one host sync per step each), so the comparison is fair.
Reports per variant the median tokens/s after warm-up, peak memory (CPU: the process's peak RSS;
GPU: torch.cuda.max_memory_allocated), and seconds from process start to the first optimizer
step; then the ratios trainloop/raw and trainloop/hf.

    python scripts/bench.py                       # CPU size, 3 rounds (about 5 minutes on 2 cores)
    python scripts/bench.py --size gpt2 --rounds 5  # GPT-2 124M shape on a GPU, bf16
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

SIZES = {
    # model/data/optimizer overrides shared by all three variants (trainloop syntax)
    "cpu": ["model.num_layers=4", "model.hidden_size=256", "model.num_heads=4", "data.seq_len=128",
            "data.batch_size=8"],
    "gpt2": ["model.arch=gpt2", "model.num_layers=12", "model.hidden_size=768", "model.num_heads=12",
             "data.seq_len=1024", "data.batch_size=16", "precision=bf16", "optimizer.impl=fused"],
}
COMMON = ["optimizer=adamw", "optimizer.lr=1e-3", "scheduler=cosine", "trainer.max_grad_norm=1.0",
          "trainer.seed=0", "data.num_workers=0"]


def compose(overrides: list[str]):
    from hydra import compose as hydra_compose, initialize_config_dir

    from trainloop.config import CONFIG_DIR, register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return hydra_compose(config_name="train", overrides=overrides)


def build_common(cfg):
    """The tokenizer, packed data and model every variant trains: trainloop's builders, which
    are thin wrappers over `datasets` and `transformers.AutoModelForCausalLM.from_config`."""
    import torch

    from trainloop.data import build_datasets, build_tokenizer
    from trainloop.model import build_model, build_model_config

    tokenizer = build_tokenizer(None, None)
    train_set, _ = build_datasets(cfg.data, tokenizer, cfg.trainer.seed)
    torch.manual_seed(cfg.trainer.seed)
    model = build_model(cfg.model, build_model_config(cfg.model, len(tokenizer)))
    return train_set, model


def worker_raw(cfg, steps: int, out: Path) -> None:
    import psutil
    import torch
    from transformers import get_scheduler

    from trainloop.optim import parameter_groups

    start = psutil.Process().create_time()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    train_set, model = build_common(cfg)
    model.to(device).train()
    opt = cfg.optimizer
    optimizer = torch.optim.AdamW(parameter_groups(model, opt.weight_decay), lr=opt.lr, betas=tuple(opt.betas),
                                  eps=opt.eps, fused=device == "cuda")
    scheduler = get_scheduler("cosine", optimizer, num_warmup_steps=0, num_training_steps=steps)
    loader = torch.utils.data.DataLoader(train_set, batch_size=cfg.data.batch_size, shuffle=True, drop_last=True)
    dtype = torch.bfloat16 if cfg.precision.name == "bf16" else None
    times, batches = [], iter(loader)
    for _ in range(steps):
        ids = next(batches).to(device, non_blocking=True)
        with torch.autocast(device, dtype=dtype, enabled=dtype is not None):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.trainer.max_grad_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        loss.item()
        times.append(time.time() - start)
    out.write_text(json.dumps({"times": times, **gpu_peak()}))


def worker_hf(cfg, steps: int, out: Path) -> None:
    import psutil
    import torch
    from transformers import Trainer, TrainerCallback, TrainingArguments

    start = psutil.Process().create_time()
    train_set, model = build_common(cfg)
    times = []

    class StepTimes(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            times.append(time.time() - start)

    class AsDict(torch.utils.data.Dataset):
        def __len__(self):
            return len(train_set)

        def __getitem__(self, i):
            return {"input_ids": train_set[i], "labels": train_set[i]}

    opt = cfg.optimizer
    args = TrainingArguments(
        output_dir=str(out.parent / "hf"), max_steps=steps, per_device_train_batch_size=cfg.data.batch_size,
        learning_rate=opt.lr, weight_decay=opt.weight_decay, adam_beta1=opt.betas[0], adam_beta2=opt.betas[1],
        adam_epsilon=opt.eps, lr_scheduler_type="cosine", max_grad_norm=cfg.trainer.max_grad_norm,
        logging_steps=1, save_strategy="no", report_to=[], disable_tqdm=True, seed=cfg.trainer.seed,
        dataloader_num_workers=0, bf16=cfg.precision.name == "bf16",
        optim="adamw_torch_fused" if torch.cuda.is_available() else "adamw_torch",
        use_cpu=not torch.cuda.is_available(), dataloader_drop_last=True,
    )
    Trainer(model=model, args=args, train_dataset=AsDict(), callbacks=[StepTimes()]).train()
    out.write_text(json.dumps({"times": times, **gpu_peak()}))


def gpu_peak() -> dict:
    import torch

    return {"gpu_peak_bytes": torch.cuda.max_memory_allocated()} if torch.cuda.is_available() else {}


def run_variant(variant: str, size: str, steps: int, workdir: Path) -> dict:
    """One run in a fresh process; returns its step times and peak memory."""
    out = workdir / f"{variant}.json"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    if variant == "trainloop":
        run_dir = workdir / "trainloop"
        cmd = [sys.executable, "-m", "trainloop", *SIZES[size], *COMMON, f"trainer.max_steps={steps}",
               "trainer.log_every=1", f"trainer.eval_every={steps}", "trainer.eval_batches=1",
               "checkpoint.save_final_model=false", "logging.progress_bar=false", f"hydra.run.dir={run_dir}"]
    else:
        cmd = [sys.executable, __file__, "--worker", variant, "--size", size, "--steps", str(steps),
               "--out", str(out)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    _, status, usage = os.wait4(proc.pid, 0)
    stderr = proc.stderr.read()
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        sys.exit(f"{variant} failed ({proc.returncode}):\n{stderr[-3000:]}")
    if variant == "trainloop":
        lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        result = {"times": [r["time"] for r in lines if "loss" in r]}
        result.update({k: v for r in lines for k, v in r.items() if k == "gpu_peak_bytes"})
    else:
        result = json.loads(out.read_text())
    result["peak_rss_bytes"] = usage.ru_maxrss * 1024  # Linux reports kilobytes
    return result


def summarize(runs: list[dict], tokens_per_step: int, warmup: int) -> dict:
    rates = [tokens_per_step * (len(r["times"]) - warmup) / (r["times"][-1] - r["times"][warmup - 1]) for r in runs]
    memory = [r.get("gpu_peak_bytes", r["peak_rss_bytes"]) for r in runs]
    return {"tokens_per_s": statistics.median(rates), "all_tokens_per_s": [round(x) for x in rates],
            "peak_memory_gib": statistics.median(memory) / 2**30,
            "first_step_s": statistics.median(r["times"][0] for r in runs)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(SIZES), default="cpu")
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps per run")
    parser.add_argument("--warmup", type=int, default=10, help="steps left out of tokens/s")
    parser.add_argument("--rounds", type=int, default=3, help="runs per variant, alternating")
    parser.add_argument("--variants", default="raw,trainloop,hf")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--worker", choices=["raw", "hf"], help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()

    cfg = compose([*SIZES[args.size], *COMMON])
    if args.worker:
        {"raw": worker_raw, "hf": worker_hf}[args.worker](cfg, args.steps, args.out)
        return
    if args.steps <= args.warmup:
        parser.error("--steps must be larger than --warmup")

    variants = args.variants.split(",")
    runs = {v: [] for v in variants}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            for variant in variants:
                workdir = Path(tmp) / f"{variant}{round_}"
                workdir.mkdir()
                runs[variant].append(run_variant(variant, args.size, args.steps, workdir))
                print(f"round {round_ + 1}/{args.rounds} {variant}: done", file=sys.stderr)

    tokens_per_step = cfg.data.batch_size * cfg.data.seq_len
    results = {v: summarize(r, tokens_per_step, args.warmup) for v, r in runs.items()}
    print(f"\n{args.size} size, {args.steps} steps x {args.rounds} rounds, {tokens_per_step} tokens/step, "
          f"tokens/s after {args.warmup} warm-up steps (median)\n")
    print("| variant | tokens/s | runs | peak memory (GiB) | start to 1st step (s) |")
    print("|---|---:|---|---:|---:|")
    for v, r in results.items():
        print(f"| {v} | {r['tokens_per_s']:,.0f} | {r['all_tokens_per_s']} | {r['peak_memory_gib']:.2f} | "
              f"{r['first_step_s']:.1f} |")
    if "trainloop" in results:
        print()
        for base in ("raw", "hf"):
            if base in results:
                print(f"trainloop / {base}: tokens/s x{results['trainloop']['tokens_per_s'] / results[base]['tokens_per_s']:.3f}, "
                      f"peak memory x{results['trainloop']['peak_memory_gib'] / results[base]['peak_memory_gib']:.3f}")
    if args.json:
        args.json.write_text(json.dumps({"size": args.size, "steps": args.steps, "rounds": args.rounds,
                                         "results": results}, indent=2))


if __name__ == "__main__":
    main()
