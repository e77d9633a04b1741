"""Optimizers and the learning-rate schedule, from their config groups.

OPTIMIZERS is the one table of optimizers: each entry builds its optimizer and says how many
bytes of state it keeps, which optimizer.* keys it reads and what it works with. validate(),
the config reference and `python -m trainloop.plan` read it; a new optimizer is one YAML file in
conf/optimizer/ and one entry here. torch is imported inside the functions, so that reading the
table (config checks, --help) stays fast.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import Callable

from trainloop.errors import ConfigError
from trainloop.schema import OptimizerConfig, SchedulerConfig

Shape = tuple[int, ...]


def parameter_groups(model, weight_decay: float) -> list[dict]:
    """Decay matrices and embeddings; never biases or norm weights (the 1-D parameters).

    Shapes are the full ones (a ZeRO-3 parameter is a 1-D placeholder on each rank). An empty
    group is left out: DeepSpeed drops it, and the scheduler must see the same groups.
    """
    from trainloop.parallel import full_shape

    params = [p for p in model.parameters() if p.requires_grad]
    matrix = [len(full_shape(p)) >= 2 for p in params]
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


# --- builders: (optimizer config, parameter groups, on CUDA?) -> optimizer --------------------

def _adamw(cfg: OptimizerConfig, groups: list[dict], on_cuda: bool):
    import torch

    impl = "fused" if cfg.impl == "auto" and on_cuda else cfg.impl
    kwargs = {"fused": True} if impl == "fused" else {"foreach": impl == "foreach"} if impl != "auto" else {}
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, **kwargs)


def _sgd(cfg: OptimizerConfig, groups: list[dict], on_cuda: bool):
    import torch

    return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum)


def _adafactor(cfg: OptimizerConfig, groups: list[dict], on_cuda: bool):
    from transformers.optimization import Adafactor

    return Adafactor(groups, lr=cfg.lr, scale_parameter=False, relative_step=False, warmup_init=False)


def _adamw8bit(cfg: OptimizerConfig, groups: list[dict], on_cuda: bool):
    return _bitsandbytes().optim.AdamW8bit(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps)


def _paged_adamw8bit(cfg: OptimizerConfig, groups: list[dict], on_cuda: bool):
    return _bitsandbytes().optim.PagedAdamW8bit(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps)


# --- state sizes: bytes each optimizer keeps for one fp32 parameter tensor of this shape -------

def _adamw_state(shape: Shape, cfg: OptimizerConfig) -> int:
    return 8 * math.prod(shape) + 4  # exp_avg, exp_avg_sq, and a 0-d fp32 `step`


def _sgd_state(shape: Shape, cfg: OptimizerConfig) -> int:
    return 4 * math.prod(shape) if cfg.momentum else 0  # the momentum buffer


def _adafactor_state(shape: Shape, cfg: OptimizerConfig) -> int:
    # second moments only (beta1=None), factored into row and column sums for matrices; a 0-d RMS
    if len(shape) < 2:
        return 4 * math.prod(shape) + 4
    return 4 * (math.prod(shape[:-1]) + math.prod(shape[:-2] + shape[-1:])) + 4


def _adam8bit_state(shape: Shape, cfg: OptimizerConfig) -> int:
    n = math.prod(shape)
    if n < 4096:  # bitsandbytes' min_8bit_size: small tensors keep 32-bit states
        return 8 * n
    return 2 * n + 2 * 4 * math.ceil(n / 256)  # two uint8 states plus an fp32 absmax per block of 256


# --- step temporaries: bytes the step allocates and frees again -------------------------------

def _adamw_temporaries(sizes: list[int], cfg: OptimizerConfig, on_cuda: bool) -> int:
    chosen = ("fused" if on_cuda else "for_loop") if cfg.impl == "auto" else cfg.impl
    if chosen == "fused":
        return 0
    if chosen == "foreach":  # sqrt(exp_avg_sq) for a whole parameter group at once
        return 4 * sum(sizes)
    return 2 * 4 * max(sizes)  # sqrt, then the divided copy, one tensor at a time


def _adafactor_temporaries(sizes: list[int], cfg: OptimizerConfig, on_cuda: bool) -> int:
    return 2 * 4 * max(sizes)  # grad**2 + eps, then the approximated update


def _none(sizes: list[int], cfg: OptimizerConfig, on_cuda: bool) -> int:
    return 0


@dataclass(frozen=True)
class Optimizer:
    """One row of the table: how to build an optimizer, what it costs, what it works with."""

    build: Callable  # (OptimizerConfig, parameter groups, on_cuda) -> torch.optim.Optimizer
    state_bytes: Callable[[Shape, OptimizerConfig], int]  # state kept for one fp32 tensor
    temporaries: Callable = _none  # (tensor sizes, OptimizerConfig, on_cuda) -> bytes of the step
    shared_state_bytes: int = 0  # state shared by every tensor (bitsandbytes' quantization maps)
    reads: tuple[str, ...] = ("lr", "weight_decay")  # the optimizer.* keys it reads
    cpu_offload: bool = False  # may run as DeepSpeed's CPU Adam under deepspeed.offload_optimizer
    zero3: bool = True  # works on ZeRO-3's partitioned parameters
    cuda_only: bool = False
    not_zero3_because: str = ""
    fsdp2: bool = True  # steps on FSDP2's DTensor shards (torch's optimizers do, through DTensor ops)
    not_fsdp2_because: str = ""
    library: str = ""  # the package that implements it, where that is not torch or transformers


ADAM_KEYS = ("lr", "weight_decay", "betas", "eps")
OFFLOAD_READS = ADAM_KEYS  # what DeepSpeed's CPU Adam reads when it steps in (build_optimizer)
EIGHT_BIT = dict(state_bytes=_adam8bit_state, shared_state_bytes=2 * 256 * 4, reads=ADAM_KEYS, zero3=False,
                 not_zero3_because="ZeRO-3 partitions the parameters the 8-bit optimizer must see whole",
                 fsdp2=False, not_fsdp2_because="bitsandbytes' 8-bit kernels take plain tensors, not FSDP2's "
                 "DTensor shards (seen: 'got mixed torch.Tensor and DTensor')",
                 library="bitsandbytes")

OPTIMIZERS: dict[str, Optimizer] = {
    "adamw": Optimizer(_adamw, _adamw_state, _adamw_temporaries, reads=(*ADAM_KEYS, "impl"), cpu_offload=True),
    "adafactor": Optimizer(_adafactor, _adafactor_state, _adafactor_temporaries, fsdp2=False,
                           not_fsdp2_because="its factored second moment (row and column means) is kept as "
                           "plain tensors and mixed with the DTensor gradient shards (seen: 'got mixed "
                           "torch.Tensor and DTensor')"),
    "adamw8bit": Optimizer(_adamw8bit, **EIGHT_BIT),
    "paged_adamw8bit": Optimizer(_paged_adamw8bit, **EIGHT_BIT),
    "sgd": Optimizer(_sgd, _sgd_state, reads=("lr", "weight_decay", "momentum")),
}


def optimizer_named(name: str) -> Optimizer:
    if name not in OPTIMIZERS:
        raise ConfigError(f"optimizer.name={name!r} is not one of: {', '.join(OPTIMIZERS)}")
    return OPTIMIZERS[name]


def planned_state_bytes(cfg: OptimizerConfig, shapes: list[Shape]) -> int:
    """Bytes of optimizer state for fp32 parameters of these shapes, as the optimizer stores it."""
    spec = optimizer_named(cfg.name)
    per_tensor = [spec.state_bytes(shape, cfg) for shape in shapes]
    eight_bit = spec.shared_state_bytes and any(math.prod(s) >= 4096 for s in shapes)
    return sum(per_tensor) + (spec.shared_state_bytes if eight_bit else 0)


def planned_step_temporaries(cfg: OptimizerConfig, on_cuda: bool, shapes: list[Shape]) -> int:
    return optimizer_named(cfg.name).temporaries([math.prod(s) for s in shapes], cfg, on_cuda)


def build_optimizer(cfg: OptimizerConfig, model, on_cuda: bool, cpu_offload: bool = False):
    """The optimizer over the weight-decay groups. `cpu_offload`: DeepSpeed keeps the optimizer
    state in CPU memory and steps it there, which needs its own vectorised CPU Adam."""
    spec = optimizer_named(cfg.name)
    groups = parameter_groups(model, cfg.weight_decay)
    if spec.cuda_only and not on_cuda:
        raise ConfigError(f"optimizer={cfg.name} needs a CUDA GPU; choose another optimizer on this machine")
    if cpu_offload:
        if not spec.cpu_offload:
            raise ConfigError(f"optimizer={cfg.name} cannot step under deepspeed.offload_optimizer: "
                              "DeepSpeed offload runs its own CPU Adam; use optimizer=adamw")
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, adamw_mode=True)
    return spec.build(cfg, groups, on_cuda)


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
    import torch

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


def lr_factor(name: str, step: int, warmup: int, total: int) -> float:
    """The share of optimizer.lr at `step`: linear warm-up, then cosine to 0, linear to 0 or
    constant (the formulas of transformers' get_scheduler, whose import costs every run ~2 s:
    it loads peft and bitsandbytes)."""
    if step < warmup:
        return step / max(1, warmup)
    if name == "constant":
        return 1.0
    progress = (step - warmup) / max(1, total - warmup)
    if name == "cosine":
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * 0.5 * 2.0 * progress)))
    return max(0.0, (total - step) / max(1, total - warmup))


def build_scheduler(cfg: SchedulerConfig, optimizer, max_steps: int):
    from torch.optim.lr_scheduler import LambdaLR

    return LambdaLR(optimizer, partial(lr_factor, cfg.name, warmup=cfg.warmup_steps, total=max_steps))
