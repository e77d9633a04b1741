"""Each objective's evaluation at step 0, built by trainloop's own build(), on the processes this
runs in: `torchrun --nproc_per_node 2 tests/evaluation_ranks.py DIR 4`, or 2 warm ranks (rank 0 prints
{case: evaluation} as one JSON line), or `evaluations(DIR, 8)` in one process (tests/test_evaluation.py).
No case's validation split is a whole number of global batches of 8, so an item padded in or
dropped moves its numbers, and a rank left without items must still join every forward (FSDP2)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from helpers import compose, reset_accelerate

DATA = Path(__file__).resolve().parent / "data"
THIS = Path(__file__).resolve()

SMOKE, FSDP = "+preset=smoke", "+preset=[smoke,fsdp]"
# case -> its overrides. The validation items: 12 text blocks, 12 pairs (dpo), 10 (simpo, reward), 17 rows (kto),
# 10 prompts,
# 17 chat blocks (under FSDP2, the last in-process: it leaves a group of one): 8k + 1 to 4 each, so
# rank 1 of 2 has no item in the last micro-step
CASES = {
    "causal_lm": [SMOKE, "data=files", "data.path={dir}/text.jsonl", "data.validation_fraction=0.3"],
    "dpo": [SMOKE, "objective=dpo", "data=preference", f"data.path={DATA / 'preference.jsonl'}",
            "data.validation_fraction=0.25"],  # a full fine-tune: its reference copy runs every forward too
    "simpo": [SMOKE, "objective=simpo", "data=preference", f"data.path={DATA / 'preference.jsonl'}",
              "data.validation_fraction=0.2"],
    "orpo": [SMOKE, "objective=orpo", "data=preference", f"data.path={DATA / 'preference.jsonl'}",
             "data.validation_fraction=0.2"],
    "reward": [SMOKE, "objective=reward", "data=preference", f"data.path={DATA / 'preference.jsonl'}",
               "data.validation_fraction=0.2"],
    "kto": [SMOKE, "objective=kto", "data=unpaired", f"data.path={DATA / 'unpaired.jsonl'}",
            "data.validation_fraction=0.17"],  # a full fine-tune; its KL estimate reduced over the ranks' micro-batch
    "grpo": [SMOKE, "objective=grpo", "data=prompts", f"data.path={DATA / 'prompts.jsonl'}",
             "objective.num_generations=2", f"objective.rewards=[{THIS}:answer_letter]", "objective.max_new_tokens=4",
             "data.validation_fraction=0.5"],
    "chat/fsdp2": [FSDP, "data=chat", "data.path={dir}/chat.jsonl", "data.validation_fraction=0.3"],
}


def answer_letter(prompts, completions, answer, **columns):
    """A reward that tells the prompts apart whatever the model writes: a repeated or lost prompt moves the mean."""
    return [ord(a[0]) - ord("a") + len(c) / 100 for a, c in zip(answer, completions)]


def write_data(directory: Path) -> None:
    """Small text and chat files: one build takes a second."""
    chat = [{"messages": [{"role": "user", "content": f"what is {i} times three?" + " Think." * (i % 4)},
                          {"role": "assistant", "content": f"{3 * i}" + " indeed" * (i % 3)}]} for i in range(60)]
    text = [{"text": f"{i} times three is {3 * i}." * (1 + i % 5)} for i in range(40)]
    for name, rows in (("chat", chat), ("text", text)):
        (directory / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def evaluations(directory: Path, batch_size: int) -> dict:
    """{case: its evaluation} at data.batch_size, on the processes this runs in (write_data's files
    in `directory`). One process is left as found: no process group, no launcher variables."""
    import os

    import torch.distributed as dist

    from trainloop.parallel.accelerator import build_accelerator
    from trainloop.build import build
    from trainloop.parallel import build_strategy

    found, environ, grouped = {}, dict(os.environ), dist.is_initialized()
    try:
        for case, overrides in CASES.items():
            reset_accelerate()
            cfg = compose("trainer.eval_batches=null", f"data.batch_size={batch_size}",
                          *(o.format(dir=directory) for o in overrides))
            strategy = build_strategy(cfg, build_accelerator(cfg))
            built = build(cfg, strategy)
            found[case] = {"valid": len(built.valid_set), **built.objective.evaluate(
                strategy, built.model, built.valid_loader, cfg.trainer.eval_batches)}
    finally:
        if dist.is_initialized() and not grouped:  # FSDP2's group of one
            dist.destroy_process_group()
        os.environ.clear()
        os.environ.update(environ)
    return found


if __name__ == "__main__":
    import torch.distributed as dist

    dist.init_process_group("gloo")  # one group for every case's accelerator
    found = evaluations(Path(sys.argv[1]), int(sys.argv[2]))
    if dist.get_rank() == 0:
        print(json.dumps(found))
    dist.barrier()
    dist.destroy_process_group()
