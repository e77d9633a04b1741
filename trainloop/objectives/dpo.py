"""Direct preference optimisation on preference pairs (data=preference): the policy's log-ratio
to a reference on the chosen completion against the rejected one, as TRL 1.16's DPOTrainer
computes it (`_compute_loss`): objective.loss_type sigmoid (the DPO paper's), ipo (its log-ratios
averaged over the completion's tokens, as TRL has it), hinge, or robust (objective.label_smoothing).

The reference is the policy with its LoRA adapters disabled (adapter=lora): no second copy. Chosen
and rejected go through the model in one forward, concatenated on the batch dimension. A batch's
units are its pairs, so a step's loss is the mean over the pairs of the global batch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainloop.objectives.base import BatchLoss, Objective
from trainloop.tokenizer import IGNORE

if TYPE_CHECKING:  # imported where used: config checks read the table without loading torch
    import torch
LOSS_TYPES = ("sigmoid", "ipo", "hinge", "robust")

# The sums a window or an evaluation keeps (float64, on the device), then reduces over the ranks.
SUMS = ("loss", "pairs", "rewards/chosen", "rewards/rejected", "rewards/accuracy", "rewards/margin",
        "logps/chosen", "logps/rejected")


def completion_logps(model, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence's summed log-probability of its completion tokens, chosen rows first then
    rejected, from one forward of both; and each one's completion tokens."""
    import torch
    import torch.nn.functional as F

    ids = torch.cat([batch["chosen_input_ids"], batch["rejected_input_ids"]])
    labels = torch.cat([batch["chosen_labels"], batch["rejected_labels"]])
    logits = model(input_ids=ids, use_cache=False).logits
    per_token = -F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(),
                                 ignore_index=IGNORE, reduction="none").view(ids.shape[0], -1)
    return per_token.sum(1), (labels != IGNORE).sum(1)


def reference_model(model):
    """The peft model under a data-parallel wrapper (DDP's .module), whose adapters can be disabled."""
    return model if hasattr(model, "disable_adapter") else model.module


class DPO(Objective):
    name = "dpo"
    pairs = True
    reads = ("objective.beta", "objective.loss_type", "objective.label_smoothing")

    def __init__(self, cfg, device):
        import torch

        o = cfg.objective
        self.beta, self.loss_type, self.label_smoothing = o.beta, o.loss_type, o.label_smoothing
        self.device = torch.device(device)
        self.sums = torch.zeros(len(SUMS), dtype=torch.float64, device=self.device)  # since the last train line

    @staticmethod
    def problems(cfg) -> list[str]:
        o, problems = cfg.objective, []
        if cfg.adapter.name != "lora":
            problems.append("objective=dpo needs adapter=lora for now: its reference is the model with the adapters "
                            "disabled (a full fine-tune's frozen reference copy, and objective.precompute_reference, "
                            "are the next slice)")
        if o.loss_type not in LOSS_TYPES:
            problems.append(f"objective.loss_type={o.loss_type} is not one of: {', '.join(LOSS_TYPES)}")
        if not o.beta > 0:
            problems.append(f"objective.beta={o.beta} must be greater than 0")
        if o.loss_type == "robust" and not 0.0 <= o.label_smoothing < 0.5:
            problems.append(f"objective.label_smoothing={o.label_smoothing} must be in [0, 0.5)")
        if o.loss_type != "robust" and o.label_smoothing != 0.0:
            problems.append(f"objective.label_smoothing={o.label_smoothing} is read only by objective.loss_type=robust "
                            f"(objective.loss_type is {o.loss_type}): choose robust, or drop it")
        if cfg.deepspeed.stage or cfg.fsdp.name != "none":
            problems.append("objective=dpo runs on one process or DDP in this slice: use deepspeed=none and fsdp=none")
        if cfg.trainer.auto_batch_size:
            problems.append("objective=dpo does not search a batch size yet: set trainer.auto_batch_size=false")
        return problems

    def count(self, batch: dict) -> torch.Tensor:
        import torch

        return torch.tensor(batch["chosen_input_ids"].shape[0], device=batch["chosen_input_ids"].device)

    def pair_losses(self, model, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """Each pair's loss, and SUMS over the batch's pairs (detached)."""
        import torch
        import torch.nn.functional as F

        with torch.no_grad(), reference_model(model).disable_adapter():
            reference, _ = completion_logps(reference_model(model), batch)
        logps, tokens = completion_logps(model, batch)
        chosen_ratio, rejected_ratio = (logps - reference).chunk(2)
        delta = chosen_ratio - rejected_ratio
        if self.loss_type == "sigmoid":
            losses = -F.logsigmoid(self.beta * delta)
        elif self.loss_type == "hinge":
            losses = torch.relu(1 - self.beta * delta)
        elif self.loss_type == "ipo":  # TRL's: log-ratios per completion token (its authors' normalised form)
            chosen_tokens, rejected_tokens = tokens.chunk(2)
            ipo_delta = chosen_ratio / chosen_tokens.clamp(min=1) - rejected_ratio / rejected_tokens.clamp(min=1)
            losses = (ipo_delta - 1 / (2 * self.beta)) ** 2
        else:  # robust
            s = self.label_smoothing
            losses = (-(1 - s) * F.logsigmoid(self.beta * delta) + s * F.logsigmoid(-self.beta * delta)) / (1 - 2 * s)
        chosen_rewards, rejected_rewards = (self.beta * chosen_ratio.detach(), self.beta * rejected_ratio.detach())
        chosen_logps, rejected_logps = logps.detach().chunk(2)
        sums = torch.stack([losses.detach().sum(), torch.tensor(float(len(losses)), device=losses.device),
                            chosen_rewards.sum(), rejected_rewards.sum(), (chosen_rewards > rejected_rewards).sum(),
                            (chosen_rewards - rejected_rewards).sum(), chosen_logps.sum(), rejected_logps.sum()])
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
        """The DPO loss per pair over the validation split (all ranks), and its rewards and log-probabilities."""
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
