"""A mixture of experts' router (model.arch=mixtral): its load-balancing loss and where tokens go."""

from __future__ import annotations

import torch


class RouterLoad:
    """Reads each training forward's router output.

    `aux` is the last forward's load-balancing loss (Switch Transformer's, as transformers computes
    it over that micro-batch), for the loop to add to what it backpropagates. Until the next log
    line it also sums, on the device (no host sync per step), the aux losses and the tokens each
    expert was chosen for, over every layer.
    """

    def __init__(self, num_experts: int, experts_per_token: int, coef: float, device):
        self.num_experts, self.top_k, self.coef = num_experts, experts_per_token, coef
        self.aux = None
        self.aux_sum = torch.zeros((), device=device, dtype=torch.float64)
        self.tokens = torch.zeros(num_experts, device=device, dtype=torch.float64)
        self.forwards = 0

    @classmethod
    def for_model(cls, model_cfg, device) -> RouterLoad | None:
        if model_cfg.name != "tiny" or model_cfg.arch != "mixtral":
            return None
        return cls(model_cfg.num_experts, model_cfg.experts_per_token, model_cfg.router_aux_loss_coef, device)

    def record(self, output, batch: dict) -> None:
        self.aux = output.aux_loss
        self.aux_sum += self.aux.detach().double()
        self.forwards += 1
        mask = batch.get("attention_mask")  # padding is routed too, but counts for nothing (as in aux_loss)
        for logits in output.router_logits:  # one per layer: (tokens, experts)
            # the router's own choice: top-k of the softmax over the logits in fp32
            chosen = torch.softmax(logits.detach().float(), dim=-1).topk(self.top_k, dim=-1).indices
            weight = (torch.ones_like(chosen, dtype=torch.float64) if mask is None
                      else mask.reshape(-1, 1).expand_as(chosen).double())
            self.tokens.index_add_(0, chosen.flatten(), weight.flatten())

    def window(self, strategy) -> dict:
        """The log line's values over every data-parallel rank since the last one (one reduce); then
        starts anew. `strategy`: trainloop.parallel's."""
        both = strategy.reduce_sum(torch.cat([self.aux_sum.view(1), self.tokens]))
        forwards = max(self.forwards * strategy.dp_size, 1)
        aux, tokens = both[0].item() / forwards, both[1:]
        share = (tokens / tokens.sum().clamp(min=1)).tolist()
        self.aux_sum.zero_()
        self.tokens.zero_()
        self.forwards = 0
        return {"aux_loss": aux, "expert_token_share": share}
