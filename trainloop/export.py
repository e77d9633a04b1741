"""The final model in Hugging Face format, checked against the live model before it counts.

Written once, by the main process, from the full weights; under ZeRO-3 they are gathered
from every rank first.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from trainloop.model.tensors import full_shape

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
    """Every live parameter is in the files with its shape; returns the parameter count.

    transformers writes some architectures in their checkpoints' layout (Mixtral: each expert's
    w1/w2/w3 where the live model stacks the experts, the router as block_sparse_moe.gate): live
    parameters under no saved name must then equal, element for element, the saved tensors that
    have no live name.
    """
    saved = saved_shapes(directory)
    missing = sorted(set(expected) - set(saved))
    wrong = sorted(k for k in expected if k in saved and saved[k] != expected[k])
    renamed = {k: saved[k] for k in set(saved) - set(expected)}
    if missing and sum(_numel(expected[k]) for k in missing) == sum(map(_numel, renamed.values())):
        if any(_numel(s) == 0 for s in renamed.values()):
            raise RuntimeError(f"export to {directory} wrote empty tensors for {sorted(renamed)[:5]}")
        missing = []
    if missing or wrong:
        raise RuntimeError(
            f"export to {directory} is incomplete: {len(missing)} parameter(s) missing "
            f"{missing[:5]}, {len(wrong)} with the wrong shape {wrong[:5]}; the model was not saved"
        )
    count = sum(_numel(s) for s in expected.values())
    empty = [k for k in expected if k in saved and _numel(saved[k]) == 0 and _numel(expected[k])]
    if empty:
        raise RuntimeError(f"export to {directory} wrote empty tensors for {empty[:5]}")
    return count


def check_values(directory: Path, state_dict: dict) -> None:
    """Every tensor written equals the gathered weight of that name, bit for bit: a shard, a
    replica's stale copy or a cast would differ. One tensor in memory at a time."""
    import torch
    from safetensors import safe_open

    differ = []
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            for key in f.keys():
                if key in state_dict and not torch.equal(f.get_tensor(key), state_dict[key].cpu()):
                    differ.append(key)
    if differ:
        raise RuntimeError(f"export to {directory}: {len(differ)} tensor(s) differ from the gathered "
                           f"live weights, e.g. {differ[:5]}")


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def check_token_ids(directory: Path, tokenizer, generates: bool = True) -> None:
    """config.json and generation_config.json name the tokenizer's own bos/eos/pad ids, each
    inside the vocabulary: an id the model cannot emit, or one naming another token, makes
    `generate` run on past the end of the text or stop in the middle of it (or a score head read
    its score at another token). A model that does not generate (a score head) has no
    generation_config.json."""
    from trainloop.model.builder import SPECIAL_TOKENS

    config = json.loads((directory / "config.json").read_text())
    vocab = config.get("vocab_size") or config["text_config"]["vocab_size"]  # a vision-language model's: its text's
    wanted = {key: getattr(tokenizer, key) for key in SPECIAL_TOKENS}
    for name in ("config.json", "generation_config.json")[:2 if generates else 1]:
        written = json.loads((directory / name).read_text())
        for key, value in wanted.items():
            ids = written.get(key)
            outside = [i for i in (ids if isinstance(ids, list) else [ids]) if i is not None and not 0 <= i < vocab]
            if outside:
                raise RuntimeError(f"{directory / name}: {key}={ids} is outside the vocabulary of {vocab} tokens")
            if ids != value and not (isinstance(ids, list) and value in ids):
                raise RuntimeError(f"{directory / name}: {key}={ids}, but the tokenizer's is {value}")


def export_model(strategy, model, tokenizer, directory: Path, cfg=None) -> None:
    """Gather the full weights (all ranks take part), write them once, and verify the files.

    With an adapter (cfg.adapter), `directory` gets the merged model and `directory/adapter`
    the adapter alone (export_adapter_run).

    A failed check on the main process is raised on every rank, so none waits for it forever.
    """
    from accelerate.utils import broadcast_object_list
    from transformers.utils import logging as transformers_logging

    accelerator = strategy.accelerator
    state_dict = strategy.full_state_dict(model)
    outcome = [None]
    if accelerator.is_main_process:
        bars = transformers_logging.is_progress_bar_enabled()
        try:
            # transformers' own "Writing model shards" bar would break the run's progress bar and log
            transformers_logging.disable_progress_bar()
            unwrapped = strategy.whole_model(model)
            if not state_dict:
                raise RuntimeError("the gathered state dict of the final model is empty")
            if cfg is not None and cfg.adapter.name != "none":
                export_adapter_run(cfg, unwrapped, state_dict, tokenizer, directory)
            else:
                export_full(unwrapped, state_dict, tokenizer, directory)
        except Exception as err:  # noqa: BLE001 - handed to every rank below
            outcome = [f"{type(err).__name__}: {err}"]
        finally:
            if bars:  # as it was: a user may have turned transformers' bars off
                transformers_logging.enable_progress_bar()
    if strategy.world_size > 1:
        broadcast_object_list(outcome, from_process=0)
    if outcome[0] is not None:
        raise RuntimeError(f"exporting the final model to {directory} failed: {outcome[0]}")


def for_inference(model):
    """The KV cache back on in config.json and generation_config.json: training turns it off
    (trainloop.model.builder), and a model saved that way generates without a cache, 2-3x slower."""
    model.config.use_cache = True
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.use_cache = True
    return model


def save_tokenizer(tokenizer, directory: Path) -> None:
    """The tokenizer, or a vision-language model's processor around it (its image processor and chat template
    too, as AutoProcessor loads them), carrying the chat template the rows were rendered with."""
    from trainloop.model.vision import processor_of

    processor = processor_of(tokenizer)
    if processor is not None:
        processor.chat_template = tokenizer.chat_template
    (processor or tokenizer).save_pretrained(directory)


def export_full(model, state_dict: dict, tokenizer, directory: Path) -> None:
    for_inference(model).save_pretrained(directory, state_dict=state_dict, safe_serialization=True)
    save_tokenizer(tokenizer, directory)
    count = check_export(directory, live_shapes(model))
    check_values(directory, state_dict)
    check_token_ids(directory, tokenizer, generates=getattr(model, "generation_config", None) is not None)
    log.info("saved the final model (%s parameters) to %s", f"{count:,}", directory)


DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def export_adapter_run(cfg, peft_model, state_dict: dict, tokenizer, directory: Path) -> None:
    """Main process: write `directory/adapter` (the adapter alone, as PeftModel.from_pretrained
    loads it) and `directory` (base + adapter merged, a plain model in the precision's dtype),
    each checked before the run counts as done: the adapter's tensors equal the live ones and
    are not empty (an empty adapter is what an export that trusted ZeRO-3's state dict wrote),
    and the merged model's logits equal the unmerged model's to 1e-4."""
    import torch
    from peft.utils import get_peft_model_state_dict

    live = get_peft_model_state_dict(peft_model, state_dict=state_dict)
    if not live or any(v.numel() == 0 for v in live.values()):
        raise RuntimeError(f"the gathered adapter is empty ({len(live)} tensors): nothing to export")
    peft_model.save_pretrained(directory / "adapter", state_dict=state_dict, safe_serialization=True)
    check_adapter(directory / "adapter", live)
    unmerged = _rebuilt_adapter_model(cfg, peft_model, state_dict, live)
    merged = merge_checked(unmerged)
    merged.to(getattr(torch, DTYPES[cfg.precision.name]))
    for_inference(merged).save_pretrained(directory, safe_serialization=True)
    save_tokenizer(tokenizer, directory)
    count = check_export(directory, live_shapes(merged))
    check_token_ids(directory, tokenizer, generates=getattr(merged, "generation_config", None) is not None)
    log.info("saved the merged model (%s parameters) to %s and its adapter (%s parameters) to %s",
             f"{count:,}", directory, f"{sum(v.numel() for v in live.values()):,}", directory / "adapter")


def check_adapter(directory: Path, live: dict) -> None:
    """The written adapter holds exactly the live adapter's tensors."""
    import torch
    from safetensors.torch import load_file

    written = load_file(directory / "adapter_model.safetensors")
    if set(written) != set(live):
        raise RuntimeError(f"{directory} holds {sorted(written)[:3]}..., not the live adapter's "
                           f"{len(live)} tensors {sorted(live)[:3]}...")
    differ = [k for k in live if not torch.equal(written[k].to(live[k].dtype), live[k].cpu())]
    if differ:
        raise RuntimeError(f"{directory}: {differ[:5]} differ from the live adapter")


def _rebuilt_adapter_model(cfg, peft_model, state_dict: dict, adapter_state: dict):
    """A CPU fp32 copy of the trained model, base + adapter unmerged, built from the gathered
    weights (the live one may be sharded or wrapped). A quantized base is replaced by the
    original pretrained weights: the merged export is the unquantized base plus the adapter."""
    import torch
    from peft.utils import set_peft_model_state_dict

    from trainloop.model.adapter import wrap_lora
    from trainloop.model.builder import SPECIAL_TOKENS, carry_token_ids
    from trainloop.model.heads import auto_class
    from trainloop.model.vision import is_vision
    from trainloop.objectives import OBJECTIVES

    live_config, head = peft_model.get_base_model().config, OBJECTIVES[cfg.objective.name].head
    vision, vocab = is_vision(live_config), live_config.get_text_config().vocab_size
    if cfg.model.quantization != "none":
        base = auto_class(head, vision).from_pretrained(cfg.model.name_or_path, dtype=torch.float32,
                                                        **({"num_labels": 1} if head == "score" else {}))
        if base.get_input_embeddings().num_embeddings < vocab:
            base.resize_token_embeddings(vocab)
        model = wrap_lora(base, cfg.adapter, head)
        set_peft_model_state_dict(model, adapter_state)
    else:
        base = auto_class(head, vision).from_config(live_config, dtype=torch.float32)
        model = wrap_lora(base, cfg.adapter, head)
        _load_full(model, state_dict)
    ids = {key: getattr(live_config, key, None) for key in SPECIAL_TOKENS}
    carry_token_ids(model.get_base_model().config, ids)
    if getattr(model.get_base_model(), "generation_config", None) is not None:  # a score head generates nothing
        carry_token_ids(model.get_base_model().generation_config, ids)
    return model.eval()


def _load_full(model, state_dict: dict) -> None:
    """Load every gathered weight; only tied aliases (lm_head sharing the embedding) may be absent."""
    named_once = {name for name, _ in model.named_parameters()}
    aliases = {name for name, _ in model.named_parameters(remove_duplicate=False)} - named_once
    missing, unexpected = model.load_state_dict({k: v.float() for k, v in state_dict.items()}, strict=False)
    if unexpected or set(missing) - aliases:
        raise RuntimeError(f"the gathered weights do not fit the rebuilt model: missing "
                           f"{sorted(set(missing) - aliases)[:5]}, unexpected {sorted(unexpected)[:5]}")


def merge_checked(model, tolerance: float = 1e-4):
    """Merge the adapter into the base weights; its logits must equal the unmerged model's."""
    import torch

    vocab = model.get_base_model().config.get_text_config().vocab_size
    ids = torch.arange(32).remainder(vocab).unsqueeze(0)
    with torch.no_grad():
        before = model(input_ids=ids).logits
        merged = model.merge_and_unload()
        after = merged(input_ids=ids).logits
    worst = (before - after).abs().max().item()
    if not worst <= tolerance:
        raise RuntimeError(f"the merged model's logits differ from base + adapter by {worst:.3g} "
                           f"(more than {tolerance})")
    return merged
