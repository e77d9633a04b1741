"""Context parallelism (parallel.cp_size): the ranks of one context-parallel group read the same
samples, and each holds a contiguous 1/cp of every sequence through the whole model; attention
trades that, by one all-to-all, for the whole sequence on 1/cp of the heads, and back after
(DeepSpeed Ulysses' design: only an all-to-all, which gloo has too).

What it changes, and where:
- the model's inputs (`local`): each rank's slice of the input ids and of the global position ids
  (so RoPE and learned positions are exact), and the whole sequence's documents (packed documents,
  trainloop.model.attention) or mask (a padded row's), which attention applies after the swap;
- attention (`attend`, called by trainloop.model.attention's functions, which `local` hands this
  group with the inputs: transformers passes a forward's keyword arguments to every layer's
  attention): the swap to heads, transformers' sdpa over the whole sequence, the swap back;
- the loss (trainloop.objectives.chunked_loss): targets are shifted on the whole sequence before
  the split (a slice's last token predicts the next slice's first); a slice's per-token
  log-probabilities are gathered into the whole row (`gather`), a summed loss is summed over the
  group (`total`). So every rank of a group computes the same loss of the whole batch, as one
  data-parallel rank would, and each rank's gradients are its slice's share of it: the backward
  of `gather` and `total` takes only this rank's part (every rank's loss above them is the same),
  and the strategy sums the gradients over the group (trainloop.parallel.base.Strategy.forward_backward).

The strategy installs its group on each model it places (`install`: the policy, a frozen reference or
teacher), and the loss asks the model it runs for it (`of`). A forward outside the group's `active`
(generation, a reference's log-probabilities before a step, the batch-size search's one-rank steps)
runs the whole sequence on each rank, with the same masks.
"""

from __future__ import annotations

from contextlib import contextmanager
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn.functional as F

_INSTALLED = "trainloop_context_parallel"  # the attribute `install` sets on a model


def of(model) -> ContextParallel | None:
    """The context-parallel group `model`'s forward splits its sequences over now, or None: the one installed on
    it (inside DDP's or DeepSpeed's wrapper too), while that group is active."""
    cp = getattr(getattr(model, "module", model), _INSTALLED, None)
    return cp if cp is not None and cp.splitting else None


class _AllToAll(torch.autograd.Function):
    """Row i of dim 0 goes to rank i; row i of the result came from rank i. Its backward is the same
    exchange, reversed."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _AllToAll.exchange(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _AllToAll.exchange(grad, ctx.group), None

    @staticmethod
    def exchange(x, group):
        x = x.contiguous()
        out = torch.empty_like(x)  # contiguous too (empty_like keeps a transposed tensor's strides)
        dist.all_to_all_single(out, x, group=group)
        return out


class _Gather(torch.autograd.Function):
    """The group's slices concatenated along dim 1; backward: this rank's slice of the gradient
    (every rank computes the same loss from the whole, so the gradient is the same on each)."""

    @staticmethod
    def forward(ctx, x, group, rank):
        ctx.rank, ctx.width = rank, x.shape[1]
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x, group=group)
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx, grad):
        return grad.narrow(1, ctx.rank * ctx.width, ctx.width), None, None


class _Total(torch.autograd.Function):
    """Summed over the group; backward: the same gradient to this rank's part (as _Gather's)."""

    @staticmethod
    def forward(ctx, x, group):
        total = x.clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class ContextParallel:
    """One rank's place in its context-parallel group: `size` consecutive ranks."""

    def __init__(self, group, size: int, rank: int):
        self.group, self.size, self.rank = group, size, rank
        self._depth = 0  # how many `active` blocks are open

    def install(self, model):
        """`model`, whose forwards inside `active` split their sequences over this group (`of`)."""
        setattr(getattr(model, "module", model), _INSTALLED, self)
        return model

    @property
    def splitting(self) -> bool:
        return self._depth > 0

    @contextmanager
    def active(self):
        """The forwards in the block, of the models this group is installed on, split their sequences over it."""
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1

    # -- the sequence ------------------------------------------------------------------------------
    def padding(self, length: int) -> int:
        """Tokens appended to a row of `length` so that it splits evenly (rows of DPO's pairs and of
        GRPO's completions have any length; causal_lm's are data.seq_len, a multiple of cp)."""
        return -length % self.size

    def split(self, t: torch.Tensor, fill) -> torch.Tensor:
        """This rank's slice of `t` along dim 1, `t` padded with `fill` to a multiple of the group."""
        pad = self.padding(t.shape[1])
        if pad:
            t = F.pad(t, (0, pad), value=fill)
        width = t.shape[1] // self.size
        return t.narrow(1, self.rank * width, width)

    def local(self, inputs: dict) -> dict:
        """The model's inputs for this rank: its slice of the input ids and of the global position
        ids; the whole sequence's documents or padded rows' mask (`documents`, `document_mask`:
        trainloop.model.attention), padded, as is; and this group, which the model's attention swaps the
        slices over (`context_parallel`)."""
        ids = inputs["input_ids"]
        batch, length = ids.shape
        positions = inputs.get("position_ids")
        if positions is None:
            positions = torch.arange(length, device=ids.device).expand(batch, length)
        pad = self.padding(length)
        out = {**inputs, "input_ids": self.split(ids, 0), "context_parallel": self}
        # the padding's positions run on, so a document's mask holds them inside the last document
        out["position_ids"] = self.split(torch.cat([positions, positions[:, -1:] + 1 + torch.arange(
            pad, device=ids.device)], dim=1) if pad else positions, 0)
        documents = inputs.get("documents")
        if documents is not None and pad:  # the padding: a document of its own
            out["documents"] = torch.cat([documents, (documents[:, -1:] + 1).expand(-1, pad)], dim=1)
        mask = inputs.get("document_mask")
        if mask is not None and pad:
            mask = F.pad(mask, (0, pad, 0, pad), value=False)
            mask[..., length:, length:] = torch.eye(pad, dtype=torch.bool, device=mask.device)
            out["document_mask"] = mask
        return out

    def gather(self, per_token: torch.Tensor, length: int) -> torch.Tensor:
        """Every slice's values of the whole rows (batch, `length`), from this rank's (batch, slice)."""
        return _Gather.apply(per_token, self.group, self.rank)[:, :length]

    def total(self, summed: torch.Tensor) -> torch.Tensor:
        """A sum over this rank's slice, summed over the group."""
        return _Total.apply(summed, self.group)

    # -- attention ---------------------------------------------------------------------------------
    def attend(self, attention, module, query, key, value, mask, **kwargs):
        """`attention(module, query, key, value, mask, **kwargs)` (transformers' sdpa) over the whole
        sequence on this rank's 1/cp of the heads. In: (batch, heads, slice, dim) each; out:
        (batch, slice, heads, dim), as transformers' attention functions return it. Key/value heads
        that do not split over the group are repeated to one per query head first."""
        heads, kv_heads = query.shape[1], key.shape[1]
        if kv_heads % self.size:
            from transformers.integrations.sdpa_attention import repeat_kv

            key, value = repeat_kv(key, heads // kv_heads), repeat_kv(value, heads // kv_heads)
            module = SimpleNamespace(num_key_value_groups=1, is_causal=getattr(module, "is_causal", True))
        out, weights = attention(module, self._to_heads(query), self._to_heads(key), self._to_heads(value), mask,
                                 **kwargs)
        return self._to_sequence(out), weights

    def _to_heads(self, x: torch.Tensor) -> torch.Tensor:
        """(batch, heads, slice, dim) -> (batch, heads / cp, sequence, dim): head group i to rank i."""
        batch, heads, width, dim = x.shape
        send = x.reshape(batch, self.size, heads // self.size, width, dim).transpose(0, 1)
        got = _AllToAll.apply(send, self.group)  # [rank i's slice of my heads]
        return got.permute(1, 2, 0, 3, 4).reshape(batch, heads // self.size, self.size * width, dim)

    def _to_sequence(self, x: torch.Tensor) -> torch.Tensor:
        """(batch, sequence, heads / cp, dim) -> (batch, slice, heads, dim): slice i to rank i."""
        batch, length, heads, dim = x.shape
        send = x.reshape(batch, self.size, length // self.size, heads, dim).transpose(0, 1)
        got = _AllToAll.apply(send, self.group)  # [my slice of rank i's heads]
        return got.permute(1, 2, 0, 3, 4).reshape(batch, length // self.size, self.size * heads, dim)
