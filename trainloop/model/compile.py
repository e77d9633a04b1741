"""torch.compile from the `compile` group: the whole model, or each transformer block.

`nn.Module.compile()` compiles a module's forward in place instead of wrapping it in an
OptimizedModule, so parameter names, checkpoints and the exported model never carry the
`_orig_mod.` prefix a `torch.compile(model)` wrapper would add.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch

from trainloop.config.sections import CompileConfig
from trainloop.errors import ConfigError

log = logging.getLogger("trainloop")


def transformer_blocks(model: torch.nn.Module, setting: str = "compile.regional=true",
                       instead: str = "compile.regional=false") -> list[torch.nn.Module]:
    """The repeated blocks of a transformers model (the classes it names in _no_split_modules);
    `setting` needs them, `instead` is what to choose when the model declares none."""
    block_classes = set(getattr(model, "_no_split_modules", None) or ())
    blocks = [m for m in model.modules() if type(m).__name__ in block_classes]
    if not blocks:
        raise ConfigError(f"{setting}: no transformer blocks found in {type(model).__name__} "
                          f"(it declares no _no_split_modules); set {instead}")
    return blocks


def compile_options(cfg: CompileConfig) -> dict:
    """The keyword arguments of torch.compile for this config."""
    kwargs = {"backend": cfg.backend, "fullgraph": cfg.fullgraph, "dynamic": cfg.dynamic}
    if cfg.mode != "default":  # only inductor takes a mode (validate() checks)
        kwargs["mode"] = cfg.mode
    return kwargs


def compile_model(cfg: CompileConfig, model: torch.nn.Module) -> torch.nn.Module:
    """Compile `model` in place as `cfg` says (a no-op for backend none); returns it."""
    if cfg.backend == "none":
        return model
    kwargs = compile_options(cfg)
    if cfg.regional:
        # Identical blocks share one compiled graph: compile time is that of a single block.
        blocks = transformer_blocks(model)
        for block in blocks:
            block.compile(**kwargs)
        log.info("torch.compile: %d %s blocks, backend %s, mode %s", len(blocks),
                 type(blocks[0]).__name__, cfg.backend, cfg.mode)
    else:
        model.compile(**kwargs)
        log.info("torch.compile: whole model, backend %s, mode %s (compiles on the first steps)",
                 cfg.backend, cfg.mode)
    return model


def _loss_compiles(cfg: CompileConfig) -> bool:
    """The loss compiles where the whole model does (compile.regional compiles the blocks alone)."""
    return cfg.backend != "none" and not cfg.regional


def compile_loss(cfg: CompileConfig, loss: Callable) -> Callable:
    """`loss` (logits in, a loss out) compiled as the whole model is, else itself: its fp32 upcast,
    log-softmax and gather fuse, and no log-softmax of the logits' size is kept for the backward
    (on the 2-core CPU, 4 x 256 tokens at a vocabulary of 50,304: 0.77x the eager loss's time and
    245 MB less peak memory, forward and backward). With the loss left eager, GPT-2 124M compiled
    whole ran at 0.73x a raw loop's tokens/s and 1.6x its peak memory on one H200 (BENCHMARKS.md).
    compile.regional compiles the blocks alone, and leaves the loss eager too."""
    return torch.compile(loss, **compile_options(cfg)) if _loss_compiles(cfg) else loss


def compile_forward_loss(cfg: CompileConfig, loss: Callable) -> Callable | None:
    """forward_loss(model, inputs, targets): `loss` of the logits of `model(**inputs)`, the forward and the loss
    compiled as one graph, as a raw loop's torch.compile(model) takes the loss transformers computes inside the
    forward; None where compile_loss leaves the loss eager. One graph, not the model's and the loss's: one
    guard check, one autograd node and its backward, and the logits are never an output (on the 2-core CPU,
    a 1-layer 32-wide model: about 0.09 ms of a 2.1 ms compiled step). The model keeps its own compiled
    forward for the calls that want its output (generation, a router's logits)."""
    if not _loss_compiles(cfg):
        return None

    def forward_loss(model, inputs: dict, targets):
        return loss(model(**inputs).logits, targets)

    return torch.compile(forward_loss, **compile_options(cfg))
