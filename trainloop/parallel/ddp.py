"""Data parallel (and one process): every rank holds the whole model and optimizer; accelerate
wraps the model in DistributedDataParallel, which all-reduces the gradients."""

from __future__ import annotations

from pathlib import Path

from trainloop.errors import CheckpointError
from trainloop.parallel.base import Strategy


def keep_trainable(models, weights, output_dir) -> None:
    """accelerate's save-state hook: drop the frozen parameters from the weights it saves."""
    for model, state in zip(models, weights):
        trainable = {name for name, p in model.named_parameters() if p.requires_grad}
        for key in [k for k in state if k not in trainable]:
            del state[key]


def expect_trainable(path: Path, model) -> None:
    """The checkpoint holds exactly this model's trainable parameters: the adapter loads with
    strict=False (the frozen base is absent by design), so a mismatch is caught here instead."""
    from safetensors import safe_open

    file = path / "model.safetensors"
    if not file.is_file():
        raise CheckpointError(f"{file} is missing: {path} is not an adapter checkpoint")
    with safe_open(file, framework="pt") as f:
        saved = set(f.keys())
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    if saved != trainable:
        raise CheckpointError(
            f"{file} holds {len(saved)} tensors, but this run trains {len(trainable)} "
            f"(missing {sorted(trainable - saved)[:3]}, unexpected {sorted(saved - trainable)[:3]}): "
            "it was saved with another adapter config; start a new run in a new hydra.run.dir")


class DataParallel(Strategy):
    name = "ddp"

    @staticmethod
    def chooses(cfg) -> bool:
        return True  # the first row: every config that chooses no row below it

    @staticmethod
    def layouts(gpus_per_node: int) -> dict[str, dict]:
        return {"DDP": {}}

    def save_state(self, directory, model, adapter_only: bool, record) -> None:
        acc = self.accelerator
        if not adapter_only:
            acc.save_state(str(directory))
            return
        handle = acc.register_save_state_pre_hook(keep_trainable)
        try:
            acc.save_state(str(directory))
        finally:
            handle.remove()

    def load_state(self, path, model, adapter_only: bool) -> None:
        from trainloop.parallel import dcp

        acc = self.accelerator
        if (Path(path) / dcp.MODEL_DIR).is_dir():  # a pipeline's stages (parallel.pp_size): DCP, by name
            dcp.load(Path(path), model, acc._optimizers[0], adapter_only, flatten=True)
            dcp.load_rank_states(acc, Path(path))
            return
        if not adapter_only:
            acc.load_state(str(path))
            return
        expect_trainable(Path(path), acc._models[0])
        acc.load_state(str(path), strict=False)  # the frozen base is not in the file

    def describe(self, model) -> str:
        return f"{self.accelerator.distributed_type} ({self.where()})"

    @staticmethod
    def memory_lines(plan, cfg, shape, world_size: int, dev: str, half: bool) -> None:
        """Every rank holds the whole model in fp32, its gradients and optimizer state; DDP adds its
        gradient buckets."""
        from trainloop.optim.optimizers import planned_state_bytes, planned_step_temporaries
        from trainloop.parallel.memory import QUANTIZED_BYTES, Line

        add, opt = plan.lines.append, cfg.optimizer
        n, t, t_shapes = shape.num_params, shape.num_trainable, shape.trainable_shapes
        grads_held = cfg.trainer.gradient_accumulation_steps > 1  # kept between micro-batches
        q = shape.quantized_params
        if q:
            q_bytes = QUANTIZED_BYTES[cfg.model.quantization]
            add(Line("quantized base weights", round(q_bytes * q), dev,
                     note=f"model.quantization={cfg.model.quantization}, {q_bytes:.3f} B/param, frozen"))
        adapters = t if shape.trainable is not None else 0  # adapters come on top of the base
        add(Line("parameters", 4 * (n - q + adapters), dev,
                 note="fp32" + (" (autocast computes in 16-bit)" if half else "")))
        add(Line("gradients", 4 * t, dev, None if grads_held else "optimizer step",
                 note="fp32" + ("" if grads_held else ", freed by zero_grad after each step")))
        states = planned_state_bytes(opt, t_shapes, shape.hidden_matrix)
        add(Line("optimizer states", states, dev, note=f"{opt.name}, {states / t:.2f} B/param"))
        add(Line("optimizer step temporaries",
                 planned_step_temporaries(opt, plan.device == "cuda", t_shapes, shape.hidden_matrix),
                 dev, "optimizer step", exact=False))
        if world_size > 1:
            add(Line("DDP gradient buckets", 4 * t, dev, exact=False,
                     note="DDP's flat all-reduce copies of the gradients"))

    @staticmethod
    def traffic_lines(plan, cfg, shape, world_size: int, half: bool) -> None:
        """One all-reduce of the fp32 gradients per optimizer step (no_sync on the other micro-batches)."""
        from trainloop.parallel.memory import Transfer, ring_bytes

        if world_size > 1:
            plan.traffic.append(Transfer("gradient all-reduce", ring_bytes("all-reduce", 4 * shape.num_trainable,
                                                                            world_size), "dp",
                                         note="fp32 gradients, once per step"))
