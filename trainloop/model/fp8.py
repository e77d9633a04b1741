"""precision=fp8: torchao's float8 training for the linear layers of the transformer blocks.

The blocks' nn.Linear layers become torchao's Float8Linear (`convert_to_float8_training`, dynamic
tensorwise scaling: inputs and weights cast to float8_e4m3fn, output gradients to float8_e5m2,
each with its own per-tensor scale) before compile and sharding, as torchtitan converts them at
model build. Left in bf16, as torchtitan's filter leaves them: the output layer (lm_head) and the
embeddings (outside the blocks), a layer whose dims do not divide by 16 (what float8 tensor cores
take), and with precision.fp8_skip_small=true the layers torchao's own thresholds call too small
to gain (`torchao.float8._auto_filter_for_recipe`, measured on H100). Everything else computes in
bf16 autocast, and the master weights stay fp32, so checkpoints and the export hold plain tensors
under the nn.Linear names: Float8Linear is a subclass of nn.Linear with the same parameters.
Mixtral's experts (stacked weights, not nn.Linear) and its router stay in bf16 too.

Where no float8 matmul runs (a CPU; a GPU below compute capability 8.9 with
precision.fp8_emulate=true), torchao's own emulation (`Float8LinearConfig(emulate=True)`) does the
same casts and scales and multiplies the dequantized float8 values in fp32: the numerics of fp8
training, at no speed gain. accelerate's `mixed_precision="fp8"` is not used: it swaps the layers
in `prepare()`, after trainloop has compiled and sharded the model, and on a GPU below 8.9 it
falls back to fp16 with a warning instead of refusing.

This module's problems() imports no torch: config checks stay fast.
"""

from __future__ import annotations

import importlib.util
import logging

log = logging.getLogger("trainloop")

MIN_CAPABILITY = (8, 9)  # Ada and Hopper: the first GPUs with float8 tensor cores (torch._scaled_mm)


def enabled(cfg) -> bool:
    return cfg.precision.name == "fp8"


def problems(cfg) -> list[str]:
    """The combinations precision=fp8 cannot run, each in one line naming the key."""
    if not enabled(cfg):
        return []
    problems = []
    if importlib.util.find_spec("torchao") is None:
        problems.append("precision=fp8 needs torchao (its float8 training): pip install 'trainloop[fp8]' "
                        "(or pip install torchao), or choose precision=bf16")
    if cfg.adapter.name != "none":
        problems.append(f"precision=fp8 with adapter={cfg.adapter.name}: peft wraps the linear layers that "
                        "torchao swaps, and a frozen base gains little from float8; use adapter=none or precision=bf16")
    if cfg.model.name == "tiny" and cfg.model.arch == "gpt2":
        problems.append("precision=fp8 with model.arch=gpt2: GPT-2's blocks use Conv1D, not nn.Linear, so "
                        "nothing would compute in float8; use model.arch=llama")
    return problems


def _import_torchao():
    import torchao.float8

    return torchao.float8


def emulated(cfg, device) -> bool:
    """Whether the float8 matmuls are emulated: always on a CPU, on a GPU when asked."""
    return device.type != "cuda" or cfg.precision.fp8_emulate


def layer_filter(model, skip_small: bool):
    """The filter handed to convert_to_float8_training: which nn.Linear of `model` computes in
    float8. Only layers inside the transformer blocks (so never lm_head), with both dims divisible
    by 16, and with `skip_small` only those torchao's tensorwise thresholds call big enough."""
    import torch

    from trainloop.model.compile import transformer_blocks

    float8 = _import_torchao()
    blocks = {id(block) for block in transformer_blocks(model, "precision=fp8", "precision=bf16")}
    inside = [name for name, m in model.named_modules() if id(m) in blocks]
    big_enough = float8._auto_filter_for_recipe("tensorwise", filter_fqns=[]) if skip_small else None

    def converts(module, fqn: str) -> bool:
        if not isinstance(module, torch.nn.Linear) or not any(fqn.startswith(b + ".") for b in inside):
            return False
        out_features, in_features = module.weight.shape
        if out_features % 16 or in_features % 16:
            return False
        return big_enough is None or big_enough(module, fqn)

    return converts


def convert(cfg, model, device) -> list[str]:
    """Swap the chosen linear layers of `model` for Float8Linear, in place, before compile and
    sharding; returns their names. Refuses a model where nothing would compute in float8."""
    import torch

    from trainloop.errors import ConfigError

    float8 = _import_torchao()
    emulate = emulated(cfg, device)
    converts = layer_filter(model, cfg.precision.fp8_skip_small)
    linear = [name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    chosen = [name for name, m in model.named_modules() if converts(m, name)]
    if not chosen:
        why = ("torchao's size thresholds (precision.fp8_skip_small=true) leave every layer in bf16: set "
               "precision.fp8_skip_small=false, or use precision=bf16 for a model this small"
               if cfg.precision.fp8_skip_small else
               "no linear layer of its blocks has both dims divisible by 16: use precision=bf16")
        raise ConfigError(f"precision=fp8: nothing would compute in float8 in {type(model).__name__}; {why}")
    config = float8.Float8LinearConfig(emulate=emulate)
    float8.convert_to_float8_training(model, module_filter_fn=converts, config=config)
    kept = [name for name in linear if name not in chosen]
    log.info("precision=fp8: %d of %d linear layers compute in float8 (torchao, tensorwise scaling, %s); "
             "left in bf16: %s", len(chosen), len(linear),
             "emulated: float8 rounding, fp32 matmuls" if emulate else "float8 tensor cores",
             ", ".join(kept[:4]) + (f" and {len(kept) - 4} more" if len(kept) > 4 else "") or "none")
    return chosen


def check_device(cfg, on_cuda: bool) -> None:
    """Refuse fp8 where its matmuls cannot run: a GPU below compute capability 8.9 without emulation."""
    import torch

    from trainloop.errors import ConfigError

    if not enabled(cfg):
        return
    if not on_cuda:
        if cfg.precision.fp8_emulate:
            log.warning("precision.fp8_emulate=true has no effect without a CUDA GPU: a CPU always emulates")
        return
    capability = torch.cuda.get_device_capability()
    if capability < MIN_CAPABILITY and not cfg.precision.fp8_emulate:
        raise ConfigError(
            f"precision=fp8: {torch.cuda.get_device_name()} (compute capability {capability[0]}.{capability[1]}) "
            "has no float8 matmuls (8.9 or newer: L4, L40, H100, B200); use precision=bf16, or "
            "precision.fp8_emulate=true to emulate them (the numerics only, slower than bf16)")
