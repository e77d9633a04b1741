"""Sample generations (eval.prompts): at every evaluation the model completes each prompt greedily.

Every rank generates, together: under ZeRO-3 and FSDP2 each forward gathers the parameters
from all ranks, so no rank may run a forward the others do not (`synced_gpus` keeps them in step
until every rank has finished). Greedy decoding in eval mode draws no random numbers, so a run
with samples trains exactly as one without.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

from trainloop.errors import ConfigError


class Samples:
    def __init__(self, prompts: list[str], tokenizer, max_new_tokens: int, context: int):
        self.prompts = list(prompts)
        self.tokenizer = tokenizer
        self.max_new_tokens = max_new_tokens
        self.ids = [tokenizer(p, return_tensors="pt").input_ids for p in self.prompts]
        for i, (prompt, ids) in enumerate(zip(self.prompts, self.ids)):
            if ids.shape[1] == 0:
                raise ConfigError(f"eval.prompts[{i}]={prompt!r} is no token at all: give it some text")
            if ids.shape[1] + max_new_tokens > context:
                raise ConfigError(
                    f"eval.prompts[{i}] is {ids.shape[1]} tokens and eval.max_new_tokens={max_new_tokens}: "
                    f"together longer than the model's context of {context} tokens; shorten the prompt "
                    "or lower eval.max_new_tokens")

    @classmethod
    def for_config(cls, cfg, tokenizer, context: int) -> Samples | None:
        if not cfg.eval.prompts:
            return None
        return cls(cfg.eval.prompts, tokenizer, cfg.eval.max_new_tokens, context)

    @torch.no_grad()
    def generate(self, strategy, model) -> list[dict]:
        """[{"prompt": ..., "text": what the model wrote after it}], the same on every rank: each
        takes part in every forward while sharded weights are gathered (`strategy`: trainloop.parallel's)."""
        # a compiled model would recompile for every new length: generation runs it eagerly
        eager = torch.compiler.set_stance("force_eager") if hasattr(torch.compiler, "set_stance") else nullcontext()
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        outputs = []
        with strategy.generator(model) as module:  # the model as the layout runs it (a pipeline's stages too)
            module.eval()
            try:
                with eager:
                    for ids in self.ids:
                        ids = ids.to(strategy.device)
                        outputs.append(module.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                                       max_new_tokens=self.max_new_tokens, pad_token_id=pad,
                                                       synced_gpus=strategy.world_size > 1))
            finally:
                module.train()
        return [{"prompt": prompt, "text": self.tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)}
                for prompt, ids, out in zip(self.prompts, self.ids, outputs)]
