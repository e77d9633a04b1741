"""A reward model on preference pairs (data=preference): the network with a scalar score head in
place of its output layer (transformers' AutoModelForSequenceClassification, num_labels 1), trained
so that the chosen completion scores above the rejected one, as TRL 1.16's RewardTrainer computes
it (`compute_loss`): the Bradley-Terry loss -log sigmoid(r_chosen - r_rejected - margin), with the
data's `margin` column where its rows have one, plus objective.center_rewards_coefficient x
(r_chosen + r_rejected)^2, which keeps the rewards centred on zero.

A sequence's reward is the score at its last token that is not padding (the model config's
pad_token_id: the tokenizer's pad, else its eos), as transformers reads it, so RUN_DIR/final/
loads with AutoModelForSequenceClassification alone and scores a text as training did. With an
adapter the score head trains whole beside the adapters (peft's sequence-classification task).
A batch's units are its pairs; the train and eval lines carry the rewards, the accuracy (a tie
counts half) and the margin.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from trainloop.objectives.base import not_yet
from trainloop.objectives.pairs import PairObjective, sums
from trainloop.parallel.degrees import SCORE_HEAD

if TYPE_CHECKING:  # imported where used: config checks read the table without loading torch
    import torch

MARGIN = "margin"  # the data's column of per-pair margins (TRL's name), carried by data=preference where rows have it


@dataclass
class RewardConfig:
    # adds this x the mean of (r_chosen + r_rejected)^2 to the loss, pulling the rewards towards zero (TRL's
    # center_rewards_coefficient; it suggests 0.01); 0: off
    center_rewards_coefficient: float = 0.0


class Reward(PairObjective):
    name = "reward"
    needs = (SCORE_HEAD,)
    pretrained_lr = (0.0001, "RewardConfig")
    keys = RewardConfig
    head = "score"
    chunks_loss = False  # one score per sequence: no logits over the vocabulary to chunk
    sum_names = ("loss", "pairs", "rewards/chosen", "rewards/rejected", "rewards/accuracy", "rewards/margin")

    def __init__(self, cfg, device):
        super().__init__(cfg, device)
        self.center = cfg.objective.center_rewards_coefficient

    @staticmethod
    def problems(cfg) -> list[str]:
        import math

        problems = []
        if not 0 <= cfg.objective.center_rewards_coefficient < math.inf:
            problems.append(f"objective.center_rewards_coefficient={cfg.objective.center_rewards_coefficient} must "
                            "be 0 (off) or more (TRL suggests 0.01)")
        problems += not_yet(cfg, "reward")
        if cfg.eval.prompts:
            problems.append("eval.prompts: objective=reward trains a score head, which writes no text to sample: "
                            "set eval.prompts=[]")
        return problems

    def rewards(self, model, batch: dict) -> torch.Tensor:
        """Each sequence's reward, chosen rows then rejected, from one forward of both, in float32.

        Under context parallelism each rank runs its slice of the rows (padded with the pad id to split
        evenly), and the model reads each row's score at the slice's last token that is not padding: on the
        rank whose slice holds the row's last one, that is the row's reward (the tokens before it in the
        slice are not padding, those after are). Each row's is kept from that rank alone and summed over the
        group, so every rank holds the rewards one process computes, and the gradient reaches that rank's
        forward only."""
        import torch
        import torch.nn.functional as F

        from trainloop.parallel import context

        ids = self.forward_inputs(batch)["input_ids"]
        cp = context.of(model)
        if cp is None:
            return model(input_ids=ids, use_cache=False).logits.squeeze(-1).float()
        from trainloop.model.attention import with_document_mask

        pad = getattr(model, "module", model).config.pad_token_id  # inside DDP's wrapper too
        ids = F.pad(ids, (0, cp.padding(ids.shape[1])), value=pad)
        positions = torch.arange(ids.shape[1], device=ids.device)
        holder = (positions * (ids != pad)).argmax(-1) // (ids.shape[1] // cp.size)  # transformers' last token
        scores = model(**cp.local(with_document_mask(model, {"input_ids": ids, "use_cache": False}))).logits
        return cp.total(scores.squeeze(-1).float() * (holder == cp.rank))

    def pair_losses(self, model, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """Each pair's loss (their mean is TRL's loss of the batch), and the sums over the batch's pairs."""
        import torch.nn.functional as F

        chosen, rejected = self.rewards(model, batch).chunk(2)
        delta = chosen - rejected
        if MARGIN in batch:
            delta = delta - batch[MARGIN].to(delta.dtype)
        losses = -F.logsigmoid(delta)
        if self.center:
            losses = losses + self.center * (chosen + rejected) ** 2
        return losses, sums(losses, chosen, rejected)
