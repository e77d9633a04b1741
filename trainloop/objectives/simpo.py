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
from typing import TYPE_CHECKING

from trainloop.objectives.base import BatchLoss, Objective
from trainloop.objectives.dpo import completion_logps
from trainloop.tokenizer import IGNORE

if TYPE_CHECKING:  # imported where used: config checks read the table without loading torch
    import torch

# The sums a window or an evaluation keeps (float64, on the device), then reduces over the ranks.
SUMS = ("loss", "pairs", "rewards/chosen", "rewards/rejected", "rewards/accuracy", "rewards/margin",
        "logps/chosen", "logps/rejected")


def mean_completion_logps(model, batch: dict) -> torch.Tensor:
    """Each sequence's log-probability per completion token (chosen rows, then rejected), from one
    forward of both: the tokens counted are those whose log-probabilities are summed (labels[1:])."""
    import torch

    summed, _ = completion_logps(model, batch)
    labels = torch.cat([batch["chosen_labels"], batch["rejected_labels"]])
    return summed / (labels[:, 1:] != IGNORE).sum(1).clamp(min=1)


class SimPO(Objective):
    name = "simpo"
    pairs = True
    reads = ("objective.beta", "objective.gamma", "objective.label_smoothing")

    def __init__(self, cfg, device):
        import torch

        o = cfg.objective
        self.beta, self.gamma, self.label_smoothing = o.beta, o.gamma, o.label_smoothing
        self.sums = torch.zeros(len(SUMS), dtype=torch.float64, device=torch.device(device))  # since the last train line

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
        if cfg.model.name == "tiny" and cfg.model.arch == "mixtral":  # its forward's aux_loss would go unused
            problems.append("objective=simpo does not add a mixture's router loss (model.router_aux_loss_coef): "
                            "use model.arch=llama or gpt2")
        if cfg.trainer.auto_batch_size:  # the search's trial forwards go through batch_loss, into the window's sums
            problems.append("objective=simpo does not search a batch size yet (its trial steps would count in the "
                            "first log line's rewards): set trainer.auto_batch_size=false")
        return problems

    def count(self, batch: dict) -> torch.Tensor:
        import torch

        return torch.tensor(batch["chosen_input_ids"].shape[0], device=batch["chosen_input_ids"].device)

    def pair_losses(self, model, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """Each pair's loss, and SUMS over the batch's pairs (detached)."""
        import torch
        import torch.nn.functional as F

        chosen, rejected = mean_completion_logps(model, batch).chunk(2)
        logits = self.beta * (chosen - rejected) - self.gamma
        s = self.label_smoothing
        losses = -(1 - s) * F.logsigmoid(logits) - s * F.logsigmoid(-logits)
        chosen, rejected = chosen.detach(), rejected.detach()
        chosen_rewards, rejected_rewards = self.beta * chosen, self.beta * rejected
        # a tie is a coin flip: half right
        accuracy = (chosen_rewards > rejected_rewards).sum() + 0.5 * (chosen_rewards == rejected_rewards).sum()
        sums = torch.stack([losses.detach().sum(), torch.tensor(float(len(losses)), device=losses.device),
                            chosen_rewards.sum(), rejected_rewards.sum(), accuracy,
                            (chosen_rewards - rejected_rewards).sum(), chosen.sum(), rejected.sum()])
        return losses, sums.double()

    def batch_loss(self, model, batch: dict) -> BatchLoss:
        losses, sums = self.pair_losses(model, batch)
        self.sums += sums.to(self.sums.device)
        return BatchLoss(losses.sum())

    def eval_sums(self, model, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        losses, _ = self.pair_losses(model, batch)
        return losses.sum(), self.count(batch)

    @staticmethod
    def means(total: torch.Tensor) -> dict:
        pairs = max(total[1].item(), 1.0)
        return {key: total[i].item() / pairs for i, key in enumerate(SUMS) if i > 1}

    def window(self, strategy) -> dict:
        total = strategy.reduce_sum(self.sums)
        self.sums = self.sums.new_zeros(self.sums.shape)
        return self.means(total)

    def evaluate(self, strategy, model, loader, max_batches: int | None) -> dict:
        """The SimPO loss per pair over the validation split (all ranks), and its rewards and log-probabilities."""
        import torch

        model.eval()
        total = torch.zeros(len(SUMS), dtype=torch.float64, device=strategy.device)
        with torch.no_grad():
            for i, batch in enumerate(loader):
                if max_batches is not None and i >= max_batches:
                    break
                total += self.pair_losses(model, batch)[1].to(total.device)
        model.train()
        total = strategy.reduce_sum(total)
        return {"eval_loss": total[0].item() / max(total[1].item(), 1.0), **self.means(total)}
