"""Odds ratio preference optimisation (ORPO, Hong et al. 2024) on preference pairs (data=preference), with
no reference model: supervised fine-tuning on the chosen rows and a preference term in one loss. As TRL
1.16 computes it (trl.experimental.orpo's ORPOTrainer), a micro-batch's loss is

    the chosen rows' next-token loss, a mean over their tokens (prompt and completion, as TRL's is)
    - the mean over its pairs of objective.beta x log sigmoid(log odds(chosen) - log odds(rejected))

where a completion's odds are p / (1 - p) of its mean log-probability per completion token. TRL's next-token
term is a mean over one micro-batch's tokens; here it is a mean over the step's (every micro-batch and rank:
`step_batches` counts them before the step), so the step is the same however its rows are split into
micro-batches and processes, and is TRL's for a step of one micro-batch on one process. Its units are its
pairs. An evaluation's loss is the whole validation split's, as one batch's. Chosen and rejected go through
the model in one forward. rewards/* are objective.beta x those mean log-probabilities, logps/* the means, as
TRL logs them, with TRL's nll_loss, log_odds_ratio and log_odds_chosen beside.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from trainloop.data.tokenizer import IGNORE
from trainloop.objectives.base import not_yet
from trainloop.objectives.pairs import SUMS, PairObjective, sums

if TYPE_CHECKING:  # imported where used: config checks read the table without loading torch
    import torch


@dataclass
class ORPOConfig:
    """TRL's ORPOConfig defaults (the paper's lambda is beta here, as in TRL)."""

    beta: float = 0.1  # the odds-ratio term's weight beside the chosen rows' next-token loss


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, without cancellation: log1p(-exp(x)) far from 0, log(-expm1(x)) near it."""
    import torch

    return torch.where(x < -math.log(2), torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def chosen_targets(batch: dict) -> torch.Tensor:
    """Each chosen row's next-token targets: its prompt's and completion's tokens after the first."""
    return (whole_row_labels(batch["chosen_input_ids"], batch["chosen_labels"])[:, 1:] != IGNORE).sum(1)


def whole_row_labels(ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Every token of each right-padded row up to its completion's end as a target (the prompt's too), IGNORE
    after: what TRL's ORPO takes the chosen rows' next-token loss over."""
    import torch

    positions = torch.arange(ids.shape[1], device=ids.device)
    end = torch.where(labels != IGNORE, positions + 1, 0).amax(1, keepdim=True)
    return torch.where(positions < end, ids, IGNORE)


class ORPO(PairObjective):
    name = "orpo"
    pretrained_lr = (1e-06, "ORPOConfig")
    keys = ORPOConfig
    # SUMS, TRL's three (each summed once a pair), and the chosen rows' NLL summed over their tokens and the
    # tokens, from which an evaluation's loss is taken whole
    sum_names = (*SUMS, "nll_loss", "log_odds_ratio", "log_odds_chosen", "nll_summed", "nll_tokens")

    def __init__(self, cfg, device):
        super().__init__(cfg, device)
        self.beta = cfg.objective.beta
        self.token_weight = None  # this step's pairs / its chosen tokens, over every rank (step_batches)

    @staticmethod
    def problems(cfg) -> list[str]:
        problems = []
        if not 0 < cfg.objective.beta < math.inf:
            problems.append(f"objective.beta={cfg.objective.beta} must be greater than 0 (TRL's default is 0.1)")
        return problems + not_yet(cfg, "orpo")

    def step_batches(self, strategy, model, group: list[dict] | None, step: int) -> list[dict]:
        """The step's micro-batches as read; and its pairs / its chosen tokens over every rank (one reduce), the
        weight of each micro-batch's summed next-token loss: divided by the step's pairs, it is the step's NLL
        over all its chosen tokens."""
        import torch

        counts = [torch.stack([chosen_targets(b).sum(), b["chosen_labels"].new_tensor(len(b["chosen_labels"]))])
                  for b in group]
        tokens, pairs = strategy.reduce_sum(torch.stack(counts).sum(0).double().to(strategy.device)).tolist()
        self.token_weight = pairs / max(tokens, 1.0)
        return group

    def pair_losses(self, model, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        return self.weighed_losses(model, batch, self.token_weight)

    def eval_sums(self, model, batch: dict) -> torch.Tensor:
        return self.weighed_losses(model, batch, None)[1]

    def weighed_losses(self, model, batch: dict, weight: float | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Each pair's loss (its share of the batch's next-token loss x `weight`, less its odds-ratio term) and
        the sums of `sum_names` over the batch. `weight` None: the batch is the step (this batch's pairs / its
        chosen tokens), as outside a run's loop (the planner, an evaluation)."""
        import torch
        import torch.nn.functional as F

        from trainloop.objectives.chunked_loss import token_logps

        chosen_ids, chosen_labels = batch["chosen_input_ids"], batch["chosen_labels"]
        whole = whole_row_labels(chosen_ids, chosen_labels)
        per_token = token_logps(model, {"input_ids": torch.cat([chosen_ids, batch["rejected_input_ids"]]),
                                        "use_cache": False},
                                torch.cat([whole, batch["rejected_labels"]]), self.chunk)
        chosen_tokens, rejected_tokens = per_token.chunk(2)
        completion = chosen_labels[:, 1:] != IGNORE
        rejected_completion = batch["rejected_labels"][:, 1:] != IGNORE
        chosen = (chosen_tokens * completion).sum(1) / completion.sum(1).clamp(min=1)
        rejected = rejected_tokens.sum(1) / rejected_completion.sum(1).clamp(min=1)  # 0 off the completion
        summed, tokens, pairs = -chosen_tokens.sum(), (whole[:, 1:] != IGNORE).sum(), len(chosen)
        if weight is None:
            weight = pairs / max(tokens.item(), 1)
        log_odds = (chosen - rejected) - (log1mexp(chosen) - log1mexp(rejected))
        ratio = F.logsigmoid(log_odds)
        losses = summed * weight / pairs - self.beta * ratio  # summed over the step's pairs: its NLL x its pairs
        chosen, rejected = chosen.detach(), rejected.detach()
        extra = torch.stack([summed.detach() * weight, ratio.detach().sum(), log_odds.detach().sum(),
                             summed.detach(), tokens.to(summed.dtype)]).double()
        return losses, torch.cat([sums(losses, self.beta * chosen, self.beta * rejected, chosen, rejected), extra])

    def means(self, total: torch.Tensor) -> dict:
        return {k: v for k, v in super().means(total).items() if k not in ("nll_summed", "nll_tokens")}

    def eval_values(self, total: torch.Tensor) -> dict:
        """The validation split's loss as one batch's: its chosen NLL over all its chosen tokens, less the mean
        odds-ratio term over all its pairs; and its rewards, log-probabilities and log odds."""
        names = self.sum_names
        nll = total[names.index("nll_summed")].item() / max(total[names.index("nll_tokens")].item(), 1.0)
        ratio = total[names.index("log_odds_ratio")].item() / max(total[names.index("pairs")].item(), 1.0)
        return {"eval_loss": nll - self.beta * ratio, **self.means(total), "nll_loss": nll}
