"""The tokenizer a run reads its data with, and what identifies it (its vocabulary's hash).

A leaf: the data formats, the prepared shards' writer and reader and the data builder all need
these, and none of them need one another for it. transformers is imported where it is used.
"""

from __future__ import annotations

import hashlib
import json

from trainloop.errors import ConfigError

IGNORE = -100  # the label torch's cross-entropy skips: no loss on this token

EOS = "<|endoftext|>"


def byte_level_tokenizer():
    """256 byte tokens plus an end-of-text token: no training, no download, any text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {symbol: i for i, symbol in enumerate(alphabet)}
    vocab[EOS] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token=EOS, bos_token=EOS, pad_token=EOS, unk_token=EOS
    )


def build_tokenizer(tokenizer_path: str | None, model_path: str | None):
    """data.tokenizer if given, else the pretrained model's own, else the built-in bytes."""
    from transformers import AutoTokenizer

    path, key = (tokenizer_path, "data.tokenizer") if tokenizer_path else (model_path, "model.name_or_path")
    if path is None:
        return byte_level_tokenizer()
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as err:
        raise ConfigError(
            f"{key}={path!r}: no tokenizer could be loaded from it ({err}). Give a local "
            "directory with tokenizer files, or a hub id with HF_HUB_OFFLINE=0 and network access"
        ) from None
    if tokenizer.eos_token_id is None:
        raise ConfigError(f"{key}={path!r}: the tokenizer has no eos_token to separate documents")
    return tokenizer


def pad_id(tokenizer) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def vocabulary_fingerprint(tokenizer) -> str:
    """The tokenizer's vocabulary, hashed: what a run's resume check and prepared shards compare."""
    vocab = tokenizer.get_vocab()
    vocab_hash = hashlib.sha256(json.dumps(sorted(vocab.items())).encode()).hexdigest()
    return f"{len(vocab)} tokens, sha256 {vocab_hash[:16]}"


def tokenizer_record(tokenizer) -> dict:
    """The tokenizer as prepared shards record it: where it came from, and its vocabulary."""
    return {"source": tokenizer.name_or_path or "the built-in byte-level tokenizer",
            "vocabulary": vocabulary_fingerprint(tokenizer)}
