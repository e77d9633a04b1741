"""The model: a tiny one built from its shape, or a pretrained one from a path; a causal LM, or
(objective=reward) the same network with a scalar score head in place of the output layer."""

from __future__ import annotations

import ast
import logging
import re

from trainloop.config.sections import ModelConfig
from trainloop.errors import ConfigError
from trainloop.model.heads import as_scorer, auto_class
from trainloop.model.vision import is_vision

SPECIAL_TOKENS = ("bos_token_id", "eos_token_id", "pad_token_id")


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def special_token_ids(tokenizer) -> dict[str, int | None]:
    """The tokenizer's bos/eos/pad ids, as the model config and generation config name them."""
    return {key: getattr(tokenizer, key) for key in SPECIAL_TOKENS}


def build_model_config(cfg: ModelConfig, vocab_size: int, token_ids: dict[str, int | None] | None = None):
    """The transformers config, without weights: cheap, so checks can run before any compute.

    `token_ids` (special_token_ids(tokenizer)) replace the architecture's defaults (Llama's eos 2,
    GPT-2's 50256), which name other tokens, or none, in the tokenizer the model is trained with.
    """
    config = _shape_config(cfg, vocab_size)
    carry_token_ids(config, token_ids or {})
    vocab = config.get_text_config().vocab_size  # a vision-language model's is its language model's
    outside = {k: v for k, v in (token_ids or {}).items() if v is not None and not 0 <= v < vocab}
    if outside:
        raise ConfigError(f"the tokenizer's special token ids {outside} are outside the model's vocabulary of "
                          f"{vocab} tokens: use a tokenizer made for this model (data.tokenizer)")
    return config


def carry_token_ids(config, token_ids: dict[str, int | None]) -> None:
    """Set the ids on a model or generation config; a list of stop ids that holds the tokenizer's
    eos (a pretrained chat model's) is kept whole."""
    for key, value in token_ids.items():
        current = getattr(config, key, None)
        if not (isinstance(current, list) and value in current):
            setattr(config, key, value)


def _shape_config(cfg: ModelConfig, vocab_size: int):
    from transformers import AutoConfig, GPT2Config, LlamaConfig, MixtralConfig

    if cfg.name == "hf":
        try:
            config = AutoConfig.from_pretrained(cfg.name_or_path)
        except (OSError, ValueError) as err:
            raise ConfigError(
                f"model.name_or_path={cfg.name_or_path!r}: no model config could be loaded ({err}). "
                "Give a local model directory; hub ids need HF_HUB_OFFLINE=0 and network access"
            ) from None
        text = config.get_text_config()
        if vocab_size > text.vocab_size:
            text.vocab_size = round_up(vocab_size, cfg.vocab_multiple)
        return config
    vocab = round_up(vocab_size, cfg.vocab_multiple)
    if cfg.arch == "llava":
        from trainloop.model.vision import tiny_config

        return tiny_config(cfg, vocab)
    intermediate = cfg.intermediate_size or 4 * cfg.hidden_size
    if cfg.arch == "gpt2":
        return GPT2Config(
            vocab_size=vocab, n_positions=cfg.max_position_embeddings, n_embd=cfg.hidden_size,
            n_layer=cfg.num_layers, n_head=cfg.num_heads, n_inner=intermediate,
            resid_pdrop=cfg.dropout, embd_pdrop=cfg.dropout, attn_pdrop=cfg.dropout,
            use_cache=False, tie_word_embeddings=cfg.tie_embeddings,
        )
    kv_heads = cfg.num_kv_heads or cfg.num_heads
    if cfg.arch == "mixtral":
        # A Llama whose MLP is num_experts expert MLPs (each intermediate wide) behind a top-k router;
        # the router's logits come out of every forward, for its load-balancing loss (trainloop.step).
        return MixtralConfig(
            vocab_size=vocab, hidden_size=cfg.hidden_size, intermediate_size=intermediate,
            num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
            num_key_value_heads=kv_heads, max_position_embeddings=cfg.max_position_embeddings,
            attention_dropout=cfg.dropout, tie_word_embeddings=cfg.tie_embeddings, use_cache=False,
            num_local_experts=cfg.num_experts, num_experts_per_tok=cfg.experts_per_token,
            router_aux_loss_coef=cfg.router_aux_loss_coef, output_router_logits=True,
        )
    return LlamaConfig(
        vocab_size=vocab, hidden_size=cfg.hidden_size, intermediate_size=intermediate,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
        num_key_value_heads=kv_heads, max_position_embeddings=cfg.max_position_embeddings,
        attention_dropout=cfg.dropout, tie_word_embeddings=cfg.tie_embeddings, use_cache=False,
    )


def context_length(config) -> int:
    config = config.get_text_config()
    return getattr(config, "max_position_embeddings", None) or config.n_positions


def build_model(cfg: ModelConfig, config, precision: str = "fp32", shapes_only: bool = False, head: str = "lm"):
    """Instantiate the model (random init for tiny, pretrained weights for hf) in fp32; with
    model.quantization, the linear layers' weights in 4 or 8 bits (computing in `precision`).
    `shapes_only`: under a meta device context, the same modules without loading any weights
    (trainloop.parallel.sharding: they come from the main process). `head`: a key of
    trainloop.model.heads.HEADS (a pretrained model's score head starts from random weights)."""
    import torch

    from trainloop.model.adapter import quantization_config

    if head == "score":
        as_scorer(config)
    auto = auto_class(head, is_vision(config))
    try:
        if cfg.name == "hf" and not shapes_only:
            # Loaded at its own vocabulary size; a larger tokenizer's rows are added below. In fp32
            # whatever the files hold: transformers 5 keeps a checkpoint's dtype by default, and
            # most are saved in bf16, which would train bf16 weights with no fp32 master copy.
            model = auto.from_pretrained(
                cfg.name_or_path, attn_implementation=cfg.attn_implementation, ignore_mismatched_sizes=False,
                quantization_config=quantization_config(cfg, precision), dtype=torch.float32,
                **({"num_labels": 1} if head == "score" else {}),
            )
        else:  # from_pretrained refuses a meta context: a pretrained model's shapes come from its config
            model = auto.from_config(config, attn_implementation=cfg.attn_implementation, dtype=torch.float32)
    except ImportError as err:  # e.g. flash_attention_2 without the flash-attn package
        raise ConfigError(f"model.attn_implementation={cfg.attn_implementation!r} is not available "
                          f"here: {err}. Use model.attn_implementation=sdpa or eager") from None
    except ValueError as err:
        if "attn" not in str(err).lower():
            raise
        raise ConfigError(f"model.attn_implementation={cfg.attn_implementation!r}: {err}") from None
    vocab = config.get_text_config().vocab_size
    if model.get_input_embeddings().num_embeddings < vocab:
        model.resize_token_embeddings(vocab)
    # a pretrained model's config.json and generation_config.json keep the model's own ids
    ids = {key: getattr(config, key) for key in SPECIAL_TOKENS}
    carry_token_ids(model.config, ids)
    if getattr(model, "generation_config", None) is not None:  # a score head generates nothing
        carry_token_ids(model.generation_config, ids)
    expect_tied_aliases(model)
    if cfg.gradient_checkpointing:
        # Non-reentrant checkpointing: works with torch.compile and with inputs that need no grad.
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5 (the old name warns)
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    return model


class TiedAliasWarnings(logging.Filter):
    """Drops accelerate's "Removed shared tensor {...}" warning for the tied aliases a model
    declares (lm_head.weight sharing the embedding): every checkpoint save drops the duplicate and
    loading ties it again, as the config says. Any other shared tensor still warns."""

    def __init__(self):
        super().__init__()
        self.aliases: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        found = re.search(r"Removed shared tensor (\{.*?\}) while saving", record.getMessage())
        return not (found and {_bare(name) for name in ast.literal_eval(found.group(1))} <= self.aliases)


def _bare(name: str) -> str:
    """A parameter name without the prefixes of wrappers (DDP's `module.`, torch.compile's `_orig_mod.`)."""
    while name.startswith(("module.", "_orig_mod.")):
        name = name.split(".", 1)[1]
    return name


TIED_ALIAS_WARNINGS = TiedAliasWarnings()


def expect_tied_aliases(model) -> None:
    """Let the saves of `model` drop its declared weight aliases without a warning."""
    named_once = {name for name, _ in model.named_parameters()}
    TIED_ALIAS_WARNINGS.aliases |= {name for name, _ in model.named_parameters(remove_duplicate=False)} - named_once
    logger = logging.getLogger("accelerate.utils.other")
    if TIED_ALIAS_WARNINGS not in logger.filters:
        logger.addFilter(TIED_ALIAS_WARNINGS)


def problems(cfg) -> list[str]:
    """The model section's checks (config.validate collects them)."""
    problems = []
    m = cfg.model
    if m.name == "tiny" and m.hidden_size % m.num_heads:
        problems.append(
            f"model.hidden_size={m.hidden_size} is not divisible by model.num_heads={m.num_heads}"
        )
    if m.name == "tiny" and m.num_kv_heads is not None:
        if m.arch == "gpt2":
            problems.append(f"model.num_kv_heads={m.num_kv_heads} with model.arch=gpt2: GPT-2 has no grouped-query "
                            "attention; drop model.num_kv_heads or use model.arch=llama")
        elif m.num_kv_heads <= 0 or m.num_heads % m.num_kv_heads:
            problems.append(f"model.num_kv_heads={m.num_kv_heads} must divide model.num_heads={m.num_heads} "
                            "(each key/value head serves num_heads / num_kv_heads query heads)")
    if m.name == "hf" and not m.name_or_path:
        problems.append("model=hf needs model.name_or_path: a local model directory or a hub id")
    if not 0.0 <= m.dropout < 1.0:
        problems.append(f"model.dropout={m.dropout} must be in [0, 1)")
    if m.experts_per_token > m.num_experts:
        problems.append(f"model.experts_per_token={m.experts_per_token} is more than model.num_experts="
                        f"{m.num_experts}: a token cannot be routed to more experts than there are")
    if m.router_aux_loss_coef < 0:
        problems.append(f"model.router_aux_loss_coef={m.router_aux_loss_coef} must be 0 or more")
    return problems
