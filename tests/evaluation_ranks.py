"""Each objective's evaluation at step 0, built by trainloop's own build(), on the processes this
runs in: `torchrun --nproc_per_node 2 tests/evaluation_ranks.py DIR 4` or, in-process, `evaluations(DIR, 8)`.
Rank 0 prints {case: evaluation} as one JSON line. Every case's validation split is not a whole
number of global batches of 8, and most leave rank 1 of 2 with nothing in the last one, so a padded
or dropped item, or a rank that skips a forward under FSDP2, shows (tests/test_evaluation.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

DATA = Path(__file__).resolve().parent / "data"
THIS = Path(__file__).resolve()

SMOKE, FSDP = "+preset=smoke", "+preset=[smoke,fsdp]"
# case -> its overrides; the validation items of each: causal_lm 9 blocks,
# chat 11, dpo 12 pairs, simpo 10, grpo 10 prompts (8 + 1 to 4: rank 1's last share is empty)
CASES = {
    "causal_lm": [SMOKE, "data=files", "data.path={dir}/text.jsonl", "data.validation_fraction=0.3"],
    "chat/fsdp2": [FSDP, "data=chat", "data.path={dir}/chat.jsonl", "data.validation_fraction=0.3"],
    "dpo": [SMOKE, "objective=dpo", "data=preference", f"data.path={DATA / 'preference.jsonl'}", "adapter=lora",
            "data.validation_fraction=0.25"],
    "simpo": [SMOKE, "objective=simpo", "data=preference", f"data.path={DATA / 'preference.jsonl'}",
              "data.validation_fraction=0.2"],
    "grpo": [SMOKE, "objective=grpo", "data=prompts", f"data.path={DATA / 'prompts.jsonl'}", "objective.num_generations=2",
             f"objective.rewards=[{THIS}:answer_letter]", "objective.max_new_tokens=4",
             "data.validation_fraction=0.5"],
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
    """{case: its evaluation} at data.batch_size, on the processes this runs in."""
    from conftest import compose, reset_accelerate
    from trainloop.accelerator import build_accelerator
    from trainloop.build import build
    from trainloop.parallel import build_strategy

    write_data(directory)
    found = {}
    for case, overrides in CASES.items():
        reset_accelerate()
        cfg = compose("trainer.eval_batches=null", f"data.batch_size={batch_size}",
                      *(o.format(dir=directory) for o in overrides))
        strategy = build_strategy(cfg, build_accelerator(cfg))
        built = build(cfg, strategy)
        found[case] = {"valid": len(built.valid_set), **built.objective.evaluate(
            strategy, built.model, built.valid_loader, cfg.trainer.eval_batches)}
    return found


if __name__ == "__main__":
    sys.path.insert(0, str(THIS.parent))  # conftest's compose
    import torch.distributed as dist

    dist.init_process_group("gloo")  # one group for every case's accelerator
    found = evaluations(Path(sys.argv[1]), int(sys.argv[2]))
    if dist.get_rank() == 0:
        print(json.dumps(found))
    dist.barrier()
    dist.destroy_process_group()
