"""Optimizers and the learning-rate schedule, from their config groups.

OPTIMIZERS is the one table of optimizers: each entry builds its optimizer and says how many
bytes of state it keeps, which optimizer.* keys it reads and what it works with. validate(),
the config reference and `python -m trainloop.plan` read it; a new optimizer is one YAML file in
conf/optimizer/ and one entry here. torch is imported inside the functions, so that reading the
table (config checks, --help) stays fast.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from functools import cache, partial
from typing import Callable

from trainloop.config.sections import OptimizerConfig, SchedulerConfig
from trainloop.errors import ConfigError

log = logging.getLogger("trainloop")

Shape = tuple[int, ...]


def parameter_groups(model, weight_decay: float) -> list[dict]:
    """Decay matrices and embeddings; never biases or norm weights (the 1-D parameters).

    Shapes are the full ones (a ZeRO-3 parameter is a 1-D placeholder on each rank). An empty
    group is left out: DeepSpeed drops it, and the scheduler must see the same groups.
    """
    from trainloop.model.tensors import full_shape

    params = [p for p in model.parameters() if p.requires_grad]
    matrix = [len(full_shape(p)) >= 2 for p in params]
    groups = [
        {"params": [p for p, m in zip(params, matrix) if m], "weight_decay": weight_decay},
        {"params": [p for p, m in zip(params, matrix) if not m], "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


def projector_groups(groups: list[dict], model, lr: float | None) -> list[dict]:
    """`groups` with a vision-language model's projector (trainloop.model.vision) in groups of its own at `lr`
    (optimizer.projector_lr), after the others; as they are where `lr` is None."""
    from trainloop.model.vision import part

    projector = part(model, "projector") if lr is not None else None
    if projector is None:
        return groups
    own = {id(p) for p in projector.parameters()}
    rest = [{**g, "params": [p for p in g["params"] if id(p) not in own]} for g in groups]
    moved = [{**g, "params": [p for p in g["params"] if id(p) in own], "lr": lr} for g in groups]
    return [g for g in rest + moved if g["params"]]


def hidden_matrices(model) -> list[bool]:
    """For each parameter that trains, in model.parameters() order: is it a hidden layer's matrix,
    a 2-D weight that is neither an embedding nor the output head? Muon takes these; torch
    documents the rest (embeddings, head, norms, biases, 3-D expert weights) for AdamW."""
    import torch

    vocabulary = {id(p) for m in model.modules() if isinstance(m, torch.nn.Embedding) for p in m.parameters()}
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    vocabulary |= {id(p) for p in (head.parameters() if head is not None else ())}
    return [p.dim() == 2 and id(p) not in vocabulary for p in model.parameters() if p.requires_grad]


def _muon_groups(model, weight_decay: float) -> list[dict]:
    """The hidden matrices for Muon (use_muon), then parameter_groups' groups without them for AdamW."""
    params = [p for p in model.parameters() if p.requires_grad]
    hidden = {id(p) for p, h in zip(params, hidden_matrices(model)) if h}
    groups = [{"params": [p for p in params if id(p) in hidden], "weight_decay": weight_decay, "use_muon": True}]
    groups += [{**g, "params": [p for p in g["params"] if id(p) not in hidden], "use_muon": False}
               for g in parameter_groups(model, weight_decay)]
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

    # auto: torch's fused kernel, on CPU as on CUDA (the HF Trainer's default too): no per-parameter temporaries,
    # and it skips a non-finite update on the device (trainloop/guard.py)
    kwargs = {"fused": True} if cfg.impl in ("auto", "fused") else {"foreach": cfg.impl == "foreach"}
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


@cache
def _muon_with_adamw():
    """The class, made on first use: torch is imported inside the functions of this module."""
    import torch

    class MuonWithAdamW(torch.optim.Optimizer):
        """torch's Muon on the hidden matrices and torch's AdamW on the rest, stepped as one optimizer.

        The parts keep the wrapper's own param_groups (the same dicts) and state (the same dict),
        so the scheduler, accelerate, the checkpoints and DCP see one ordinary optimizer;
        load_state_dict replaces both, so the parts are pointed at the new ones again.
        """

        def __init__(self, parts: list):
            self.parts, self.sizes = parts, [len(part.param_groups) for part in parts]
            super().__init__([g for part in parts for g in part.param_groups], defaults={})
            self.defaults = {type(part).__name__: part.defaults for part in parts}  # what each part was built with
            self._share()

        def _share(self) -> None:
            groups = iter(self.param_groups)
            for part, size in zip(self.parts, self.sizes):
                part.param_groups = [next(groups) for _ in range(size)]
                part.state = self.state

        def step(self, closure=None):
            loss = None
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            for part in self.parts:
                part.step()
            return loss

        def load_state_dict(self, state_dict: dict) -> None:
            super().load_state_dict(state_dict)
            self._share()

    return MuonWithAdamW


def _muon(cfg: OptimizerConfig, groups: list[dict], on_cuda: bool):
    """One optimizer.lr serves both parts: match_rms_adamw scales each matrix's orthogonalised
    update to the RMS of an AdamW update (0.2 * sqrt(max(rows, cols)) * lr, Moonshot's rule in
    torch's docs), so the lr and weight decay tuned for AdamW carry over and the scheduler scales
    both parts alike. Nesterov momentum and 5 Newton-Schulz steps are torch's defaults."""
    import torch

    muon = [g for g in groups if g["use_muon"]]
    rest = [g for g in groups if not g["use_muon"]]
    parts = [torch.optim.Muon(muon, lr=cfg.lr, momentum=cfg.momentum, adjust_lr_fn="match_rms_adamw")] if muon else []
    parts += [_adamw(cfg, rest, on_cuda)] if rest else []
    return _muon_with_adamw()(parts)


# --- state sizes: bytes each optimizer keeps for one fp32 parameter tensor of this shape -------

def _adamw_state(shape: Shape, cfg: OptimizerConfig) -> int:
    return 8 * math.prod(shape) + 4  # exp_avg, exp_avg_sq, and a 0-d fp32 `step`


def _muon_state(shape: Shape, cfg: OptimizerConfig) -> int:
    return 4 * math.prod(shape)  # the momentum buffer; no step count


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
    chosen = "fused" if cfg.impl == "auto" else cfg.impl
    if chosen == "fused":
        return 0
    if chosen == "foreach":  # sqrt(exp_avg_sq) for a whole parameter group at once
        return 4 * sum(sizes)
    return 2 * 4 * max(sizes)  # sqrt, then the divided copy, one tensor at a time


def _adafactor_temporaries(sizes: list[int], cfg: OptimizerConfig, on_cuda: bool) -> int:
    return 2 * 4 * max(sizes)  # grad**2 + eps, then the approximated update


def _muon_temporaries(sizes: list[int], cfg: OptimizerConfig, on_cuda: bool) -> int:
    # one matrix at a time: the fp32 Nesterov blend, two bf16 copies and two bf16 Gram matrices
    # (min(rows, cols)^2 <= rows * cols elements each)
    return (4 + 2 * 2 + 2 * 2) * max(sizes)


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
    groups: Callable = parameter_groups  # (model, weight_decay) -> the parameter groups it builds on
    rest: str = ""  # the row whose optimizer steps what this one does not take: the non-hidden_matrices
    cpu_offload: bool = False  # may run as DeepSpeed's CPU Adam under deepspeed.offload_optimizer
    zero: bool = True  # steps ZeRO-1/2's partitions: 1-D slices of the flattened parameters
    not_zero_because: str = ""
    zero3: bool = True  # works on ZeRO-3's partitioned parameters
    cuda_only: bool = False
    not_zero3_because: str = ""
    fsdp2: bool = True  # steps on FSDP2's DTensor shards (torch's optimizers do, through DTensor ops)
    not_fsdp2_because: str = ""
    library: str = ""  # the package that implements it, where that is not torch or transformers
    # the row whose update this one makes with less state, reading the same keys: `plan --suggest`
    # offers it where that row's optimizer is configured (the same method, its state quantized)
    stands_in_for: str = ""
    scratch_lr: float = 1e-3  # optimizer.lr where the config sets none, for a model trained from scratch


ADAM_KEYS = ("lr", "weight_decay", "betas", "eps")
OFFLOAD_READS = ADAM_KEYS  # what DeepSpeed's CPU Adam reads when it steps in (build_optimizer)
EIGHT_BIT = dict(state_bytes=_adam8bit_state, shared_state_bytes=2 * 256 * 4, reads=ADAM_KEYS, zero3=False,
                 not_zero3_because="ZeRO-3 partitions the parameters the 8-bit optimizer must see whole",
                 fsdp2=False, not_fsdp2_because="bitsandbytes' 8-bit kernels take plain tensors, not FSDP2's "
                 "DTensor shards (seen: 'got mixed torch.Tensor and DTensor')",
                 library="bitsandbytes", stands_in_for="adamw")

OPTIMIZERS: dict[str, Optimizer] = {
    "adamw": Optimizer(_adamw, _adamw_state, _adamw_temporaries, reads=(*ADAM_KEYS, "impl"), cpu_offload=True),
    "adafactor": Optimizer(_adafactor, _adafactor_state, _adafactor_temporaries, fsdp2=False,
                           not_fsdp2_because="its factored second moment (row and column means) is kept as "
                           "plain tensors and mixed with the DTensor gradient shards (seen: 'got mixed "
                           "torch.Tensor and DTensor')"),
    "adamw8bit": Optimizer(_adamw8bit, **EIGHT_BIT),
    "paged_adamw8bit": Optimizer(_paged_adamw8bit, **EIGHT_BIT),
    "sgd": Optimizer(_sgd, _sgd_state, reads=("lr", "weight_decay", "momentum"), scratch_lr=1e-1),
    # torch.optim.Muon on hidden_matrices, AdamW (optimizer.betas, eps, impl) on the rest. Under FSDP2
    # Newton-Schulz runs on the DTensor shards through DTensor ops (seen: 2 processes equal 1 to 1e-5)
    "muon": Optimizer(_muon, _muon_state, _muon_temporaries, reads=(*ADAM_KEYS, "impl", "momentum"),
                      groups=_muon_groups, rest="adamw", zero=False, zero3=False,
                      not_zero_because="ZeRO hands the optimizer 1-D slices of the flattened parameters, and "
                      "Muon orthogonalises each matrix whole (seen: 'Param gradient must be a 2D matrix')",
                      not_zero3_because="ZeRO-3 partitions the matrices Muon must orthogonalise whole"),
}


# torch.optim's own classes: what compile.optimizer compiles (compile_optimizer)
TORCH_OPTIMIZERS = ("adamw", "sgd")


def optimizer_named(name: str) -> Optimizer:
    if name not in OPTIMIZERS:
        raise ConfigError(f"optimizer.name={name!r} is not one of: {', '.join(OPTIMIZERS)}")
    return OPTIMIZERS[name]


def _parts(cfg: OptimizerConfig, shapes: list[Shape], hidden_matrix: list[bool] | None) -> list[tuple[Optimizer, list]]:
    """(row, shapes) of each optimizer that steps these tensors: the row's alone, or, for a row with
    a `rest`, its own on the hidden matrices (hidden_matrices; None: every 2-D shape) and the rest's."""
    spec = optimizer_named(cfg.name)
    if not spec.rest:
        return [(spec, shapes)]
    hidden_matrix = [len(s) == 2 for s in shapes] if hidden_matrix is None else hidden_matrix
    return [(spec, [s for s, h in zip(shapes, hidden_matrix) if h]),
            (OPTIMIZERS[spec.rest], [s for s, h in zip(shapes, hidden_matrix) if not h])]


def planned_state_bytes(cfg: OptimizerConfig, shapes: list[Shape], hidden_matrix: list[bool] | None = None) -> int:
    """Bytes of optimizer state for fp32 parameters of these shapes, as the optimizer stores it.
    `hidden_matrix`: for each shape, whether hidden_matrices counts it (it matters to a row with a rest)."""
    total = 0
    for spec, own in _parts(cfg, shapes, hidden_matrix):
        eight_bit = spec.shared_state_bytes and any(math.prod(s) >= 4096 for s in own)
        total += sum(spec.state_bytes(shape, cfg) for shape in own) + (spec.shared_state_bytes if eight_bit else 0)
    return total


def planned_step_temporaries(cfg: OptimizerConfig, on_cuda: bool, shapes: list[Shape],
                             hidden_matrix: list[bool] | None = None) -> int:
    return max((spec.temporaries([math.prod(s) for s in own], cfg, on_cuda)
                for spec, own in _parts(cfg, shapes, hidden_matrix) if own), default=0)


def build_optimizer(cfg: OptimizerConfig, model, on_cuda: bool, cpu_offload: bool = False):
    """The optimizer over the weight-decay groups. `cpu_offload`: DeepSpeed keeps the optimizer
    state in CPU memory and steps it there, which needs its own vectorised CPU Adam."""
    spec = optimizer_named(cfg.name)
    if cfg.lr is None:  # built outside a run (which settles it first: settle_learning_rate), on a model from scratch
        from omegaconf import OmegaConf

        cfg = OmegaConf.merge(cfg, {"lr": spec.scratch_lr})
    groups = projector_groups(spec.groups(model, cfg.weight_decay), model, cfg.projector_lr)
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


def compile_optimizer(cfg, optimizer) -> None:
    """compile.optimizer: the optimizer's step compiled, in place (its `step` replaced on the instance: its
    state, state_dict and schedule are the optimizer's own). null compiles it where it pays: torch's AdamW or
    SGD not already one fused kernel (optimizer.impl=for_loop or foreach, and SGD: their loops run a dozen small
    ops a parameter, which inductor generates as one loop; on the 2-core CPU, a 1-layer 32-wide model's compiled step went from x0.81
    to x0.96 of a raw loop's that compiles the model only), on whole parameters: FSDP2's and tensor
    parallelism's DTensor shards keep the eager step. The debugging backends (aot_eager, eager) trace it as
    inductor would. The learning rate the schedule sets each step is a float Dynamo does not specialise on
    (torch._dynamo.config.specialize_float): one graph for the whole run. compile.fullgraph is the model's:
    torch's step breaks its graph on purpose. `optimizer`: the run's, prepared (accelerate's wrapper steps
    the torch optimizer inside it)."""
    import torch

    from trainloop.model.compile import compile_options
    from trainloop.model.tensors import is_dtensor

    setting, c = cfg.compile.optimizer, cfg.compile
    if c.backend == "none" or setting is False:
        return
    inner = getattr(optimizer, "optimizer", optimizer)
    whole = not any(is_dtensor(p) for group in inner.param_groups for p in group["params"])
    if setting is None and not (cfg.optimizer.name in TORCH_OPTIMIZERS and not inner.defaults.get("fused") and whole):
        return
    if not whole:
        raise ConfigError("compile.optimizer=true compiles the step of whole parameters; this layout shards them "
                          "(FSDP2 or tensor parallelism: DTensor shards): set compile.optimizer=false")
    inner.step = torch.compile(inner.step, **{**compile_options(c), "fullgraph": False})
    log.info("torch.compile: the optimizer's step too (%s), backend %s", type(inner).__name__, c.backend)


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


def keep_configured_lr(scheduler, configured: list[float]) -> list[float] | None:
    """optimizer.lr may change on resume (trainloop.checkpoint.compatibility.MAY_CHANGE_ON_RESUME), but a loaded
    scheduler and optimizer hold the checkpoint's: put the configured base learning rates back, and
    the current step's lr computed from them as the schedule computes it. Returns the checkpoint's
    base learning rates where they differed (None: the same)."""
    saved = list(scheduler.base_lrs)
    if saved == configured:
        return None
    scheduler.base_lrs = list(configured)
    for group, base, factor in zip(scheduler.optimizer.param_groups, configured, scheduler.lr_lambdas):
        group["initial_lr"] = base
        group["lr"] = base * factor(scheduler.last_epoch)
    scheduler._last_lr = [group["lr"] for group in scheduler.optimizer.param_groups]
    return saved
