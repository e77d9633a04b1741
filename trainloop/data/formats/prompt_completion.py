"""data=prompt_completion: prompt/completion pairs, the loss on the completion only (data.train_on=all for both)."""

from __future__ import annotations

from dataclasses import dataclass

from trainloop.config.sections import DataConfig
from trainloop.data.formats.base import DataFormat, ragged_table
from trainloop.data.tokenizer import IGNORE
from trainloop.errors import ConfigError


@dataclass
class PromptConfig:
    """The key of every format whose rows hold a prompt (data=prompt_completion, preference, prompts)."""

    prompt_field: str = "prompt"  # the column holding the prompt


@dataclass
class PromptCompletionConfig(PromptConfig):
    completion_field: str = "completion"  # the column holding the completion


class PromptCompletion(DataFormat):
    name = "prompt_completion"
    keys = PromptCompletionConfig
    fields = {"data.prompt_field": "text", "data.completion_field": "text"}
    train_on = ("completion", "all")
    masked = True

    def load(self, cfg: DataConfig, tokenizer=None):
        """Every pair has text in both fields, or the first row without is named."""
        rows = self.rows(cfg)
        for key, column in self.columns(cfg).items():
            missing = [r for r, value in enumerate(rows[column]) if not isinstance(value, str)]
            if missing:
                raise ConfigError(f"{self.place(cfg, missing[0])}: {key}={column!r} has no text there (nor in "
                                  f"{len(missing) - 1} more rows); fix or remove those rows")
        return rows

    def row_tokenizer(self, cfg: DataConfig, tokenizer):
        eos = tokenizer.eos_token_id
        encode = lambda texts: tokenizer(texts, add_special_tokens=False)["input_ids"]  # noqa: E731

        def tokenize(batch):
            prompts = encode(batch[cfg.prompt_field])
            completions = [c + [eos] for c in encode(batch[cfg.completion_field])]
            hide = cfg.train_on == "completion"
            return ragged_table(input_ids=[p + c for p, c in zip(prompts, completions)],
                                labels=[([IGNORE] * len(p) if hide else p) + c for p, c in zip(prompts, completions)])
        return tokenize
