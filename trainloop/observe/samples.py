"""Sample generations (eval.prompts): at every evaluation the model completes each prompt greedily.

Every rank generates, together: under ZeRO-3 and FSDP2 each forward gathers the parameters
from all ranks, so no rank may run a forward the others do not (`synced_gpus` keeps them in step
until every rank has finished). Greedy decoding in eval mode draws no random numbers, so a run
with samples trains exactly as one without.
"""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path

import torch

from trainloop.errors import ConfigError


class Samples:
    """eval.prompts, tokenized once; with eval.images (a vision-language model) each prompt asked about its image,
    as a user turn rendered by the run's processor with its chat template and the generation prompt."""

    def __init__(self, prompts: list[str], tokenizer, max_new_tokens: int, context: int, images: list[str] = ()):
        self.prompts, self.images = list(prompts), list(images)
        self.tokenizer = tokenizer
        self.max_new_tokens = max_new_tokens
        self.inputs = ([asked(prompt, image, tokenizer) for prompt, image in zip(self.prompts, self.images)]
                       if self.images else [{"input_ids": tokenizer(p, return_tensors="pt").input_ids}
                                            for p in self.prompts])
        self.ids = [inputs["input_ids"] for inputs in self.inputs]
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
        images = list(cfg.eval.images)
        if images and len(images) != len(cfg.eval.prompts):
            raise ConfigError(f"eval.images holds {len(images)} image(s) for {len(cfg.eval.prompts)} eval.prompts: give "
                              "one image a prompt, or eval.images=[] to ask the prompts alone")
        for i, image in enumerate(images):
            if not Path(image).expanduser().is_file():
                raise ConfigError(f"eval.images[{i}]={image!r}: no such file; give an image's path")
        return cls(cfg.eval.prompts, tokenizer, cfg.eval.max_new_tokens, context, images)

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
                    for inputs in self.inputs:
                        inputs = {key: value.to(strategy.device) for key, value in inputs.items()}
                        ids = inputs.pop("input_ids")
                        outputs.append(module.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                                       max_new_tokens=self.max_new_tokens, pad_token_id=pad,
                                                       synced_gpus=strategy.world_size > 1, **inputs))
            finally:
                module.train()
        said = [{"prompt": prompt, "text": self.tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)}
                for prompt, ids, out in zip(self.prompts, self.ids, outputs)]
        return [{**s, "image": image} for s, image in zip(said, self.images)] if self.images else said


def asked(prompt: str, image: str, tokenizer) -> dict:
    """The model's inputs for `prompt` about `image` (a path): one user turn, the image then the text, rendered by
    the processor around `tokenizer` (trainloop.model.vision) with the generation prompt; its pixels too."""
    from trainloop.data.sets import open_image
    from trainloop.model.vision import processor_of

    processor = processor_of(tokenizer)
    if processor is None:
        raise ConfigError("eval.images asks the prompts about images: it needs a vision-language model's processor "
                          "(data=vision_chat with model.arch=llava or a model=hf VLM)")
    messages = [{"role": "user", "content": [{"type": "image", "image": open_image(str(Path(image).expanduser()))},
                                             {"type": "text", "text": prompt}]}]
    out = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True,
                                        return_tensors="pt")
    return {key: value for key, value in out.items() if key != "attention_mask"}
