"""Who am I, which backend, one run directory for every rank.

The Accelerator is built from the composed config. On a machine without a GPU and with
WORLD_SIZE > 1, a plain `Accelerator()` reports DistributedType.NO in every process and each
trains alone (shared/FACTS.md); trainloop picks the CPU path (gloo) itself instead.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from trainloop.config import ConfigError

log = logging.getLogger("trainloop")

MIXED_PRECISION = {"fp32": "no", "bf16": "bf16", "fp16": "fp16"}


def world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def check_device_support(cfg, on_cuda: bool) -> None:
    """Refuse precisions the hardware cannot run, before anything is built."""
    name = cfg.precision.name
    if name == "fp16" and not on_cuda:
        raise ConfigError("precision=fp16 needs a CUDA GPU (fp16 autocast with loss scaling); "
                          "on this machine use precision=bf16 or precision=fp32")
    if name == "bf16" and on_cuda and not torch.cuda.is_bf16_supported():
        raise ConfigError(f"precision=bf16: {torch.cuda.get_device_name()} has no bf16 support; "
                          "use precision=fp16 (or fp32)")
    if cfg.precision.tf32 and not on_cuda:
        log.warning("precision.tf32=true has no effect without a CUDA GPU")
    elif cfg.precision.tf32 and torch.cuda.get_device_capability()[0] < 8:
        log.warning("precision.tf32=true has no effect on %s: TF32 needs an Ampere or newer GPU",
                    torch.cuda.get_device_name())
    if cfg.compile.backend == "cudagraphs" and not on_cuda:
        raise ConfigError("compile=cudagraphs records CUDA graphs and needs a CUDA GPU; "
                          "on this machine use compile=inductor (or aot_eager to debug)")


def build_accelerator(cfg):
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration, GradientAccumulationPlugin, InitProcessGroupKwargs

    on_cuda = torch.cuda.is_available()
    check_device_support(cfg, on_cuda)
    if cfg.precision.tf32 and on_cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

    kwargs, handlers = {}, []
    if cfg.deepspeed.stage:
        if not on_cuda:
            os.environ.setdefault("DS_ACCELERATOR", "cpu")  # read when deepspeed is imported
            handlers.append(InitProcessGroupKwargs(backend="gloo"))
        from trainloop.deepspeed import build_deepspeed_plugin

        kwargs["deepspeed_plugin"] = build_deepspeed_plugin(cfg)
    elif not on_cuda:
        kwargs["cpu"] = True  # MULTI_CPU over gloo when launched with several processes

    accelerator = Accelerator(
        mixed_precision=MIXED_PRECISION[cfg.precision.name],
        gradient_accumulation_plugin=GradientAccumulationPlugin(
            num_steps=cfg.trainer.gradient_accumulation_steps, sync_with_dataloader=True),
        dataloader_config=DataLoaderConfiguration(
            use_seedable_sampler=True, data_seed=cfg.trainer.seed, non_blocking=on_cuda),
        kwargs_handlers=handlers,
        **kwargs,
    )
    expected = world_size_from_env()
    if accelerator.num_processes != expected:
        raise RuntimeError(
            f"launched as {expected} processes (WORLD_SIZE) but accelerate runs "
            f"{accelerator.num_processes} ({accelerator.distributed_type}); the processes would "
            "train separate replicas. Launch with torchrun, or `accelerate launch --multi_gpu`"
        )
    return accelerator


def agree_run_dir(accelerator, run_dir: str | os.PathLike) -> Path:
    """Every rank takes rank 0's run directory (Hydra's `${now:}` differs between ranks)."""
    from accelerate.utils import broadcast_object_list

    mine = Path(run_dir).resolve()
    shared = [str(mine)]
    if accelerator.num_processes > 1:
        broadcast_object_list(shared, from_process=0)
    agreed = Path(shared[0])
    if agreed != mine and not accelerator.is_main_process:
        try:  # the empty folder Hydra made for this rank (rank_overrides keep it empty)
            mine.rmdir()
        except OSError:
            pass
    return agreed
