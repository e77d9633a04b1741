"""Simple preference optimisation (SimPO, Meng et al. 2024) on preference pairs (data=preference),
with no reference model. A completion's reward is objective.beta x its mean log-probability per
completion token; the loss asks the chosen reward to beat the rejected one by a margin
objective.gamma: -log sigmoid(beta x (mean chosen - mean rejected) - gamma), as TRL 1.16 computes
it (trl.experimental.cpo's CPOTrainer, loss_type="simpo", cpo_alpha=0), objective.label_smoothing
included (TRL's conservative form: a share s of the pairs taken as if their labels were flipped).

Nothing is held beside the policy, so it trains with any adapter (none, lora, qlora) and under
every strategy. Chosen and rejected go through the model in one forward, concatenated on the batch
dimension. A batch's units are its pairs, so a step's loss is the mean over the pairs of the
global batch. Its logps/* are means per completion token (dpo's are sums), as TRL's CPOTrainer
logs them for SimPO.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from trainloop.data.tokenizer import IGNORE
from trainloop.objectives.base import not_yet
from trainloop.objectives.pairs import PairObjective, completion_logps, sums

if TYPE_CHECKING:  # imported where used: config checks read the table without loading torch
    import torch


@dataclass
class SimPOConfig:
    """The defaults are the SimPO paper's Llama-3-Base setting (beta 2.0, gamma / beta 0.5; its other models
    use beta 2.0 to 2.5 and gamma / beta 0.1 to 0.8), whose learning rates are small too (3e-7 to 1e-6 for
    7-8B models)."""

    beta: float = 2.0  # the rewards are beta x log-prob per completion token
    gamma: float = 1.0  # the target reward margin, in the rewards' units (SimPO's gamma, TRL's simpo_gamma)
    label_smoothing: float = 0.0  # the assumed share of flipped labels, in [0, 0.5): TRL's conservative form; the paper uses none


def mean_completion_logps(model, batch: dict, chunk: int = 0) -> torch.Tensor:
    """Each sequence's log-probability per completion token (chosen rows, then rejected), from one
    forward of both: the tokens counted are those whose log-probabilities are summed (labels[1:])."""
    import torch

    summed, _ = completion_logps(model, batch, chunk)
    labels = torch.cat([batch["chosen_labels"], batch["rejected_labels"]])
    return summed / (labels[:, 1:] != IGNORE).sum(1).clamp(min=1)


class SimPO(PairObjective):
    name = "simpo"
    pretrained_lr = (1e-06, "CPOConfig")
    keys = SimPOConfig

    def __init__(self, cfg, device):
        super().__init__(cfg, device)
        o = cfg.objective
        self.beta, self.gamma, self.label_smoothing = o.beta, o.gamma, o.label_smoothing

    @staticmethod
    def problems(cfg) -> list[str]:
        o, problems = cfg.objective, []
        if not 0 < o.beta < math.inf:
            problems.append(f"objective.beta={o.beta} must be greater than 0 (the SimPO paper uses 2.0 to 2.5)")
        if not 0 <= o.gamma < math.inf:
            problems.append(f"objective.gamma={o.gamma} must be 0 or more: the reward margin the chosen completion "
                            "should win by (the SimPO paper uses about 0.5 x objective.beta)")
        if not 0.0 <= o.label_smoothing < 0.5:
            problems.append(f"objective.label_smoothing={o.label_smoothing} must be in [0, 0.5)")
        problems += not_yet(cfg, "simpo")
        return problems

    def pair_losses(self, model, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """Each pair's loss, and SUMS over the batch's pairs."""
        import torch.nn.functional as F

        chosen, rejected = mean_completion_logps(model, batch, self.chunk).chunk(2)
        logits = self.beta * (chosen - rejected) - self.gamma
        s = self.label_smoothing
        losses = -(1 - s) * F.logsigmoid(logits) - s * F.logsigmoid(-logits)
        chosen, rejected = chosen.detach(), rejected.detach()
        return losses, sums(losses, self.beta * chosen, self.beta * rejected, chosen, rejected)
