"""The causal LM: a tiny one built from its shape, or a pretrained one from a path."""

from __future__ import annotations

from trainloop.config import ConfigError, ModelConfig


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def build_model_config(cfg: ModelConfig, vocab_size: int):
    """The transformers config, without weights: cheap, so checks can run before any compute."""
    from transformers import AutoConfig, GPT2Config, LlamaConfig

    if cfg.name == "hf":
        try:
            config = AutoConfig.from_pretrained(cfg.name_or_path)
        except (OSError, ValueError) as err:
            raise ConfigError(
                f"model.name_or_path={cfg.name_or_path!r}: no model config could be loaded ({err}). "
                "Give a local model directory; hub ids need HF_HUB_OFFLINE=0 and network access"
            ) from None
        if vocab_size > config.vocab_size:
            config.vocab_size = round_up(vocab_size, cfg.vocab_multiple)
        return config
    vocab = round_up(vocab_size, cfg.vocab_multiple)
    intermediate = cfg.intermediate_size or 4 * cfg.hidden_size
    if cfg.arch == "gpt2":
        return GPT2Config(
            vocab_size=vocab, n_positions=cfg.max_position_embeddings, n_embd=cfg.hidden_size,
            n_layer=cfg.num_layers, n_head=cfg.num_heads, n_inner=intermediate,
            resid_pdrop=cfg.dropout, embd_pdrop=cfg.dropout, attn_pdrop=cfg.dropout,
            use_cache=False,
        )
    return LlamaConfig(
        vocab_size=vocab, hidden_size=cfg.hidden_size, intermediate_size=intermediate,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_heads, max_position_embeddings=cfg.max_position_embeddings,
        attention_dropout=cfg.dropout, tie_word_embeddings=True, use_cache=False,
    )


def context_length(config) -> int:
    return getattr(config, "max_position_embeddings", None) or config.n_positions


def build_model(cfg: ModelConfig, config):
    """Instantiate the model (random init for tiny, pretrained weights for hf) in fp32."""
    from transformers import AutoModelForCausalLM

    try:
        if cfg.name == "hf":
            # Loaded at its own vocabulary size; a larger tokenizer's rows are added below.
            model = AutoModelForCausalLM.from_pretrained(
                cfg.name_or_path, attn_implementation=cfg.attn_implementation, ignore_mismatched_sizes=False,
            )
        else:
            model = AutoModelForCausalLM.from_config(config, attn_implementation=cfg.attn_implementation)
    except ImportError as err:  # e.g. flash_attention_2 without the flash-attn package
        raise ConfigError(f"model.attn_implementation={cfg.attn_implementation!r} is not available "
                          f"here: {err}. Use model.attn_implementation=sdpa or eager") from None
    except ValueError as err:
        if "attn" not in str(err).lower():
            raise
        raise ConfigError(f"model.attn_implementation={cfg.attn_implementation!r}: {err}") from None
    if model.get_input_embeddings().num_embeddings < config.vocab_size:
        model.resize_token_embeddings(config.vocab_size)
    if cfg.gradient_checkpointing:
        # Non-reentrant checkpointing: works with torch.compile and with inputs that need no grad.
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5 (the old name warns)
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    return model
