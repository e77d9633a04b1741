"""What a model ends in, as an objective asks (Objective.head): transformers' auto class for each head."""

from __future__ import annotations

# "lm": the next token's logits over the vocabulary. "score": one scalar per sequence, read at its last
# token that is not padding (config.pad_token_id), as TRL's RewardTrainer reads it (objective=reward)
HEADS = {"lm": "AutoModelForCausalLM", "score": "AutoModelForSequenceClassification"}


def auto_class(head: str = "lm", vision: bool = False):
    """The auto class of `head`; a vision-language model's (trainloop.model.vision.is_vision) next-token logits
    come from AutoModelForImageTextToText."""
    import transformers

    return transformers.AutoModelForImageTextToText if vision and head == "lm" else getattr(transformers, HEADS[head])


def as_scorer(config) -> None:
    """Give a model config one score (num_labels 1) and the padding id the score head skips past:
    the tokenizer's pad, else its eos, as TRL sets it."""
    config.num_labels = 1
    if config.pad_token_id is None:
        config.pad_token_id = config.eos_token_id
