"""Kahneman-Tversky optimisation (KTO, Ethayarajh et al. 2024) on unpaired preferences (data=unpaired):
one completion per row, labelled desirable or not, as TRL 1.16's KTOTrainer computes it (`_compute_loss`,
loss_type="kto"). A completion's reward is objective.beta x its log-ratio to the reference; a desirable
one's loss is objective.desirable_weight x (1 - sigmoid(beta x (log-ratio - KL))), an undesirable one's
objective.undesirable_weight x (1 - sigmoid(beta x (KL - log-ratio))). KL, the reference point, is
estimated from the mismatched pairs the data carries (each prompt with another row's completion): the
mean of their policy-to-reference log-ratios over the micro-batch of every rank, at least 0, with no
gradient, as TRL gathers it.

The reference is DPO's: with adapter=lora the policy with its adapters disabled (no second copy), for a
full fine-tune a frozen copy of the model as built, which the strategy shards like the policy. A batch's
units are its rows, so a step's loss is the mean over the rows of the global batch (TRL's mean over a
rank's batch, averaged over equal ranks).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from trainloop.data.formats.unpaired import KL, LABEL
from trainloop.objectives.base import BatchLoss, Objective, not_yet
from trainloop.parallel.degrees import FROZEN, SECOND_FORWARD

if TYPE_CHECKING:  # imported where used: config checks read the table without loading torch
    import torch

# What Objective.beside puts in a batch (a layout that runs the forward itself asks it): the reference's
# log-probabilities [rows, 2] (completion, mismatched), and the micro-batch's KL estimate
REFERENCE, KL_ESTIMATE = "reference_logps", "kl_estimate"
# The sums a window or an evaluation keeps (float64, on the device), then reduces over the ranks.
SUMS = ("loss", "rows", "rewards/chosen", "chosen", "rewards/rejected", "rejected", "kl", "micro_batches",
        "logps/chosen", "logps/rejected")


@dataclass
class KTOConfig:
    beta: float = 0.1  # how far the policy may move from the reference: the rewards are beta x log-ratios
    desirable_weight: float = 1.0  # the weight of a desirable completion's loss (TRL's desirable_weight)
    undesirable_weight: float = 1.0  # the weight of an undesirable completion's loss (TRL's undesirable_weight)


class KTO(Objective):
    name = "kto"
    needs = (FROZEN, SECOND_FORWARD)  # the reference; the policy's forward of the mismatched pairs (the KL term)
    pretrained_lr = (1e-06, "KTOConfig")
    keys = KTOConfig
    unpaired = True
    sequences = 1  # the completion: its mismatched one runs without gradients, as the reference does (not counted)
    chunks_loss = True
    headline = ("rewards/margin", "kl")

    def __init__(self, cfg, device):
        import torch

        o = cfg.objective
        self.beta, self.desirable, self.undesirable = o.beta, o.desirable_weight, o.undesirable_weight
        self.cfg, self.chunk = cfg, cfg.trainer.loss_chunk_tokens
        self.device = torch.device(device)
        self.frozen, self.strategy = None, None
        self.sums = torch.zeros(len(SUMS), dtype=torch.float64, device=self.device)  # since the last train line

    @staticmethod
    def problems(cfg) -> list[str]:
        import math

        o, problems = cfg.objective, []
        if not 0 < o.beta < math.inf:
            problems.append(f"objective.beta={o.beta} must be greater than 0")
        for key in ("desirable_weight", "undesirable_weight"):
            if not 0 < getattr(o, key) < math.inf:
                problems.append(f"objective.{key}={getattr(o, key)} must be greater than 0")
        problems += not_yet(cfg, "kto")
        return problems

    @staticmethod
    def memory_lines(plan, cfg) -> None:
        """A full fine-tune's reference copy, held like the policy's parameters; none with an adapter."""
        from trainloop.objectives.reference import plan_copy

        if cfg.adapter.name != "none":
            plan.notes.append("objective=kto with an adapter: the reference is the model with its adapters disabled, "
                              "no copy")
            return
        plan_copy(plan, "objective=kto")

    @classmethod
    def copies_model(cls, cfg) -> bool:
        return cfg.adapter.name == "none"

    def frozen_copy(self, model):
        """A full fine-tune's reference: the model as built, frozen; None with an adapter."""
        if not self.copies_model(self.cfg):
            return None
        import copy

        return copy.deepcopy(model).requires_grad_(False)

    def start(self, strategy, model, frozen, train_set, valid_set, run_dir) -> None:
        import logging

        self.frozen, self.strategy = frozen, strategy  # the KL estimate is reduced over the ranks in each forward
        if frozen is not None:
            logging.getLogger("trainloop").info("objective=kto: the reference is a frozen copy of the starting "
                                                "model, %s", strategy.holds_frozen(frozen))

    # -- the log-probabilities ----------------------------------------------------------------------
    def summed(self, model, batch: dict, prefix: str = "") -> torch.Tensor:
        """Each row's summed log-probability of its completion (prefix KL: of its mismatched one)."""
        from trainloop.objectives.chunked_loss import token_logps

        inputs = {"input_ids": batch[f"{prefix}input_ids"], "use_cache": False}
        return token_logps(model, inputs, batch[f"{prefix}labels"], self.chunk).sum(1)

    def logps(self, model, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's summed log-probability of its completion, and of its mismatched one. The mismatched
        forward runs first and without gradients (the KL estimate is detached: as TRL's, it keeps no
        activations for a backward), then the completion's."""
        import torch

        with torch.no_grad():
            mismatched = self.summed(model, batch, KL)
        return self.summed(model, batch), mismatched

    def reference_logps(self, model, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """The reference's (completion, mismatched): the frozen copy's, or the policy's with its adapters
        disabled; in eval mode, without gradients."""
        from trainloop.objectives.reference import reference_forward

        with reference_forward(model, self.frozen) as reference:
            return self.logps(reference, batch)

    def beside(self, strategy, model, batch: dict) -> dict:
        """The batch with the reference's log-probabilities (REFERENCE) and the KL estimate of the micro-batch
        (KL_ESTIMATE), their forwards and the policy's of the mismatched pairs run through strategy.computed: its
        loss then runs the completion's forward alone."""
        import torch

        from trainloop.objectives.reference import reference_forward

        mismatched_inputs = {"input_ids": batch[f"{KL}input_ids"]}

        def summed(prefix: str):
            return lambda forward: self.summed(forward, batch, prefix)

        mismatched = strategy.computed(self, model, batch, summed(KL), mismatched_inputs)
        with reference_forward(model, self.frozen) as frozen:
            reference = [strategy.computed(self, frozen, batch, summed(prefix), inputs)
                         for prefix, inputs in (("", None), (KL, mismatched_inputs))]
        return batch | {REFERENCE: torch.stack(reference, 1), KL_ESTIMATE: self.kl(mismatched - reference[1])}

    def kl(self, ratios: torch.Tensor) -> torch.Tensor:
        """The mean of the mismatched log-ratios over this micro-batch of every rank, at least 0, detached."""
        import torch

        total = torch.stack([ratios.detach().double().sum(), torch.tensor(float(len(ratios)), dtype=torch.float64,
                                                                           device=ratios.device)])
        if self.strategy is not None:
            total = self.strategy.reduce_sum(total)
        return (total[0] / total[1]).clamp(min=0).to(ratios.dtype)

    def row_losses(self, model, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's loss (their mean is TRL's loss of the batch), and the SUMS over the batch's rows."""
        import torch

        n = batch["input_ids"].shape[0]
        if KL_ESTIMATE in batch:  # beside ran the other forwards
            logps, reference, kl = self.summed(model, batch), batch[REFERENCE][:, 0], batch[KL_ESTIMATE]
        else:
            logps, mismatched = self.logps(model, batch)
            reference, reference_mismatched = self.reference_logps(model, batch)
            kl = self.kl(mismatched - reference_mismatched)
        ratio = logps - reference
        desirable = batch[LABEL].bool()
        losses = torch.where(desirable, self.desirable * (1 - torch.sigmoid(self.beta * (ratio - kl))),
                             self.undesirable * (1 - torch.sigmoid(self.beta * (kl - ratio))))
        rewards, chosen = (self.beta * ratio).detach(), desirable.double()
        sums = torch.stack([losses.detach().double().sum(), torch.tensor(float(n), device=losses.device).double(),
                            (rewards.double() * chosen).sum(), chosen.sum(), (rewards.double() * (1 - chosen)).sum(),
                            (1 - chosen).sum(), kl.double(), torch.ones((), dtype=torch.float64, device=kl.device),
                            (logps.detach().double() * chosen).sum(),
                            (logps.detach().double() * (1 - chosen)).sum()])
        return losses, sums

    # -- the objective's contract ---------------------------------------------------------------------
    def count(self, batch: dict) -> torch.Tensor:
        import torch

        return torch.tensor(batch["input_ids"].shape[0], device=batch["input_ids"].device)

    def batch_loss(self, model, batch: dict) -> BatchLoss:
        losses, sums = self.row_losses(model, batch)
        self.sums += sums.to(self.sums.device)
        return BatchLoss(losses.sum())

    def eval_sums(self, model, batch: dict) -> torch.Tensor:
        return self.row_losses(model, batch)[1]

    @staticmethod
    def means(total: torch.Tensor) -> dict:
        """The rewards and log-probabilities per desirable and undesirable row, their margin, and the mean KL
        estimate of the micro-batches. A side with no row is left out (and the margin with it), as TRL
        leaves it out, not logged as 0."""
        value = dict(zip(SUMS, (x.item() for x in total)))
        out = {f"{kind}/{side}": value[f"{kind}/{side}"] / value[side]
               for side in ("chosen", "rejected") if value[side] for kind in ("rewards", "logps")}
        out["kl"] = value["kl"] / max(value["micro_batches"], 1.0)
        if value["chosen"] and value["rejected"]:
            out["rewards/margin"] = out["rewards/chosen"] - out["rewards/rejected"]
        return out

    def window(self, strategy) -> dict:
        total = strategy.reduce_computed(self.sums)  # each micro-batch adds its global KL once a rank: the mean holds
        self.sums = self.sums.new_zeros(self.sums.shape)
        return self.means(total)

    def eval_values(self, total: torch.Tensor) -> dict:
        return {"eval_loss": total[0].item() / max(total[1].item(), 1.0), **self.means(total)}
