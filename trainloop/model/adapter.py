"""Adapters (LoRA, with peft) and the quantized base weights QLoRA trains them on.

With adapter=lora the base model is frozen and wrapped in a peft model whose only trainable
parameters are the adapters (and adapter.modules_to_save). Checkpoints hold those and their
optimizer state (trainloop/checkpoint/checkpointer.py); the export writes the merged model and the adapter
alone (trainloop/export.py).
"""

from __future__ import annotations

from trainloop.config.sections import AdapterConfig, ModelConfig
from trainloop.errors import ConfigError

ALL_LINEAR = "all-linear"  # peft's name for every linear layer but the output head

# bitsandbytes computes a 4-bit layer's matmul in this dtype; the precision decides it.
COMPUTE_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
# peft's task for each model head (trainloop.model.heads.HEADS): a score head trains whole beside the adapters
TASK_TYPES = {"lm": "CAUSAL_LM", "score": "SEQ_CLS"}


def enabled(cfg) -> bool:
    return cfg.adapter.name != "none"


def lora_config(cfg: AdapterConfig, head: str = "lm", model=None):
    """peft's LoraConfig; adapter.target_modules=null adapts every linear layer but the output head, and in a
    vision-language model (`model`'s config, trainloop.model.vision.is_vision) its language model's alone."""
    from peft import LoraConfig

    targets = list(cfg.target_modules) if cfg.target_modules is not None else ALL_LINEAR
    if cfg.target_modules is None and model is not None:
        from trainloop.model.vision import is_vision, language_linears

        if is_vision(model.config):
            targets = language_linears(model)
    return LoraConfig(r=cfg.r, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=targets,
                      modules_to_save=list(cfg.modules_to_save) if cfg.modules_to_save else None,
                      task_type=TASK_TYPES[head])


def quantization_config(model: ModelConfig, precision: str):
    """bitsandbytes' config for model.quantization; None when the weights stay as they are."""
    import torch
    from transformers import BitsAndBytesConfig

    if model.quantization == "4bit":
        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                  bnb_4bit_compute_dtype=getattr(torch, COMPUTE_DTYPES[precision]))
    if model.quantization == "8bit":
        return BitsAndBytesConfig(load_in_8bit=True)
    return None


def linear_names(model) -> list[str]:
    """The last part of the name of every linear layer, once each, in model order."""
    import torch

    names = [name.rpartition(".")[2] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    return list(dict.fromkeys(names))


def _matches(module_names: list[str], target: str) -> bool:
    # peft's rule: a target matches a module whose full name is it, or ends with "." + it
    return any(name == target or name.endswith("." + target) for name in module_names)


def check_targets(cfg: AdapterConfig, model_config, head: str = "lm") -> None:
    """Refuse target_modules or modules_to_save that name no module, listing the ones that exist.

    The model is built on the meta device (no weights): cheap enough to run before anything else.
    """
    import torch

    from trainloop.model.heads import auto_class
    from trainloop.model.vision import is_vision

    if cfg.name == "none":
        return
    with torch.device("meta"):
        model = auto_class(head, is_vision(model_config)).from_config(model_config)
    names = [name for name, _ in model.named_modules() if name]
    for key, wanted in (("target_modules", cfg.target_modules), ("modules_to_save", cfg.modules_to_save)):
        unmatched = [t for t in (wanted or []) if not _matches(names, t)]
        if unmatched:
            raise ConfigError(
                f"adapter.{key}={list(wanted)}: {unmatched} match(es) no module of this "
                f"{type(model).__name__}; its linear layers are {linear_names(model)} (null adapts "
                f"every linear layer but the output head)")


def apply_adapter(cfg, model, head: str = "lm"):
    """Freeze `model` and wrap it in a peft model with the configured LoRA adapters (`head`: what
    the model ends in, trainloop.model.heads.HEADS)."""
    from peft import prepare_model_for_kbit_training

    if cfg.model.quantization != "none":
        # casts the unquantized parameters (norms, embeddings) to fp32 for stable training, and
        # keeps gradient checkpointing non-reentrant, as build_model set it
        model = prepare_model_for_kbit_training(
            model, use_gradient_checkpointing=cfg.model.gradient_checkpointing,
            gradient_checkpointing_kwargs={"use_reentrant": False})
    return wrap_lora(model, cfg.adapter, head)


def wrap_lora(model, cfg: AdapterConfig, head: str = "lm"):
    import warnings

    from peft import get_peft_model

    with warnings.catch_warnings():  # peft asks transformers 5 by the old name: not the user's concern
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        return get_peft_model(model, lora_config(cfg, head, model))


def problems(cfg) -> list[str]:
    """Adapters and quantized weights: the combinations that cannot work, each with its reason."""
    a, q = cfg.adapter, cfg.model.quantization
    problems = []
    if a.name == "lora" and not 0.0 <= a.dropout < 1.0:
        problems.append(f"adapter.dropout={a.dropout} must be in [0, 1)")
    if a.name == "lora" and a.target_modules is not None and not a.target_modules:
        problems.append("adapter.target_modules=[] adapts nothing: name modules, or null for every linear layer")
    if q == "none":
        return problems
    if cfg.model.name != "hf":
        problems.append(f"model.quantization={q} quantizes pretrained weights: use model=hf with "
                        f"model.name_or_path=DIR (model={cfg.model.name} starts from random weights)")
    if a.name != "lora":
        problems.append(f"model.quantization={q} freezes the base weights, so only an adapter can train: "
                        "add adapter=lora (or +preset=qlora)")
    if q == "8bit" and cfg.precision.name == "fp16":
        problems.append("model.quantization=8bit with precision=fp16: use precision=bf16 or fp32")
    return problems
