"""Next-token prediction: cross-entropy on every target token (labels not IGNORE), and, for a
mixture of experts (model.arch=mixtral), the router's load-balancing loss. With
trainer.loss_chunk_tokens=N the cross-entropy is taken N tokens at a time, never through the full
logits (trainloop/objectives/chunked_loss.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainloop.data.tokenizer import IGNORE
from trainloop.objectives.base import FORWARD_KEYS, BatchLoss, Objective, loss_sums

if TYPE_CHECKING:  # imported where used: config checks read the table without loading torch
    import torch


def model_inputs(batch: dict) -> dict:
    """What the model reads (FORWARD_KEYS): no attention mask with packed rows, whose documents the attention
    reads (trainloop.model.attention)."""
    return {key: batch[key] for key in FORWARD_KEYS if key in batch} | {"use_cache": False}


class CausalLM(Objective):
    """Summed, not averaged: a step's loss is divided once by all its target tokens, over every
    micro-batch and rank. With a router (model.arch=mixtral) each training forward's routing is
    recorded, and its load-balancing loss x model.router_aux_loss_coef is the penalty."""

    name = "causal_lm"
    images = True
    chunks_loss = True
    next_token_loss = True

    def __init__(self, cfg, device):
        from trainloop.model.compile import compile_forward_loss, compile_loss
        from trainloop.model.router import RouterLoad
        from trainloop.objectives.chunked_loss import targets_nll

        self.router = RouterLoad.for_model(cfg.model, device)
        self.chunk = cfg.trainer.loss_chunk_tokens
        self.nll = compile_loss(cfg.compile, targets_nll)
        # the forward and the loss as one graph, for the forwards whose output nothing reads
        self.forward_nll = compile_forward_loss(cfg.compile, targets_nll)

    def count(self, batch: dict) -> torch.Tensor:
        return (batch["labels"][:, 1:] != IGNORE).sum()

    def batch_loss(self, model, batch: dict) -> BatchLoss:
        from trainloop.objectives.chunked_loss import next_token_nll

        # a router reads the output's router logits: its model keeps the forward and the loss apart
        summed, output = next_token_nll(model, model_inputs(batch), batch["labels"], self.chunk, self.nll,
                                        self.forward_nll if self.router is None else None)
        if self.router is None:
            return BatchLoss(summed)
        self.router.record(output, batch)
        return BatchLoss(summed, self.router.coef * self.router.aux)

    def eval_sums(self, model, batch: dict) -> torch.Tensor:
        from trainloop.objectives.chunked_loss import next_token_nll

        # no routing recorded: the train line's window is training's
        summed, _ = next_token_nll(model, model_inputs(batch), batch["labels"], self.chunk, self.nll,
                                   self.forward_nll)
        return loss_sums(summed, self.count(batch))

    def window(self, strategy) -> dict:
        return self.router.window(strategy) if self.router is not None else {}
