"""What the objectives on preference pairs share (data=preference: dpo, simpo): each pair is one
unit, chosen and rejected go through the model in one forward, and every train and eval line
carries the rewards and log-probabilities of the window's or the validation split's pairs.

A row subclasses PairObjective and answers `pair_losses(model, batch)`: each pair's loss and the
batch's SUMS (from `sums`). A step's loss is then the mean over the pairs of the global batch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainloop.data.tokenizer import IGNORE
from trainloop.objectives.base import BatchLoss, Objective

if TYPE_CHECKING:  # imported where used: config checks read the table without loading torch
    import torch

# The sums a window or an evaluation keeps (float64, on the device), then reduces over the ranks.
SUMS = ("loss", "pairs", "rewards/chosen", "rewards/rejected", "rewards/accuracy", "rewards/margin",
        "logps/chosen", "logps/rejected")


def completion_logps(model, batch: dict, chunk: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence's summed log-probability of its completion tokens, chosen rows first then
    rejected, from one forward of both; and each one's completion tokens. `chunk`
    (trainer.loss_chunk_tokens): the output layer scores that many tokens at a time, never
    holding the full logits (trainloop.objectives.chunked_loss); 0: through the full logits."""
    import torch

    from trainloop.objectives.chunked_loss import token_logps

    ids = torch.cat([batch["chosen_input_ids"], batch["rejected_input_ids"]])
    labels = torch.cat([batch["chosen_labels"], batch["rejected_labels"]])
    per_token = token_logps(model, {"input_ids": ids, "use_cache": False}, labels, chunk)
    return per_token.sum(1), (labels != IGNORE).sum(1)


def sums(losses, chosen_rewards, rejected_rewards, chosen_logps=None, rejected_logps=None) -> torch.Tensor:
    """SUMS over a batch's pairs (float64, detached); without log-probabilities (a reward model's),
    the first six. A tie in accuracy counts half (a coin flip): at step 0 a policy that is its
    reference rewards every completion 0, and reads 0.5 (TRL counts a tie as a miss: 0)."""
    import torch

    chosen_rewards, rejected_rewards = chosen_rewards.detach(), rejected_rewards.detach()
    correct = (chosen_rewards > rejected_rewards).sum() + 0.5 * (chosen_rewards == rejected_rewards).sum()
    logps = [] if chosen_logps is None else [chosen_logps.detach().sum(), rejected_logps.detach().sum()]
    return torch.stack([losses.detach().sum(), torch.tensor(float(len(losses)), device=losses.device),
                        chosen_rewards.sum(), rejected_rewards.sum(), correct,
                        (chosen_rewards - rejected_rewards).sum(), *logps]).double()


class PairObjective(Objective):
    pairs = True
    sequences = 2  # chosen and rejected, in one forward
    chunks_loss = True  # completion_logps reads trainer.loss_chunk_tokens
    headline = ("rewards/accuracy", "rewards/margin")
    sum_names = SUMS  # what pair_losses' sums hold, in order

    def __init__(self, cfg, device):
        import torch

        self.chunk = cfg.trainer.loss_chunk_tokens
        self.device = torch.device(device)
        # since the last train line
        self.sums = torch.zeros(len(self.sum_names), dtype=torch.float64, device=self.device)

    def pair_losses(self, model, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """Each pair's loss, and SUMS over the batch's pairs (`sums`)."""
        raise NotImplementedError

    def forward_inputs(self, batch: dict) -> dict:
        """Chosen rows then rejected, in one forward (each right-padded to data.seq_len: no mask needed)."""
        import torch

        return {"input_ids": torch.cat([batch["chosen_input_ids"], batch["rejected_input_ids"]])}

    def count(self, batch: dict) -> torch.Tensor:
        import torch

        return torch.tensor(batch["chosen_input_ids"].shape[0], device=batch["chosen_input_ids"].device)

    def batch_loss(self, model, batch: dict) -> BatchLoss:
        losses, batch_sums = self.pair_losses(model, batch)
        self.sums += batch_sums.to(self.sums.device)
        return BatchLoss(losses.sum())

    def eval_sums(self, model, batch: dict) -> torch.Tensor:
        """SUMS: the summed loss and the pairs first, then the rewards and log-probabilities."""
        return self.pair_losses(model, batch)[1]

    def means(self, total: torch.Tensor) -> dict:
        pairs = max(total[1].item(), 1.0)
        return {key: total[i].item() / pairs for i, key in enumerate(self.sum_names) if i > 1}

    def window(self, strategy) -> dict:
        total = strategy.reduce_computed(self.sums)
        self.sums = self.sums.new_zeros(self.sums.shape)
        return self.means(total)

    def eval_values(self, total: torch.Tensor) -> dict:
        """The loss per pair over the validation split, and its rewards and log-probabilities."""
        return {"eval_loss": total[0].item() / max(total[1].item(), 1.0), **self.means(total)}
