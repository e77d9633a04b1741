"""objective=dpo, reward, kto and distill against TRL's DPOTrainer, RewardTrainer, KTOTrainer and
GKDTrainer: step time and peak memory, measured in one invocation.

    python scripts/bench_dpo.py [--steps 8] [--warmup 3] [--rows lora full precompute reward kto distill] [--repeats 1]
                                [--json OUT]
    python scripts/bench_dpo.py --quick      # tiny sizes, a few seconds of training: the CI smoke test

Both sides train the same model, saved once to a local directory (a tiny transformers Llama and
trainloop's byte-level tokenizer, loaded from there by both), on the same rows (each prompt +
completion exactly data.seq_len tokens, so TRL's padding to the longest in the batch and
trainloop's padding to data.seq_len give the same [2 x batch, seq_len] forward), with the same
batch, beta, loss, optimizer (fused AdamW, weight decay on the matrices only), cosine schedule,
clipping, fp32 and no gradient checkpointing (TRL's own defaults are bf16 and gradient
checkpointing: set off here). TRL's arguments are read from the composed trainloop config.
The rows: DPO (sigmoid, beta 0.1) one per way to hold the reference, then the other objectives:
  lora        adapter=lora                     / a peft LoraConfig of the same r, alpha and targets
                                                 (trainloop.model.adapter.lora_config): adapters disabled
  full        adapter=none                     / no peft: TRL loads its reference copy from the
                                                 model directory, trainloop deep-copies the model
  precompute  full + objective.precompute_reference=true / precompute_ref_log_probs=True
  reward      objective=reward, a full fine-tune / RewardTrainer on a sequence classifier of the model
  kto         objective=kto on data=unpaired (each pair as a desirable and an undesirable row),
              adapter=lora / KTOTrainer with the same LoraConfig: adapters disabled, mismatched pairs for KL
  distill     objective=distill (beta 0.5, off-policy) on data=chat, each pair's prompt and chosen completion
              as a conversation, from a teacher of the model's shape (another seed) / GKDTrainer (lmbda 0):
              the model directory's tokenizer carries trainloop's built-in template, so both render alike

Every (row, side) runs in a fresh process of its own, forked from a server process that has
imported the libraries (torch, transformers, peft, trl, trainloop) and computed nothing: each run
has its own address space and peak memory, and the ~6 s of imports are paid once.
  - step time: the median of the timed optimizer steps, after warm-up steps. A step is what the
    training loop does between fetching the batch and the next fetch: forward of the policy and
    of the reference, loss, backward, clipping, optimizer and scheduler step, zero_grad (TRL:
    from the Trainer's on_step_begin to its on_step_end callback, after it has collated the
    batch; trainloop: the loop's own micro-step, objective, clipping and finite-check guard,
    after the batch is fetched; neither logs inside the timed steps). Tokenization and start-up
    are not timed. On CPU every run gets --threads compute threads (default 1) and the step
    time is the process's CPU time, which other jobs on a shared machine change less than its
    wall-clock time (printed beside it). On a GPU, wall-clock.
  - peak memory: on CPU, the peak resident set over the warm-up steps (VmHWM, reset through
    /proc/self/clear_refs when training starts) minus the resident set just before the model
    is built (VmRSS), with glibc told to give every allocation of 64 KiB or more its own mapping
    (trainloop.tools.measure.track_live_memory) so that freed tensors leave the resident set. Each
    process first runs its side once on a one-block copy of the model (2 steps, not measured), so
    that the code paths and lazy imports of its trainer are loaded before the baseline: what is
    measured is the training, not the libraries. Those 2 steps run with the tracking on too: a step
    on glibc's usual heap leaves large free blocks in it, and glibc serves a request of 64 KiB or
    more from a free block that fits before it maps new memory, so the measured run's tensors
    landed there and stayed resident (repeated runs' peaks were up to a third apart; now within
    1%). "building" is the same peak over the build (model, adapter, reference, tokenization of
    the pairs, precompute). On a GPU, torch.cuda.max_memory_allocated over the same spans.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

from trainloop.memory.proc import reset_peak_rss, status_bytes

REPO = Path(__file__).resolve().parent.parent
SIDES = ("trainloop", "trl")

# model and data sizes: the default model (4 blocks, 256 wide) on 128-token sequences, batch 8 pairs
SIZES = {
    "default": {"model": ["model.num_layers=4", "model.hidden_size=256", "model.num_heads=4"],
                "data": ["data.seq_len=128", "data.batch_size=8"], "pairs": 128},
    "quick": {"model": ["model.num_layers=2", "model.hidden_size=64", "model.num_heads=2"],
              "data": ["data.seq_len=64", "data.batch_size=4"], "pairs": 32},
}
# What both sides train with (TRL's arguments are read from this same composed config).
COMMON = ["optimizer=adamw", "optimizer.impl=fused", "optimizer.lr=5e-6", "scheduler=cosine",
          "scheduler.warmup_steps=0", "trainer.max_grad_norm=1.0", "trainer.gradient_accumulation_steps=1",
          "precision=fp32", "model.gradient_checkpointing=false", "model.attn_implementation=sdpa",
          "data.num_workers=0", "logging.progress_bar=false"]
DPO = ["data=preference", "objective=dpo", "objective.beta=0.1", "objective.loss_type=sigmoid"]
# row -> (what it is, its overrides, the TRL trainer it is measured against)
ROWS = {
    "lora": ("LoRA (adapter=lora, r=8, alpha 16, all linear layers)", [*DPO, "adapter=lora"], "dpo"),
    "full": ("full fine-tune (adapter=none): a frozen reference copy", [*DPO, "adapter=none"], "dpo"),
    "precompute": ("full fine-tune, reference log-probs precomputed",
                   [*DPO, "adapter=none", "objective.precompute_reference=true"], "dpo"),
    "reward": ("reward model (objective=reward): a score head, full fine-tune",
               ["data=preference", "objective=reward", "adapter=none"], "reward"),
    "kto": ("KTO (objective=kto, data=unpaired) with LoRA: adapters disabled",
            ["data=unpaired", "objective=kto", "objective.beta=0.1", "adapter=lora"], "kto"),
    "distill": ("distillation (objective=distill, off-policy, JSD 0.5) from a teacher of the same shape",
                ["data=chat", "data.train_on=assistant", "objective=distill", "objective.beta=0.5",
                 "adapter=none"], "gkd"),
}
# in the work directory
DATA_FILES = {"dpo": "pairs.jsonl", "reward": "pairs.jsonl", "kto": "unpaired.jsonl", "gkd": "chats.jsonl"}
# imported once by the server process every run is forked from
PRELOAD = ["torch", "transformers", "transformers.trainer", "peft", "datasets", "accelerate", "hydra", "trl",
           "trl.trainer.dpo_trainer", "trl.trainer.reward_trainer", "trl.trainer.kto_trainer", "trl.experimental.gkd",
           "trainloop.build", "trainloop.loop", "trainloop.objectives.dpo", "trainloop.tools.plan"]


# --- what both sides measure the same way ----------------------------------------------------------

class Meter:
    """One run's memory marks and step times, kept the same way for trainloop and TRL."""

    def __init__(self, warmup: int):
        import torch

        self.warmup, self.on_cuda = warmup, torch.cuda.is_available()
        self.wall, self.cpu, self.marks = [], [], {}

    def _now(self) -> int:
        import torch

        return torch.cuda.max_memory_allocated() if self.on_cuda else status_bytes("VmHWM")

    def _reset(self) -> None:
        import torch

        if self.on_cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        else:
            reset_peak_rss()

    def before_model(self) -> None:
        """The data is in memory; the model is built next."""
        import gc

        import torch

        from trainloop.tools.measure import track_live_memory

        gc.collect()
        self.marks["glibc_live_tracking"] = track_live_memory(True)
        self._reset()
        self.marks["before"] = torch.cuda.memory_allocated() if self.on_cuda else status_bytes("VmRSS")

    def training_starts(self) -> None:
        self.marks["building"] = self._now() - self.marks["before"]
        self._reset()

    def begin_step(self) -> None:
        self._t = time.perf_counter(), time.process_time()

    def end_step(self) -> None:
        import torch

        if self.on_cuda:
            torch.cuda.synchronize()
        wall, cpu = self._t
        self.wall.append(time.perf_counter() - wall)
        self.cpu.append(time.process_time() - cpu)
        if len(self.wall) == self.warmup:  # the warm-up steps hold the peak: state, activations
            from trainloop.tools.measure import track_live_memory

            self.marks["training"] = self._now() - self.marks["before"]
            track_live_memory(False)  # glibc's usual heap for the timed steps

    def result(self) -> dict:
        timed_wall, timed_cpu = self.wall[self.warmup:], self.cpu[self.warmup:]
        if not timed_wall:  # a run that loads the code paths
            return {}
        return {"step_s": statistics.median(timed_wall if self.on_cuda else timed_cpu),
                "wall_step_s": statistics.median(timed_wall), "cpu_step_s": statistics.median(timed_cpu),
                "steps_timed": len(timed_wall), "warmup_s": sum(self.wall[:self.warmup]),
                "training_bytes": self.marks["training"], "building_bytes": self.marks["building"],
                "memory_kind": "torch.cuda.max_memory_allocated" if self.on_cuda else
                "VmHWM - VmRSS" + (", glibc mmap threshold 64 KiB" if self.marks["glibc_live_tracking"] else ""),
                "time_kind": "wall-clock" if self.on_cuda else "CPU time"}


def on_model(overrides: list[str], model_dir: str) -> list[str]:
    return [*(o for o in overrides if not o.startswith("model.name_or_path=")), f"model.name_or_path={model_dir}"]


def sequence_lengths(prompt_plus_completion) -> dict:
    lengths = list(prompt_plus_completion)
    return {"min": min(lengths), "max": max(lengths)}


# --- trainloop's side: the run's own build, the loop's own step ----------------------------------

def run_trainloop(overrides: list[str], steps: int, warmup: int, warm_model: str) -> dict:
    """Once on the one-block model (its code paths loaded, not measured), then measured."""
    train_trainloop(on_model(overrides, warm_model), 0, 2, Meter(2))
    return train_trainloop(overrides, steps, warmup, Meter(warmup))


def train_trainloop(overrides: list[str], steps: int, warmup: int, meter: Meter) -> dict:
    import torch
    from accelerate.state import AcceleratorState, GradientState

    from trainloop.build import build
    from trainloop.config.compose import compose_config
    from trainloop.data.tokenizer import IGNORE
    from trainloop.guard import StepGuard
    from trainloop.loop import TrainState, batches_forever, step_batches
    from trainloop.memory.offload import ActivationOffload
    from trainloop.parallel import build_strategy
    from trainloop.parallel.accelerator import build_accelerator
    from trainloop.preemption import Preemption
    from trainloop.step import train_step

    AcceleratorState._reset_state(reset_partial_state=True)  # a fresh Accelerator for each run
    GradientState._reset_state()
    cfg = compose_config([*overrides, f"trainer.max_steps={warmup + steps}"])  # checked as a run checks it
    accelerator = build_accelerator(cfg)
    strategy = build_strategy(cfg, accelerator)
    built = build(cfg, strategy, before_model=meter.before_model)  # data, model, adapter, reference, optimizer
    model, optimizer, scheduler, objective = built.model, built.optimizer, built.scheduler, built.objective
    # every sequence the forwards take: chosen and rejected, or a completion and its mismatched one
    items = built.train_set
    labels = torch.cat([t for key, t in items.tensors.items() if key.endswith("labels")]) \
        if hasattr(items, "tensors") else torch.stack([items[i]["labels"] for i in range(len(items))])  # blocks
    last_target = (labels != IGNORE).int().cumsum(1).argmax(1)  # the first position of the highest count
    state, guard = TrainState(), StepGuard(cfg, strategy, None, Preemption(), optimizer, scheduler)
    batches = batches_forever(accelerator, built.train_loader, state)
    offload = ActivationOffload(cfg.trainer.activation_offload, accelerator.device)  # the run's forward context
    model.train()
    meter.training_starts()
    losses = []
    for _ in range(warmup + steps):
        group = step_batches(batches, accelerator.gradient_accumulation_steps)  # fetched: not timed
        meter.begin_step()
        # the run's step (trainloop.step): units, scale, clip, the guard's finite check, update
        stepped = train_step(strategy, objective, model, optimizer, group, max_grad_norm=cfg.trainer.max_grad_norm,
                             forward_context=offload, check=guard.check, state=state)
        guard.stepped(stepped.updated)  # the scheduler steps after an applied update
        guard.settle(state)  # a verdict read one step late (trainloop.guard) is read now
        state.step += 1
        losses.append(stepped.loss.item())  # the loop's loss, on the host: waits for the device
        meter.end_step()
    return {**meter.result(), "loss_first": losses[0], "loss_last": losses[-1],
            "trained_params": sum(p.numel() for p in model.parameters() if p.requires_grad),
            "tokens_per_sequence": sequence_lengths((last_target + 1).tolist()),
            "device": str(accelerator.device)}


# --- TRL's side: its trainer for the row, with the same model, rows and hyperparameters -------------

def run_trl(overrides: list[str], steps: int, warmup: int, warm_model: str, data_file: str, out_dir: str,
            trainer: str) -> dict:
    """Once on the one-block model (its code paths loaded, not measured), then measured."""
    train_trl(on_model(overrides, warm_model), 0, 2, Meter(2), data_file, out_dir + "-warm", trainer)
    return train_trl(overrides, steps, warmup, Meter(warmup), data_file, out_dir, trainer)


def train_trl(overrides: list[str], steps: int, warmup: int, meter: Meter, data_file: str, out_dir: str,
              kind: str) -> dict:
    """TRL's DPOTrainer, RewardTrainer or KTOTrainer (`kind`), its arguments read from the composed config."""
    import datasets
    import torch
    import trl
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer, TrainerCallback

    from trainloop.config.compose import compose_config
    from trainloop.model.adapter import lora_config

    cfg = compose_config([*overrides, f"trainer.max_steps={warmup + steps}"])
    model_dir, on_cuda = cfg.model.name_or_path, torch.cuda.is_available()
    lora = lora_config(cfg.adapter) if cfg.adapter.name == "lora" else None  # peft fills in its targets: one per run
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rows = datasets.Dataset.from_list([json.loads(line) for line in Path(data_file).read_text().splitlines()])

    class Steps(TrainerCallback):
        """The Trainer has collated the step's batch before on_step_begin: collation is not timed."""

        def on_train_begin(self, args, state, control, **kwargs):
            meter.training_starts()

        def on_step_begin(self, args, state, control, **kwargs):
            meter.begin_step()

        def on_step_end(self, args, state, control, **kwargs):
            meter.end_step()

    o, opt = cfg.objective, cfg.optimizer
    common = dict(
        output_dir=out_dir, report_to=[], save_strategy="no", disable_tqdm=True, logging_steps=warmup + steps + 1,
        max_steps=warmup + steps, per_device_train_batch_size=cfg.data.batch_size,
        gradient_accumulation_steps=cfg.trainer.gradient_accumulation_steps, seed=cfg.trainer.seed,
        max_length=cfg.data.seq_len,
        learning_rate=opt.lr, weight_decay=opt.weight_decay, adam_beta1=opt.betas[0], adam_beta2=opt.betas[1],
        adam_epsilon=opt.eps, optim="adamw_torch_fused", lr_scheduler_type="cosine",
        warmup_steps=cfg.scheduler.warmup_steps, max_grad_norm=cfg.trainer.max_grad_norm,
        bf16=False, fp16=False, gradient_checkpointing=False,  # TRL's defaults are bf16 and checkpointing
        use_cpu=not on_cuda, dataloader_num_workers=0,
    )
    if kind == "dpo":
        args = trl.DPOConfig(**common, beta=o.beta, loss_type=[o.loss_type], label_smoothing=o.label_smoothing,
                             precompute_ref_log_probs=o.precompute_reference)
    elif kind == "reward":
        args = trl.RewardConfig(**common, center_rewards_coefficient=o.center_rewards_coefficient or None)
    elif kind == "kto":
        args = trl.KTOConfig(**common, beta=o.beta, desirable_weight=o.desirable_weight,
                             undesirable_weight=o.undesirable_weight)
    else:  # GKD off-policy (lmbda 0): the data's completions, the generalized JSD at temperature 1
        from trl.experimental.gkd import GKDConfig, GKDTrainer

        args = GKDConfig(**common, lmbda=0.0, beta=o.beta, seq_kd=False)
    meter.before_model()
    if kind == "reward":
        model = AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=1, dtype=torch.float32,
                                                                   attn_implementation="sdpa")
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    if kind == "gkd":
        teacher = AutoModelForCausalLM.from_pretrained(o.teacher, dtype=torch.float32, attn_implementation="sdpa")
        trainer = GKDTrainer(model=model, teacher_model=teacher, args=args, train_dataset=rows,
                             processing_class=tokenizer, callbacks=[Steps()])
    else:
        made = {"dpo": trl.DPOTrainer, "reward": trl.RewardTrainer, "kto": trl.KTOTrainer}[kind]
        trainer = made(model=model, args=args, train_dataset=rows, processing_class=tokenizer, peft_config=lora,
                       callbacks=[Steps()])
    trainer.train()
    if len(meter.wall) != warmup + steps:
        raise RuntimeError(f"TRL ran {len(meter.wall)} optimizer steps, not {warmup + steps}")
    train_set, reference = trainer.train_dataset, getattr(trainer, "ref_model", None)
    if kind == "dpo":
        lengths = (len(r["prompt_ids"]) + len(r[side]) for r in train_set for side in ("chosen_ids", "rejected_ids"))
    elif kind == "reward":
        lengths = (len(r[side]) for r in train_set for side in ("chosen_ids", "rejected_ids"))
    elif kind == "kto":
        lengths = (len(r["prompt_ids"]) + len(r[side]) for r in train_set for side in ("completion_ids",
                                                                                      "KL_completion_ids"))
    else:  # the collator renders each conversation with the tokenizer's template
        lengths = (len(tokenizer.apply_chat_template(r["messages"], tokenize=True, return_dict=False))
                   for r in train_set)
    return {**meter.result(),
            "trained_params": sum(p.numel() for p in trainer.model.parameters() if p.requires_grad),
            "reference": "none" if kind in ("reward", "gkd") else "adapters disabled" if reference is None and lora else
            "precomputed" if reference is None else type(reference).__name__,
            "tokens_per_sequence": sequence_lengths(lengths), "device": str(trainer.args.device)}


# --- the model and the pairs, written once ---------------------------------------------------------

def write_rows(work: Path, n: int, seq_len: int) -> None:
    """n plain-text pairs (pairs.jsonl), each prompt + completion + end-of-text exactly seq_len byte
    tokens, chosen and rejected alike: no padding on either side, whatever the batch; and each pair as
    two unpaired rows (unpaired.jsonl: chosen desirable, rejected not). Every prompt has one length, so
    a prompt with another row's completion (KTO's mismatched pairs) is seq_len tokens too."""
    pairs = []
    for i in range(n):
        a, b = i % 37, (7 * i) % 23
        prompt = f"What is {a:2d} plus {b:2d}?"
        room = seq_len - len(prompt) - 1  # the end-of-text token closes the completion
        chosen = (f" {a} plus {b} is {a + b}." + " Indeed." * seq_len)[:room]
        rejected = (f" It is {a + b + 1 + i % 3}." + " Surely." * seq_len)[:room]
        pairs.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
    (work / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))
    write_chats(work, pairs, seq_len)
    (work / "unpaired.jsonl").write_text("".join(
        json.dumps({"prompt": p["prompt"], "completion": p[side], "label": side == "chosen"}) + "\n"
        for p in pairs for side in ("chosen", "rejected")))


def write_chats(work: Path, pairs: list[dict], seq_len: int) -> None:
    """Each pair's prompt and chosen completion as a conversation (chats.jsonl) that the model directory's
    tokenizer renders, with trainloop's built-in template saved there for both sides, to exactly seq_len
    tokens."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(work / "model")
    rows = []
    for p in pairs:
        turns = [{"role": "user", "content": p["prompt"]}, {"role": "assistant", "content": ""}]
        room = seq_len - len(tokenizer.apply_chat_template(turns, tokenize=True, return_dict=False))
        turns[1]["content"] = (p["chosen"] * seq_len)[:room]
        rows.append({"messages": turns})
    (work / "chats.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def prepare(work: str, size: str) -> dict:
    """The tiny Llama with its seeded initial weights and the byte-level tokenizer, as a local model
    directory both sides load; and the pairs."""
    from accelerate.utils import set_seed
    from omegaconf import OmegaConf

    from trainloop.config.compose import compose_config
    from trainloop.data.tokenizer import byte_level_tokenizer
    from trainloop.model.builder import build_model, build_model_config, special_token_ids

    cfg = compose_config(["model=tiny", *SIZES[size]["model"], *SIZES[size]["data"], *COMMON, *DPO,
                          "data.path=unused"], check=False)
    from trainloop.data.chat_template import BUILTIN_CHAT_TEMPLATE

    tokenizer, params = byte_level_tokenizer(), {}
    tokenizer.chat_template = BUILTIN_CHAT_TEMPLATE  # both sides render the conversations alike
    # the one-block model loads the code paths; the teacher (objective=distill) has the model's shape, another seed
    for name, blocks in (("model", cfg.model.num_layers), ("model-1block", 1), ("teacher", cfg.model.num_layers)):
        set_seed(cfg.trainer.seed + (name == "teacher"))
        model_cfg = OmegaConf.merge(cfg.model, {"num_layers": blocks})
        model = build_model(model_cfg, build_model_config(model_cfg, len(tokenizer), special_token_ids(tokenizer)))
        model.save_pretrained(Path(work) / name)
        tokenizer.save_pretrained(Path(work) / name)
        params[name] = sum(p.numel() for p in model.parameters())
    write_rows(Path(work), SIZES[size]["pairs"], cfg.data.seq_len)
    return {"params": params["model"], "seq_len": cfg.data.seq_len,
            "batch_size": cfg.data.batch_size}


# --- the driver --------------------------------------------------------------------------------------

def _child(log_path: str, conn, fn, args) -> None:
    """One run in a forked process: its output to a log file, its result (or why it failed) to the pipe."""
    import gc
    import logging

    gc.freeze()  # the libraries' objects, imported by the server: no collection walks (and copies) them again
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    logging.basicConfig(level=logging.WARNING)
    try:
        result = fn(*args)
    except BaseException as err:  # noqa: BLE001 - a row says why it did not run
        traceback.print_exc()
        result = {"failed": f"{type(err).__name__}: {err}".replace("\n", " ")[:400]}
    sys.stdout.flush()
    sys.stderr.flush()
    conn.send(result)
    conn.close()


def start_server_quietly(log_path: Path) -> None:
    """Start the fork server with its output (the libraries' import-time warnings) in a log file."""
    from multiprocessing import forkserver

    saved, log = os.dup(2), os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 2)  # the server inherits this descriptor as its stderr
    try:
        forkserver.ensure_running()
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(log)


def in_child(ctx, log_path: Path, fn, *args) -> dict:
    """fn(*args) in a fresh process forked from the server; its result, or why it failed."""
    receive, send = ctx.Pipe(duplex=False)
    process = ctx.Process(target=_child, args=(str(log_path), send, fn, args))
    began = time.time()
    process.start()
    send.close()
    try:
        result = receive.recv()
    except EOFError:  # killed (out of memory?) before it could answer
        tail = log_path.read_text().strip().splitlines()[-1:] if log_path.exists() else []
        result = {"failed": f"exit {process.exitcode}" + (f": {tail[0][:300]}" if tail else "")}
    process.join()
    return {**result, "run_s": time.time() - began}


MEDIANS = ("step_s", "wall_step_s", "cpu_step_s", "training_bytes", "building_bytes")


def summarize(runs: list[dict]) -> dict:
    """One side of one row over its repeats: the medians, the first run's other fields, every run."""
    failed = [r["failed"] for r in runs if "failed" in r]
    if failed:
        return {"failed": failed[0], "runs": runs}
    return {**runs[0], **{key: statistics.median(r[key] for r in runs) for key in MEDIANS}, "runs": runs}


def fmt_step(r: dict) -> str:
    return f"{r['step_s'] * 1000:,.0f} ms"


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b > 0 else "-"


def table(results: dict) -> str:
    """One line per row: each side's median step and peak memory, and trainloop / TRL."""
    lines = ["| row | trainloop step | TRL step | trainloop / TRL | trainloop peak | TRL peak "
             "| trainloop / TRL | trainloop wall step | TRL wall step | building peak: trainloop, TRL |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for row, sides in results.items():
        name = ROWS[row][0]
        failed = [f"{side}: {r['failed']}" for side, r in sides.items() if "failed" in r]
        if failed:
            lines.append(f"| {name} | not run: {'; '.join(failed)} | | | | | | | | |")
            continue
        ours, trl = sides["trainloop"], sides["trl"]
        lines.append(
            f"| {name} | {fmt_step(ours)} | {fmt_step(trl)} | {ratio(ours['step_s'], trl['step_s'])} "
            f"| {ours['training_bytes'] / 2**20:,.1f} MiB | {trl['training_bytes'] / 2**20:,.1f} MiB "
            f"| {ratio(ours['training_bytes'], trl['training_bytes'])} "
            f"| {ours['wall_step_s'] * 1000:,.0f} ms | {trl['wall_step_s'] * 1000:,.0f} ms "
            f"| {ours['building_bytes'] / 2**20:,.1f}, {trl['building_bytes'] / 2**20:,.1f} MiB |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, help="timed optimizer steps per run (default 8; --quick 2)")
    parser.add_argument("--warmup", type=int, help="untimed steps first, at least 2: the memory peak is "
                        "taken over them (default 3; --quick 2)")
    parser.add_argument("--rows", nargs="+", choices=list(ROWS), default=list(ROWS), help="which references")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each side of each row, in alternating "
                        "order; the table shows their medians (default 1)")
    parser.add_argument("--quick", action="store_true", help="a 2-block, 64-wide model on 64-token pairs, "
                        "batch 4: checks the benchmark runs, in seconds; its figures mean little")
    parser.add_argument("--threads", type=int, default=1, help="compute threads per run on CPU (default 1)")
    parser.add_argument("--json", type=Path, help="also write the raw results here")
    args = parser.parse_args()
    size = "quick" if args.quick else "default"
    steps = args.steps if args.steps is not None else 2 if args.quick else 8
    warmup = args.warmup if args.warmup is not None else 2 if args.quick else 3
    if warmup < 2:
        parser.error("--warmup must be at least 2: the second step is the first with optimizer state in memory")
    if steps < 1 or args.repeats < 1 or args.threads < 1:
        parser.error("--steps, --repeats and --threads must be at least 1")

    began = time.time()
    with tempfile.TemporaryDirectory(prefix="bench_dpo_") as tmp:
        work = Path(tmp)
        # before the server starts: it and every run forked from it read these at import
        os.environ.update(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS=str(args.threads),
                          MKL_NUM_THREADS=str(args.threads), HF_DATASETS_CACHE=str(work / "datasets"),
                          HF_DATASETS_DISABLE_PROGRESS_BARS="1", TQDM_DISABLE="1",
                          # an import that asks whether there is a GPU must not start CUDA in the server
                          PYTORCH_NVML_BASED_CUDA_CHECK="1")
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        start_server_quietly(work / "server.log")
        setup = in_child(ctx, work / "prepare.log", prepare, tmp, size)
        if "failed" in setup:
            sys.exit(f"writing the model and the pairs failed: {setup['failed']}")
        base = ["model=hf", f"model.name_or_path={work / 'model'}", *SIZES[size]["data"], *COMMON]
        warm_model, runs, turn = str(work / "model-1block"), {}, 0
        for repeat in range(args.repeats):
            for row in args.rows:
                _, own, kind = ROWS[row]
                data_file = work / DATA_FILES[kind]
                overrides = [*base, *own, f"data.path={data_file}",
                             *([f"objective.teacher={work / 'teacher'}"] if kind == "gkd" else [])]
                for side in SIDES if turn % 2 == 0 else reversed(SIDES):  # who goes first alternates: drift cancels
                    name = f"{row}-{side}-{repeat + 1}"
                    if side == "trainloop":
                        r = in_child(ctx, work / f"{name}.log", run_trainloop, overrides, steps, warmup, warm_model)
                    else:
                        r = in_child(ctx, work / f"{name}.log", run_trl, overrides, steps, warmup, warm_model,
                                     str(data_file), str(work / name), kind)
                    runs.setdefault(row, {}).setdefault(side, []).append(r)
                    print(f"{name:24s} " + (f"failed: {r['failed']}" if "failed" in r else
                          f"step {r['step_s'] * 1000:7,.0f} ms {r['time_kind']} (wall {r['wall_step_s'] * 1000:,.0f} "
                          f"ms), peak {r['training_bytes'] / 2**20:7.1f} MiB, {r['trained_params']:,} trained "
                          f"parameters; {r['run_s']:.0f} s"), file=sys.stderr, flush=True)
                turn += 1
    results = {row: {side: summarize(sides[side]) for side in SIDES} for row, sides in runs.items()}
    print_report(results, setup, args, size, steps, warmup, began)


def versions() -> str:
    from importlib.metadata import version

    return ", ".join(f"{name} {version(name)}" for name in ("torch", "transformers", "peft", "trl", "accelerate"))


def print_report(results: dict, setup: dict, args, size: str, steps: int, warmup: int, began: float) -> None:
    ran = [r for sides in results.values() for r in sides.values() if "failed" not in r]
    device = ran[0]["device"] if ran else "?"
    if device.startswith("cpu"):
        device = f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores, {args.threads} " \
                 f"thread{'s' if args.threads > 1 else ''} per run)"
    lengths = {(side, r["tokens_per_sequence"]["min"], r["tokens_per_sequence"]["max"])
               for sides in results.values() for side, r in sides.items() if "failed" not in r}
    same = {(lo, hi) for _, lo, hi in lengths} == {(setup["seq_len"], setup["seq_len"])}
    trained = {row: {side: r["trained_params"] for side, r in sides.items() if "failed" not in r}
               for row, sides in results.items()}
    print()
    print(f"trainloop bench_dpo: {device}, {versions()}, {time.strftime('%Y-%m-%d')}; "
          f"{'--quick, ' if args.quick else ''}a {setup['params']:,}-parameter Llama, batch {setup['batch_size']} "
          f"rows of {setup['seq_len']}-token sequences (2 a row: a pair, or a completion and its mismatched one; 1 "
          f"for distillation), DPO and KTO at beta 0.1, fp32, fused AdamW; median of {steps} timed "
          f"steps after {warmup} warm-up" + (f", median of {args.repeats} runs" if args.repeats > 1 else "") +
          f"; {time.time() - began:.0f} s in all, load average at the end {os.getloadavg()[0]:.1f}")
    if ran:
        print(f"step = {ran[0]['time_kind']} of one optimizer step; peak = {ran[0]['memory_kind']}, above the "
              f"resident set before the model, over the warm-up steps (building: over the build)")
    print("sequences: " + (f"every one {setup['seq_len']} tokens on both sides (no padding)" if same else
                           "NOT the same length on both sides: " +
                           ", ".join(f"{s} {lo}..{hi}" for s, lo, hi in sorted(lengths))))
    print("trained parameters: " + ", ".join(
        f"{row} {next(iter(n.values())):,} on both sides" if len(set(n.values())) == 1 else
        f"{row} NOT the same: " + ", ".join(f"{side} {v:,}" for side, v in n.items())
        for row, n in trained.items() if n))
    print()
    print(table(results))
    if args.json:
        args.json.write_text(json.dumps({"size": size, "steps": steps, "warmup": warmup, "threads": args.threads,
                                         "repeats": args.repeats, "setup": setup, "results": results}, indent=2))
    if any("failed" in r for sides in results.values() for r in sides.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
