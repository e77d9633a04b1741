"""Optimizer and learning-rate schedule from their config groups."""

from __future__ import annotations

import torch

from trainloop.config import ConfigError, OptimizerConfig, SchedulerConfig


def parameter_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices and embeddings; never biases or norm weights (the 1-D parameters).

    Under ZeRO-3 every parameter is an empty 1-D placeholder; ds_shape is its real shape.
    An empty group is left out: DeepSpeed drops it, and the scheduler must see the same groups.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    matrix = [len(getattr(p, "ds_shape", p.shape)) >= 2 for p in params]
    groups = [
        {"params": [p for p, m in zip(params, matrix) if m], "weight_decay": weight_decay},
        {"params": [p for p, m in zip(params, matrix) if not m], "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


def _bitsandbytes():
    try:
        import bitsandbytes
    except ImportError as err:
        raise ConfigError(f"the 8-bit optimizers need bitsandbytes ({err}): "
                          "pip install bitsandbytes, or choose optimizer=adamw") from None
    return bitsandbytes


def build_optimizer(cfg: OptimizerConfig, model: torch.nn.Module, on_cuda: bool) -> torch.optim.Optimizer:
    groups = parameter_groups(model, cfg.weight_decay)
    betas = tuple(cfg.betas)
    if cfg.name == "adamw":
        impl = "fused" if cfg.impl == "auto" and on_cuda else cfg.impl
        kwargs = {"fused": True} if impl == "fused" else {"foreach": impl == "foreach"} if impl != "auto" else {}
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=betas, eps=cfg.eps, **kwargs)
    if cfg.name == "sgd":
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum)
    if cfg.name == "adafactor":
        from transformers.optimization import Adafactor

        return Adafactor(groups, lr=cfg.lr, scale_parameter=False, relative_step=False, warmup_init=False)
    if cfg.name in ("adamw8bit", "paged_adamw8bit"):
        bnb = _bitsandbytes()
        cls = bnb.optim.AdamW8bit if cfg.name == "adamw8bit" else bnb.optim.PagedAdamW8bit
        return cls(groups, lr=cfg.lr, betas=betas, eps=cfg.eps)
    raise ConfigError(f"optimizer.name={cfg.name!r} is not known")


def build_scheduler(cfg: SchedulerConfig, optimizer: torch.optim.Optimizer, max_steps: int):
    from transformers import get_scheduler

    name = {"cosine": "cosine", "linear": "linear", "constant": "constant_with_warmup"}[cfg.name]
    return get_scheduler(name, optimizer, num_warmup_steps=cfg.warmup_steps, num_training_steps=max_steps)
