"""The harness's HFLM over a model that is training (eval.harness, trainloop/observe/harness.py).

Imported only when eval.harness.tasks is set: it imports lm_eval, the `trainloop[eval]` extra. The
requests run through HFLM's own code (tokenising, batching, log-likelihoods, generation), so a score
is the one `lm_eval --model hf` gives for the same weights.
"""

from __future__ import annotations

from lm_eval.models.huggingface import HFLM


def _tied_already(*args, **kwargs) -> None:
    """The live model's weights are tied as it was built and trained."""


class LiveLM(HFLM):
    """HFLM over `model` as it is (the unwrapped module the strategy holds, sharded or not, adapted or
    not), without progress bars (the run's own is on screen). `device`: where its inputs go. `synced`: a
    generation runs its forwards until every rank has finished (synced_gpus), as several processes score
    together."""

    def __init__(self, model, tokenizer, batch_size: int, device, synced: bool):
        # HFLM ties a model's input and output embeddings as it takes it, for a model just loaded; the
        # live one's are tied already, and tying again re-assigns a weight FSDP2 or ZeRO-3 holds sharded
        model.tie_weights = _tied_already
        try:
            super().__init__(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, backend="causal")
        finally:
            del model.tie_weights
        # the device training's batches go to: the model's first weight may sit elsewhere (offloaded to the CPU)
        self._device = device
        self.synced = synced

    def loglikelihood(self, requests, disable_tqdm: bool = False):
        return super().loglikelihood(requests, disable_tqdm=True)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        return super().loglikelihood_rolling(requests, disable_tqdm=True)

    def generate_until(self, requests, disable_tqdm: bool = False):
        return super().generate_until(requests, disable_tqdm=True)

    def _model_generate(self, context, max_length: int, stop: list[str], **generation_kwargs):
        return super()._model_generate(context, max_length, stop, synced_gpus=self.synced, **generation_kwargs)
