"""The final model in Hugging Face format, checked against the live model before it counts.

Written once, by the main process, from the full weights; under ZeRO-3 they are gathered
from every rank first.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from trainloop.parallel import full_shape, full_state_dict

log = logging.getLogger("trainloop")


def live_shapes(model) -> dict[str, tuple[int, ...]]:
    """Parameter names and full shapes, whatever part of them this rank holds."""
    return {name: full_shape(p) for name, p in model.named_parameters()}


def saved_shapes(directory: Path) -> dict[str, tuple[int, ...]]:
    from safetensors import safe_open

    shapes = {}
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            for key in f.keys():
                shapes[key] = tuple(f.get_slice(key).get_shape())
    return shapes


def check_export(directory: Path, expected: dict[str, tuple[int, ...]]) -> int:
    """Every live parameter is in the files with its shape; returns the parameter count."""
    saved = saved_shapes(directory)
    missing = sorted(set(expected) - set(saved))
    wrong = sorted(k for k in expected if k in saved and saved[k] != expected[k])
    if missing or wrong:
        raise RuntimeError(
            f"export to {directory} is incomplete: {len(missing)} parameter(s) missing "
            f"{missing[:5]}, {len(wrong)} with the wrong shape {wrong[:5]}; the model was not saved"
        )
    count = sum(_numel(s) for s in expected.values())
    empty = [k for k in expected if _numel(saved[k]) == 0 and _numel(expected[k])]
    if empty:
        raise RuntimeError(f"export to {directory} wrote empty tensors for {empty[:5]}")
    return count


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def check_token_ids(directory: Path, tokenizer) -> None:
    """config.json and generation_config.json name the tokenizer's own bos/eos/pad ids, each
    inside the vocabulary: an id the model cannot emit, or one naming another token, makes
    `generate` run on past the end of the text or stop in the middle of it."""
    from trainloop.model import SPECIAL_TOKENS

    vocab = json.loads((directory / "config.json").read_text())["vocab_size"]
    wanted = {key: getattr(tokenizer, key) for key in SPECIAL_TOKENS}
    for name in ("config.json", "generation_config.json"):
        written = json.loads((directory / name).read_text())
        for key, value in wanted.items():
            ids = written.get(key)
            outside = [i for i in (ids if isinstance(ids, list) else [ids]) if i is not None and not 0 <= i < vocab]
            if outside:
                raise RuntimeError(f"{directory / name}: {key}={ids} is outside the vocabulary of {vocab} tokens")
            if ids != value and not (isinstance(ids, list) and value in ids):
                raise RuntimeError(f"{directory / name}: {key}={ids}, but the tokenizer's is {value}")


def export_model(accelerator, model, tokenizer, directory: Path) -> None:
    """Gather the full weights (all ranks take part), write them once, and verify the files.

    A failed check on the main process is raised on every rank, so none waits for it forever.
    """
    from accelerate.utils import broadcast_object_list

    if accelerator.device.type == "cpu":
        # save_pretrained unwraps through accelerate, which imports DeepSpeed whenever it is
        # installed, used or not; on a CPU DeepSpeed's own detection picks the same, with a banner.
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    state_dict = full_state_dict(accelerator, model)
    outcome = [None]
    if accelerator.is_main_process:
        try:
            unwrapped = accelerator.unwrap_model(model)
            if not state_dict:
                raise RuntimeError("the gathered state dict of the final model is empty")
            unwrapped.save_pretrained(directory, state_dict=state_dict, safe_serialization=True)
            tokenizer.save_pretrained(directory)
            count = check_export(directory, live_shapes(unwrapped))
            check_token_ids(directory, tokenizer)
            log.info("saved the final model (%s parameters) to %s", f"{count:,}", directory)
        except Exception as err:  # noqa: BLE001 - handed to every rank below
            outcome = [f"{type(err).__name__}: {err}"]
    if accelerator.num_processes > 1:
        broadcast_object_list(outcome, from_process=0)
    if outcome[0] is not None:
        raise RuntimeError(f"exporting the final model to {directory} failed: {outcome[0]}")
