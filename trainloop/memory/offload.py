"""Activation offloading (trainer.activation_offload=true): the tensors the forward saves for the
backward are moved to pinned host memory as they are saved, and brought back when the backward
needs them, so a step's activations live in host memory instead of the GPU's.

Built on autograd's saved-tensor hooks, the seam torch's own `save_on_cpu` uses. Unlike it, the
copy to the host runs on a side CUDA stream, so it overlaps the forward's next kernels; the copy
back runs on the compute stream when the backward unpacks the tensor (no prefetch). Parameters
and small tensors stay where they are: a parameter is held anyway, and a copy of a few bytes costs
more than it saves. Gradient checkpointing composes: only what a checkpointed block keeps (its
input) is saved, and that is offloaded.

On the CPU the activations are in host memory already: the run says so once and trains as
without it.
"""

from __future__ import annotations

import logging
from contextlib import nullcontext

import torch

log = logging.getLogger("trainloop")

MIN_BYTES = 1024  # smaller saved tensors stay on the device


class OffloadHooks(torch.autograd.graph.saved_tensors_hooks):
    """Saved tensors of at least MIN_BYTES (not parameters) copied to host memory in the forward,
    and back to their device in the backward. `stream`: the CUDA stream the copies out run on
    (None: on the current stream, synchronously; what the CPU test of the hooks uses).
    `offloaded` counts the bytes moved since construction."""

    def __init__(self, stream=None):
        self.stream, self.offloaded = stream, 0
        super().__init__(self.pack, self.unpack)

    def pack(self, tensor: torch.Tensor):
        if isinstance(tensor, torch.nn.Parameter) or tensor.numel() * tensor.element_size() < MIN_BYTES:
            return tensor
        self.offloaded += tensor.numel() * tensor.element_size()
        pinned = tensor.device.type == "cuda"
        host = torch.empty(tensor.size(), dtype=tensor.dtype, layout=tensor.layout, pin_memory=pinned)
        if self.stream is None:
            host.copy_(tensor)
            return tensor.device, host, None
        self.stream.wait_stream(torch.cuda.current_stream(tensor.device))  # the tensor is computed
        with torch.cuda.stream(self.stream):
            host.copy_(tensor, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        tensor.record_stream(self.stream)  # its memory is not reused until the copy has read it
        return tensor.device, host, done

    @staticmethod
    def unpack(packed):
        if isinstance(packed, torch.Tensor):
            return packed
        device, host, done = packed
        if done is not None:
            torch.cuda.current_stream(device).wait_event(done)
        return host.to(device, non_blocking=done is not None)


class ActivationOffload:
    """The context a training forward runs in: OffloadHooks on a CUDA device, nothing elsewhere
    (`say`: the run's own, which says so once)."""

    def __init__(self, enabled: bool, device: torch.device, say: bool = False):
        self.on = enabled and device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.on else None
        if enabled and not self.on and say:
            log.info("trainer.activation_offload=true: the activations are in host memory already on %s; "
                     "nothing to offload", device)

    def __call__(self):
        return OffloadHooks(self.stream) if self.on else nullcontext()
