"""The DeepSpeed config, generated from the composed Hydra config (one source of truth)."""

from __future__ import annotations

import torch

from trainloop.config import ConfigError
from trainloop.distributed import world_size_from_env


def _offload(device: str, nvme_path: str | None, pin_memory: bool) -> dict:
    section = {"device": device, "pin_memory": pin_memory}
    if device == "nvme":
        section["nvme_path"] = nvme_path
    return section


def deepspeed_config(cfg, world_size: int) -> dict:
    """DeepSpeed's JSON: micro batch, accumulation, clipping and precision come from their groups."""
    ds, tc = cfg.deepspeed, cfg.trainer
    pin = torch.cuda.is_available()
    zero = {
        "stage": ds.stage,
        "overlap_comm": ds.overlap_comm,
        "contiguous_gradients": ds.contiguous_gradients,
        "reduce_bucket_size": ds.reduce_bucket_size,
        "allgather_bucket_size": ds.allgather_bucket_size,
    }
    if ds.offload_optimizer != "none":
        zero["offload_optimizer"] = _offload(ds.offload_optimizer, ds.nvme_path, pin)
    if ds.stage == 3:
        zero.update(
            stage3_prefetch_bucket_size=ds.stage3_prefetch_bucket_size,
            stage3_param_persistence_threshold=ds.stage3_param_persistence_threshold,
            stage3_gather_16bit_weights_on_model_save=ds.gather_16bit_weights_on_model_save,
        )
        if ds.offload_param != "none":
            zero["offload_param"] = _offload(ds.offload_param, ds.nvme_path, pin)
    return {
        "train_micro_batch_size_per_gpu": cfg.data.batch_size,
        "gradient_accumulation_steps": tc.gradient_accumulation_steps,
        "train_batch_size": cfg.data.batch_size * tc.gradient_accumulation_steps * world_size,
        "gradient_clipping": tc.max_grad_norm or 0.0,
        "zero_optimization": zero,
        "bf16": {"enabled": cfg.precision.name == "bf16"},
        "fp16": {"enabled": cfg.precision.name == "fp16", "loss_scale": 0, "initial_scale_power": 16},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def build_deepspeed_plugin(cfg):
    try:
        import deepspeed  # noqa: F401
    except ImportError as err:
        raise ConfigError(f"deepspeed.stage={cfg.deepspeed.stage} needs DeepSpeed ({err}): "
                          "pip install deepspeed, or set deepspeed=none") from None
    from accelerate.utils import DeepSpeedPlugin

    return DeepSpeedPlugin(hf_ds_config=deepspeed_config(cfg, world_size_from_env()))
