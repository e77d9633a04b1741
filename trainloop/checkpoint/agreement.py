"""Agreement between ranks around a save: each rank's attempt, a barrier that tells every rank
whether any failed (so none waits forever for one that did), and the check that the parameters are
finite on every rank before anything is written over a good checkpoint."""

from __future__ import annotations

from trainloop.model.tensors import local_shard


def attempt(action, *args) -> BaseException | None:
    """Run `action(*args)`; its failure, if any, returned for every rank to hear of (any_rank_failed)."""
    try:
        action(*args)
    except Exception as err:  # any failure: every rank must hear of it
        return err
    return None


def any_rank_failed(accelerator, failure: BaseException | None) -> bool:
    """A barrier: True on every rank when any rank's `failure` is not None."""
    import torch

    failed = torch.tensor(float(failure is not None), device=accelerator.device)
    return accelerator.reduce(failed, reduction="sum").item() != 0


def parameters_finite(accelerator, model) -> bool:
    """True when every rank's parameters (its ZeRO-3 partition, if any) are all finite."""
    import torch

    bad = torch.zeros((), device=accelerator.device)
    for p in model.parameters():
        local = local_shard(p)
        if local.numel():
            bad += (~torch.isfinite(local.detach())).any().float()
    return accelerator.reduce(bad, reduction="sum").item() == 0
