"""Optimizer and learning-rate schedule from their config groups."""

from __future__ import annotations

from dataclasses import dataclass

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


def build_optimizer(cfg: OptimizerConfig, model: torch.nn.Module, on_cuda: bool,
                    cpu_offload: bool = False) -> torch.optim.Optimizer:
    """The optimizer over the weight-decay groups. `cpu_offload`: DeepSpeed keeps the optimizer
    state in CPU memory and steps it there, which needs its own vectorised CPU Adam."""
    groups = parameter_groups(model, cfg.weight_decay)
    betas = tuple(cfg.betas)
    if cpu_offload:
        if cfg.name != "adamw":
            raise ConfigError(f"optimizer={cfg.name} cannot step under deepspeed.offload_optimizer: "
                              "DeepSpeed offload runs its own CPU Adam; use optimizer=adamw")
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(groups, lr=cfg.lr, betas=betas, eps=cfg.eps, adamw_mode=True)
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


@dataclass
class StateBytes:
    """Memory held by an optimizer's state, counted on the live tensors (shared ones once)."""

    total: int  # bytes of every state tensor
    params: int  # elements of the parameters the optimizer updates
    quantized: int  # bytes of the state of parameters kept in 8 bits (bitsandbytes)
    quantized_params: int  # elements of those parameters

    @property
    def per_param(self) -> float:
        return self.total / self.params if self.params else 0.0

    @property
    def per_quantized_param(self) -> float:
        return self.quantized / self.quantized_params if self.quantized_params else 0.0


def optimizer_state_bytes(optimizer) -> StateBytes:
    """Count the bytes in `optimizer.state` (after a step: state is created lazily).

    Works through accelerate's wrapper. A tensor shared by several parameters (bitsandbytes'
    quantization maps) is counted once, where it is first seen; python numbers (step counts)
    are not tensors and are not counted.
    """
    seen: set[int] = set()
    total = quantized = quantized_params = 0
    params = sum(p.numel() for group in optimizer.param_groups for p in group["params"])
    for param, state in optimizer.state.items():
        own = 0
        for value in state.values():
            if not torch.is_tensor(value):
                continue
            storage = value.untyped_storage()
            if storage.data_ptr() in seen:
                continue
            seen.add(storage.data_ptr())
            own += storage.nbytes()
        total += own
        if any(torch.is_tensor(v) and v.dtype in (torch.uint8, torch.int8) for v in state.values()):
            quantized += own
            quantized_params += param.numel()
    return StateBytes(total, params, quantized, quantized_params)


def build_scheduler(cfg: SchedulerConfig, optimizer: torch.optim.Optimizer, max_steps: int):
    from transformers import get_scheduler

    name = {"cosine": "cosine", "linear": "linear", "constant": "constant_with_warmup"}[cfg.name]
    return get_scheduler(name, optimizer, num_warmup_steps=cfg.warmup_steps, num_training_steps=max_steps)
