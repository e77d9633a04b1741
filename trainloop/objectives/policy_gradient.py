"""GRPO's loss, apart from its rollouts (trainloop.objectives.grpo): TRL 1.16's advantages (`group_advantages`),
per-token policy losses (`policy_loss`, objective.loss_type) and their sums over a batch's units (`summed_loss`), and
the completion tokens' log-probabilities they read (`completion_logps`). Functions of tensors and the objective's
config alone: tests/test_grpo*.py check them against TRL's own code on the same tensors."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported where used: config checks read the constants without loading torch
    import torch

# the losses that clip the policy ratio to [1 - epsilon, 1 + epsilon_high] (PPO's surrogate), then the others
CLIPPED = ("dapo", "grpo", "dr_grpo", "bnpo", "luspo")
LOSS_TYPES = (*CLIPPED, "cispo", "sapo", "vespo")
LEVELS = ("token", "sequence")
SCALES = ("group", "batch", "none")


def group_advantages(rewards: torch.Tensor, weights: torch.Tensor, group: int, scale: str,
                     batch_moments=None) -> tuple[torch.Tensor, torch.Tensor]:
    """TRL's advantages (multi_objective_aggregation=sum_then_normalize): rewards [completions,
    functions] (NaN where a function returned None), consecutive `group` rows per prompt. The
    weighted sum per completion (NaN where no function applied), minus its group's mean, divided by
    the group's or the batch's std + 1e-4 unless scale is none; 0 for an unscored completion.
    `batch_moments(rewards)` -> (mean, std) over every rank's rewards of the step (scale=batch).
    Returns (advantages, the summed rewards)."""
    import torch

    unscored = torch.isnan(rewards).all(1)
    summed = (rewards * weights[None]).nansum(1)
    summed[unscored] = torch.nan
    grouped = summed.view(-1, group)
    mean = torch.nanmean(grouped, 1).repeat_interleave(group)
    if scale == "group":
        std = nanstd(grouped, 1).repeat_interleave(group)
    elif scale == "batch":
        std = batch_moments(summed)[1].expand_as(summed)
    advantages = summed - mean
    if scale != "none":
        advantages = advantages / (std + 1e-4)
    return torch.nan_to_num(advantages, nan=0.0), summed


def nanstd(x: torch.Tensor, dim=None) -> torch.Tensor:
    """The std of the values that are not NaN, with Bessel's correction (NaN for fewer than 2): TRL's."""
    import torch

    mean = torch.nanmean(x, dim=dim, keepdim=True)
    variance = torch.nanmean((x - mean) ** 2, dim=dim, keepdim=True)
    count = (~torch.isnan(x)).sum(dim=dim, keepdim=True)
    variance = variance * torch.where(count > 1, count / (count - 1), torch.full_like(variance, torch.nan))
    return variance.sqrt().squeeze(dim) if dim is not None else variance.sqrt().squeeze()


def policy_loss(logps, old_logps, advantages, mask, o, epsilon_high: float, ref_logps=None,
                kept=None) -> tuple[torch.Tensor, dict]:
    """The per-token loss of objective.loss_type (`o`: the objective's config), TRL 1.16's
    _compute_loss: the policy term times `kept` (the top_entropy_quantile tokens; None: all), plus
    beta x the ratio x the k3 estimate of the KL to the reference. The ratio to the sampling policy
    is per token, or (importance_sampling_level=sequence) one per completion, (completions, 1).
    Also, detached: "clipped" (per token or completion: where a clipped loss's ratio left its
    range, or cispo's exceeded its cap, on the side the advantage pushes), "kl" (per token) and
    vespo's "phi" (per completion)."""
    import torch

    advantages = advantages[:, None]
    log_ratio = logps - old_logps
    if o.importance_sampling_level == "sequence":
        ratio = torch.exp((log_ratio * mask).sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1))
    else:
        ratio = torch.exp(log_ratio)
    parts = {}
    if o.loss_type == "cispo":  # the capped ratio weighs the log-probability's gradient; none flows through it
        per_token = -torch.clamp(ratio, max=epsilon_high).detach() * advantages * logps
        parts["clipped"] = ((ratio > epsilon_high) & (advantages > 0)).float()
    elif o.loss_type == "sapo":  # sigmoid(t (r - 1)) x 4 / t: slope 1 at r = 1, as the plain ratio's
        t = torch.where(advantages > 0, o.sapo_temperature_pos, o.sapo_temperature_neg)
        per_token = -torch.sigmoid(t * (ratio - 1)) * 4 / t * advantages
    elif o.loss_type == "vespo":
        parts["phi"] = gamma_weights(log_ratio, advantages, mask, o)
        per_token = -parts["phi"] * advantages * logps
    else:
        clipped = torch.clamp(ratio, 1 - o.epsilon, 1 + epsilon_high)
        per_token = -torch.min(ratio * advantages, clipped * advantages)
        parts["clipped"] = (((ratio < 1 - o.epsilon) & (advantages < 0))
                            | ((ratio > 1 + epsilon_high) & (advantages > 0))).float()
    if kept is not None:
        per_token = per_token * kept
    if o.beta != 0.0:  # times the ratio, TRL's default (use_bias_correction_kl): the unbiased reverse-KL gradient
        kl = (torch.exp(ref_logps - logps) - (ref_logps - logps) - 1) * ratio
        per_token = per_token + o.beta * kl
        parts["kl"] = kl.detach()
    return per_token, parts


def gamma_weights(log_ratio, advantages, mask, o) -> torch.Tensor:
    """VESPO's weight of each completion, (completions, 1), no gradient: phi(w) = e^lambda w^k e^(-lambda w)
    (1 at w = 1) of its whole ratio w (the exp of its summed log-ratio, each clamped as TRL does), k and
    lambda those of the advantage's sign."""
    import math

    import torch

    floor = math.log(1e-8)
    with torch.no_grad():
        log_w = torch.clamp((torch.clamp(log_ratio, -20.0, 20.0) * mask).sum(1, keepdim=True), floor, 20.0)
        upward = advantages >= 0
        k = torch.where(upward, o.vespo_k_pos, o.vespo_k_neg)
        lam = torch.where(upward, o.vespo_lambda_pos, o.vespo_lambda_neg).clamp(min=1e-4)
        return torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def summed_loss(per_token, mask, loss_type: str, max_new_tokens: int) -> torch.Tensor:
    """The batch's loss summed over its units (GRPO.count): completion tokens for dapo, cispo and
    vespo; completions for grpo and sapo (each one's token mean), luspo (its token sum) and dr_grpo
    (its token sum / max_new_tokens); the micro-batch for bnpo (its token mean)."""
    masked = per_token * mask  # a completion's one ratio (sequence level) counts on each of its tokens
    if loss_type in ("grpo", "sapo"):
        return (masked.sum(1) / mask.sum(1).clamp(min=1)).sum()
    if loss_type == "bnpo":
        return masked.sum() / mask.sum().clamp(min=1)
    if loss_type == "dr_grpo":
        return masked.sum() / max_new_tokens
    return masked.sum()


def completion_logps(model, batch: dict, temperature: float, entropy: bool = False):
    """Each completion token's log-probability [completions, tokens] at the sampling temperature
    (TRL divides the logits by it), from one forward of prompt + completion; entropy: and each
    one's entropy, at the same temperature and without gradient (a pair)."""
    from trainloop.data.tokenizer import IGNORE
    from trainloop.objectives.chunked_loss import token_logps

    width = batch["completion_mask"].shape[1]
    labels = batch["input_ids"].clone()
    labels[:, :-width] = IGNORE  # the prompt's tokens are no one's target
    inputs = {key: batch[key] for key in ("input_ids", "attention_mask", "position_ids")} | {"use_cache": False}
    out = token_logps(model, inputs, labels, 0, temperature, entropy)
    return tuple(t[:, -width:] for t in out) if entropy else out[:, -width:]
