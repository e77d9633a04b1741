"""A forward that already ran, as the model an objective's loss calls: a layout that runs the forward itself
(the pipeline's last stage) hands the loss its output this way, and an objective hands its own loss a frozen
copy's output it computed before (Objective.beside)."""

from __future__ import annotations

from types import SimpleNamespace


class Forwarded:
    """Called with the rows the forward ran on, it returns that forward's output as transformers' model would:
    `logits`, or with `pad_id` (a score head's per-token scores) each row's score at its last token that is not
    padding, as transformers' sequence classifiers read it."""

    def __init__(self, logits, input_ids, pad_id: int | None = None):
        self.logits, self.input_ids, self.pad_id = logits, input_ids, pad_id

    def __call__(self, input_ids, **_):
        import torch

        if not torch.equal(input_ids, self.input_ids):  # other shapes are not equal either
            raise RuntimeError("an objective's loss asked for a forward of other rows than the one that ran")
        if self.pad_id is None:
            return SimpleNamespace(logits=self.logits)
        positions = torch.arange(input_ids.shape[-1], device=input_ids.device)
        last = (positions * (input_ids != self.pad_id)).argmax(-1)
        return SimpleNamespace(logits=self.logits[torch.arange(len(input_ids), device=input_ids.device), last])
