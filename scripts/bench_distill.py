"""Does distillation beat the student trained alone? objective=distill beside TRL's GKDTrainer (lmbda 0,
off-policy) on one sorting task: the same teacher, the same starting student, the same rows, steps,
batch, learning rate and schedule, every model scored by one function on the same held-out rows.

    python scripts/bench_distill.py [--steps 100 400] [--teacher-steps 600] [--json OUT]
    python scripts/bench_distill.py --quick      # a few steps of everything: the CI smoke test

The task: a user turn `sort 7 3 9 1 4` and the assistant's `1 3 4 7 9` (5 digits, drawn at random),
rendered with trainloop's built-in chat template, which the teacher's final/ tokenizer carries and
both trainers use (GKD's collator renders each conversation with the tokenizer's template). Rows are
not packed (data.packing=none): each trains one conversation a row on both sides, the reply's tokens
the targets. The teacher is a 4-block, 128-wide Llama trained here by trainloop on the same rows; the
student a 2-block, 128-wide one, made once from its config with a fixed seed and saved, so that every
student run starts from the same weights. From it, for each step count:
  alone      objective=causal_lm: the student on the data's own replies
  jsd        objective=distill, beta 0.5 (the generalized JSD, GKD's default and trainloop's)
  fkl        objective=distill, beta 0 (the forward KL of classic distillation)
  trl-jsd    GKDTrainer, lmbda 0, beta 0.5
  trl-fkl    GKDTrainer, lmbda 0, beta 0
Scored on the held-out rows: the reply's mean NLL per target token (teacher-forced, the targets as
data=chat marks them) and the share of replies that greedy decoding gets exactly right.

Every run trains in this process, one after another (trainloop's through `trainloop.train`, TRL's through
its Trainer): what is compared is what the students learned, not how long they took.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

TASK = {"train": 4000, "held_out": 200, "digits": 5}
SHAPE = ["model.hidden_size=128", "model.num_heads=4"]
COMMON = ["data=chat", "data.packing=none", "data.seq_len=64", "data.batch_size=16", "optimizer.lr=1e-3",
          "scheduler=cosine", "scheduler.warmup_steps=10", "trainer.eval_every=1000000", "trainer.log_every=50",
          "logging.progress_bar=false", "checkpoint.every_steps=null"]
RUNS = {  # name: (trainer, the objective's overrides)
    "alone": ("trainloop", []),
    "jsd": ("trainloop", ["objective=distill", "objective.beta=0.5"]),
    "fkl": ("trainloop", ["objective=distill", "objective.beta=0"]),
    "trl-jsd": ("trl", ["objective=distill", "objective.beta=0.5"]),
    "trl-fkl": ("trl", ["objective=distill", "objective.beta=0"]),
}


def conversation(rng: random.Random) -> list[dict]:
    digits = [rng.randrange(10) for _ in range(TASK["digits"])]
    return [{"role": "user", "content": "sort " + " ".join(map(str, digits))},
            {"role": "assistant", "content": " ".join(map(str, sorted(digits)))}]


def write_task(work: Path) -> None:
    rng = random.Random(0)
    held_out = set()
    for name in ("held_out", "train"):
        rows = []
        while len(rows) < TASK[name]:
            messages = conversation(rng)
            key = messages[0]["content"]
            if name == "train" and key in held_out:
                continue  # held-out prompts are never trained on
            held_out.add(key) if name == "held_out" else None
            rows.append({"messages": messages})
        (work / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def trainloop(work: Path, name: str, overrides: list[str]) -> Path:
    import trainloop as tl

    return tl.train(overrides, run_dir=work / name).run_dir / "final"


def make_student(work: Path, teacher: Path) -> Path:
    """The student's starting weights: the teacher's config at 2 blocks, seed 0; the teacher's tokenizer."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(teacher)
    config.num_hidden_layers = 2
    torch.manual_seed(0)
    student = work / "student-init"
    AutoModelForCausalLM.from_config(config).save_pretrained(student)
    AutoTokenizer.from_pretrained(teacher).save_pretrained(student)
    return student


def trl(work: Path, name: str, overrides: list[str]) -> Path:
    """GKDTrainer off-policy (lmbda 0), its arguments read from the composed trainloop config: TRL 1.16 keeps
    it in trl.experimental."""
    import datasets
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl.experimental.gkd import GKDConfig, GKDTrainer

    from trainloop.config.compose import compose_config

    cfg = compose_config(overrides)
    o, opt, out = cfg.objective, cfg.optimizer, work / name
    args = GKDConfig(
        output_dir=str(out), report_to=[], save_strategy="no", disable_tqdm=True, logging_steps=50,
        max_steps=cfg.trainer.max_steps, per_device_train_batch_size=cfg.data.batch_size, seed=cfg.trainer.seed,
        max_length=cfg.data.seq_len, learning_rate=opt.lr, weight_decay=opt.weight_decay, adam_beta1=opt.betas[0],
        adam_beta2=opt.betas[1], adam_epsilon=opt.eps, lr_scheduler_type=cfg.scheduler.name,
        warmup_steps=cfg.scheduler.warmup_steps, max_grad_norm=cfg.trainer.max_grad_norm, bf16=False, fp16=False,
        gradient_checkpointing=False, use_cpu=not torch.cuda.is_available(), dataloader_num_workers=0,
        lmbda=0.0, beta=o.beta, temperature=o.temperature, seq_kd=False)
    student = AutoModelForCausalLM.from_pretrained(cfg.model.name_or_path, dtype=torch.float32)
    teacher = AutoModelForCausalLM.from_pretrained(o.teacher, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.name_or_path)
    rows = datasets.Dataset.from_list([json.loads(line) for line in (work / "train.jsonl").read_text().splitlines()])
    trainer = GKDTrainer(model=student, teacher_model=teacher, args=args, train_dataset=rows, processing_class=tokenizer)
    trainer.train()
    if trainer.state.global_step != cfg.trainer.max_steps:
        raise RuntimeError(f"TRL ran {trainer.state.global_step} steps, not {cfg.trainer.max_steps}")
    trainer.save_model(str(out))
    tokenizer.save_pretrained(out)
    return out


def score(model_dir: Path, held_out: Path) -> dict:
    """The reply's NLL per target token, teacher-forced, and greedy decoding's exact-match share."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainloop.data.chat_template import chat_tokens
    from trainloop.data.tokenizer import IGNORE

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    template = tokenizer.chat_template
    nll, tokens, right = 0.0, 0, 0
    rows = [json.loads(line)["messages"] for line in held_out.read_text().splitlines()]
    with torch.no_grad():
        for messages in rows:
            ids, labels = chat_tokens(messages, tokenizer, template, "assistant")
            ids_t, labels_t = torch.tensor([ids]), torch.tensor([labels])
            logits = model(input_ids=ids_t).logits[0, :-1]
            targets = labels_t[0, 1:]
            keep = targets != IGNORE
            nll += torch.nn.functional.cross_entropy(logits[keep], targets[keep], reduction="sum").item()
            tokens += int(keep.sum())
            prompt = tokenizer.apply_chat_template(messages[:1], chat_template=template, add_generation_prompt=True,
                                                   tokenize=True, return_dict=False)
            out = model.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False,
                                 pad_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id)
            said = tokenizer.decode(out[0, len(prompt):], skip_special_tokens=True).strip()
            right += said == messages[1]["content"]
    return {"nll": nll / tokens, "exact": right / len(rows)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, nargs="+", help="student step counts (default 100 400; --quick 4)")
    parser.add_argument("--teacher-steps", type=int, help="the teacher's steps (default 2000; --quick 4)")
    parser.add_argument("--quick", action="store_true", help="a few steps of every run: checks the benchmark "
                        "runs; its figures mean nothing")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    steps = args.steps or ([4] if args.quick else [100, 400])
    teacher_steps = args.teacher_steps or (4 if args.quick else 2000)
    if args.quick:
        TASK.update(train=64, held_out=8)
    began = time.time()
    results: dict = {}
    with tempfile.TemporaryDirectory(prefix="bench_distill_") as tmp:
        work = Path(tmp)
        write_task(work)
        data, held_out = [f"data.path={work / 'train.jsonl'}"], work / "held_out.jsonl"
        teacher = trainloop(work, "teacher", [*COMMON, *SHAPE, *data, "model.num_layers=4",
                                              f"trainer.max_steps={teacher_steps}"])
        results["teacher"] = {"steps": teacher_steps, **score(teacher, held_out)}
        student = make_student(work, teacher)
        results["untrained student"] = {"steps": 0, **score(student, held_out)}
        print(f"teacher: {results['teacher']}; untrained student: {results['untrained student']}", file=sys.stderr)
        for n in steps:
            for name, (side, own) in RUNS.items():
                overrides = [*COMMON, *data, "model=hf", f"model.name_or_path={student}", f"trainer.max_steps={n}",
                             *own, *([f"objective.teacher={teacher}"] if own else [])]
                started = time.time()
                final = (trainloop if side == "trainloop" else trl)(work, f"{name}-{n}", overrides)
                results[f"{name} {n}"] = {"steps": n, **score(final, held_out), "run_s": time.time() - started}
                print(f"{name} {n}: {results[f'{name} {n}']}", file=sys.stderr, flush=True)
    print(f"\ntrainloop bench_distill: sorting {TASK['digits']} digits, {TASK['train']} training and {TASK['held_out']} "
          f"held-out conversations, batch 16, lr 1e-3 cosine; teacher 4x128 ({teacher_steps} steps), student 2x128; "
          f"{time.time() - began:.0f} s in all")
    print("| run | steps | held-out NLL / token | exact replies |")
    print("|---|---:|---:|---:|")
    for name, r in results.items():
        print(f"| {name} | {r['steps']} | {r['nll']:.3f} | {r['exact']:.2f} |")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
