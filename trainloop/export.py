"""The final model in Hugging Face format, checked against the live model before it counts."""

from __future__ import annotations

import logging
from pathlib import Path

log = logging.getLogger("trainloop")


def live_shapes(model) -> dict[str, tuple[int, ...]]:
    """Parameter names and full shapes; under ZeRO-3 a partitioned parameter keeps its ds_shape."""
    return {name: tuple(getattr(p, "ds_shape", p.shape)) for name, p in model.named_parameters()}


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


def export_model(accelerator, model, tokenizer, directory: Path) -> None:
    """Gather the full weights (all ranks take part), write them once, and verify the files."""
    state_dict = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        unwrapped = accelerator.unwrap_model(model)
        if not state_dict:
            raise RuntimeError("accelerate gathered an empty state dict for the final model; "
                               "under ZeRO-3 set deepspeed.gather_16bit_weights_on_model_save=true")
        unwrapped.save_pretrained(directory, state_dict=state_dict, safe_serialization=True)
        tokenizer.save_pretrained(directory)
        count = check_export(directory, live_shapes(unwrapped))
        log.info("saved the final model (%s parameters) to %s", f"{count:,}", directory)
    accelerator.wait_for_everyone()
