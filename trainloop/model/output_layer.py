"""The model's output layer, as the chunked loss (trainer.loss_chunk_tokens) reaches it: a plain Linear whose
output is the logits, nothing applied after it."""

from __future__ import annotations

import torch

from trainloop.errors import ConfigError

KEY = "trainer.loss_chunk_tokens"

# model config attributes that change the logits after the output layer (Gemma's soft-capping,
# Cohere's scale, Granite's divisor): a loss taken from the output layer's input would miss them
LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def output_layer(model) -> torch.nn.Linear:
    """The model's output layer through its wrappers (DDP's and DeepSpeed's .module; peft forwards
    get_output_embeddings to the model it adapts), refused unless a plain Linear with nothing
    applied to its logits afterwards."""
    inner = model
    while not hasattr(inner, "get_output_embeddings") and hasattr(inner, "module"):
        inner = inner.module
    head = inner.get_output_embeddings()
    if type(head) is not torch.nn.Linear:  # a LoRA-wrapped, quantized or custom head computes otherwise
        raise ConfigError(f"{KEY} needs the model's output layer to be a plain torch.nn.Linear, and it is "
                          f"{type(head).__name__} (an adapter's target or modules_to_save, or quantized?): "
                          f"leave the output layer out of adapter.target_modules/modules_to_save, or set {KEY}=0")
    config = getattr(inner, "config", None)
    changed = [name for name in LOGIT_TRANSFORMS if getattr(config, name, None) not in (None, 1.0)]
    if changed:
        raise ConfigError(f"{KEY}: this model changes its logits after the output layer ({', '.join(changed)}), "
                          f"which the chunked loss does not apply: set {KEY}=0")
    return head
