"""DeepSpeed ZeRO (deepspeed=zero1, zero2, zero3): optimizer state, then gradients, then parameters
partitioned over the ranks; accelerate builds the engine from trainloop.parallel.deepspeed_config's config."""

from __future__ import annotations

import warnings

from trainloop.parallel.base import Strategy, running
from trainloop.parallel.process_group import single_process_group_env, world_size_from_env

# DeepSpeed's stage3_max_reuse_distance, which trainloop leaves at DeepSpeed's default: a gathered
# parameter used again within this many elements is kept (partitioned_param_coordinator.py)
MAX_REUSE_DISTANCE = 1_000_000_000
NO_STAGE = ("deepspeed.config_file={file} is set but DeepSpeed is off (deepspeed.stage=0): choose deepspeed=zero1, "
            "zero2 or zero3 (or +preset=zero3)")


class DeepSpeedZeRO(Strategy):
    name = "zero"
    autocast = False  # DeepSpeed holds the model in the training precision
    off = {"deepspeed": "none", "deepspeed.offload_optimizer": "none", "deepspeed.offload_param": "none"}

    @staticmethod
    def chooses(cfg) -> bool:
        return cfg.deepspeed.stage > 0

    @staticmethod
    def shards_weights(cfg) -> bool:
        return cfg.deepspeed.stage == 3

    @staticmethod
    def forwards_together(cfg) -> str | None:
        return "DeepSpeed ZeRO-3" if cfg.deepspeed.stage == 3 else None

    @staticmethod
    def layouts(gpus_per_node: int) -> dict[str, dict]:
        stages = {f"ZeRO-{n}": {"deepspeed": f"zero{n}"} for n in (1, 2, 3)}
        offload = {f"{name} + optimizer offload": {**layout, "deepspeed.offload_optimizer": "cpu"}
                   for name, layout in stages.items()}
        return {**stages, **offload, "ZeRO-3 + optimizer and parameter offload": {
            "deepspeed": "zero3", "deepspeed.offload_optimizer": "cpu", "deepspeed.offload_param": "cpu"}}

    @staticmethod
    def settings(cfg) -> dict:
        ds = cfg.deepspeed
        return {"deepspeed.stage": ds.stage, "deepspeed.offload_optimizer": ds.offload_optimizer,
                "deepspeed.offload_param": ds.offload_param, "deepspeed.nvme_path": ds.nvme_path}

    @staticmethod
    def accelerator_arguments(cfg, on_cuda: bool) -> tuple[dict, dict]:
        from trainloop.parallel.deepspeed_config import build_deepspeed_plugin

        single_process_group_env()  # DeepSpeed needs a process group, even of one
        group = {}
        if not on_cuda:
            # without it accelerate computes world size 1 on CPU and DeepSpeed's batch check fails
            group["backend"] = "gloo"
            warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed.c10d_logger")
        return {"deepspeed_plugin": build_deepspeed_plugin(cfg, world_size_from_env(), on_cuda)}, group

    @staticmethod
    def accelerator_built(cfg) -> None:
        if cfg.deepspeed.stage == 3 and not cfg.deepspeed.zero3_init:
            # accelerate has told transformers that ZeRO-3 is on, so from_config would build the model
            # partitioned under zero.Init, drawing a different random init than a run without ZeRO-3
            from transformers.integrations import unset_hf_deepspeed_config

            unset_hf_deepspeed_config()

    def optimizer_offloaded(self) -> bool:
        return self.cfg.deepspeed.offload_optimizer != "none"

    def prepare_frozen(self, model):
        """A DeepSpeed engine without an optimizer, from the policy's own config (its auto values
        filled by the policy's prepare): under ZeRO-3 its parameters are partitioned over the ranks
        like the policy's and gathered layer by layer in its forward; under ZeRO-1/2 (stage 0 here)
        each rank holds it whole, in the training precision, as the policy computes."""
        import copy

        import deepspeed

        config = copy.deepcopy(self.accelerator.state.deepspeed_plugin.deepspeed_config)
        for training_only in ("optimizer", "scheduler"):
            config.pop(training_only, None)
        config["zero_optimization"].pop("offload_optimizer", None)
        if config["zero_optimization"]["stage"] != 3:
            config["zero_optimization"]["stage"] = 0
        engine, *_ = deepspeed.initialize(model=model, config=config)
        engine.eval()  # DeepSpeedEngine.eval returns None, not the engine
        return engine

    def save_state(self, directory, model, adapter_only: bool, record) -> None:
        if adapter_only:
            self.accelerator.save_state(str(directory), exclude_frozen_parameters=True)
        else:
            self.accelerator.save_state(str(directory))

    def load_state(self, path, model, adapter_only: bool) -> None:
        from trainloop.parallel.deepspeed_config import restore_cpu_adam_step_count

        if adapter_only:
            self.accelerator.load_state(str(path), load_module_strict=False)
        else:
            self.accelerator.load_state(str(path))
        restore_cpu_adam_step_count(self.accelerator._optimizers[0])  # bitwise resume under optimizer offload

    def backward(self, loss) -> None:
        self.accelerator.backward(loss)  # the engine's, which also steps after a step's last micro-batch

    def clip_grad_norm(self, model, max_norm: float):
        """The engine clips inside its step (gradient_clipping, trainloop.parallel.deepspeed_config); accelerate
        reads back its norm."""
        return self.accelerator.clip_grad_norm_(model.parameters(), max_norm)

    def full_state_dict(self, model) -> dict:
        """Under ZeRO-3 each rank holds a shard of every parameter, and accelerate's get_state_dict
        can return an empty dict on the main process (seen with accelerate 1.15 and DeepSpeed
        0.19 on 2 ranks) unless 16-bit gathering is on; so the parameters are gathered one at a
        time with DeepSpeed, which holds one whole tensor at once."""
        acc = self.accelerator
        if self.cfg.deepspeed.stage != 3:
            return acc.get_state_dict(model)
        import deepspeed

        unwrapped = acc.unwrap_model(model)
        state = {}
        for name, param in unwrapped.named_parameters():  # a tied weight comes once, under its first name
            with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
                if acc.is_main_process:
                    state[name] = param.detach().cpu().clone()
        if acc.is_main_process:  # buffers are not partitioned: take them as they are
            aliases = {name for name, _ in unwrapped.named_parameters(remove_duplicate=False)}
            state.update({k: v.detach().cpu().clone() for k, v in unwrapped.state_dict().items() if k not in aliases})
        return state

    def describe(self, model) -> str:
        """A DeepSpeed config that did not take (a launcher that started one process per replica, a
        plugin that was dropped) is an error here, not a quiet run without ZeRO."""
        kind = self.accelerator.distributed_type
        if not running(self.accelerator, model).startswith("zero"):
            raise RuntimeError(f"deepspeed.stage={self.cfg.deepspeed.stage} but accelerate runs {kind}: DeepSpeed "
                               "was not engaged")
        stage = model.zero_optimization_stage()
        if stage != self.cfg.deepspeed.stage:
            raise RuntimeError(f"DeepSpeed runs ZeRO stage {stage} but deepspeed.stage={self.cfg.deepspeed.stage}")
        devices = {part: getattr(section, "device", "none") for part, section in
                   (("optimizer", model.zero_offload_optimizer()), ("parameter", model.zero_offload_param()))}
        devices = {part: str(getattr(device, "value", device)) for part, device in devices.items()}  # enum or str
        offload = [f"{part} offload to {device}" for part, device in devices.items() if device != "none"]
        return f"DeepSpeed ZeRO-{stage} engaged{' with ' + ' and '.join(offload) if offload else ''} " \
               f"({kind}, {self.where()})"

    @staticmethod
    def memory_lines(plan, cfg, shape, world_size: int, dev: str, half: bool) -> None:
        """Stage 1 partitions the optimizer states (fp32 master + the optimizer's, K bytes per
        parameter) over the ranks, stage 2 also the gradients, stage 3 also the parameters; offload
        moves them to CPU or NVMe; the reduce buckets and ZeRO-3's gathered parameters and step
        temporaries are estimates (DeepSpeed 0.19's stage3.py and partitioned_param_coordinator.py,
        checked against scripts/bench_parallel.py)."""
        import math

        from trainloop.optim.optimizers import planned_state_bytes, planned_step_temporaries
        from trainloop.parallel.memory import Line

        add, opt, ds = plan.lines.append, cfg.optimizer, cfg.deepspeed
        stage, n, t = ds.stage, shape.num_params, shape.num_trainable
        pb = 2 if half else 4  # DeepSpeed holds the model in the training precision
        flat = [(t,)]  # ZeRO hands the optimizer one flat partition: nothing is factored
        k = 4 + planned_state_bytes(opt, flat) / t  # fp32 master + states
        part = lambda elements, on: math.ceil(elements / world_size) if on else elements  # noqa: E731
        p_where = {"none": dev, "cpu": "cpu", "nvme": "nvme"}[ds.offload_param]
        o_where = {"none": dev, "cpu": "cpu", "nvme": "nvme"}[ds.offload_optimizer]
        g_where = dev if ds.offload_optimizer == "none" else "cpu"  # ZeRO-Offload: gradients go to the CPU
        add(Line("parameters", pb * part(n, stage >= 3), p_where,
                 note=f"{pb} B/param" + (f", 1/{world_size} per rank (stage 3)" if stage >= 3 else "")))
        add(Line("gradients", pb * part(t, stage >= 2), g_where,
                 note=f"{pb} B/param" + (f", 1/{world_size} per rank (stage {stage})" if stage >= 2 else "")))
        add(Line("optimizer states", round(k * part(t, True)), o_where,
                 note=f"K={k:g} B/param (fp32 master + {opt.name}), 1/{world_size} per rank"))
        if ds.offload_optimizer != "none":  # DeepSpeed's CPU Adam steps this rank's partition
            plan.cpu_stepped_params = part(t, True)
        bucket = min(ds.reduce_bucket_size, t) * pb
        if stage < 3:
            copies = 2 if ds.overlap_comm and ds.contiguous_gradients else 1
            add(Line("reduce buckets", copies * bucket, dev, exact=False, note="deepspeed.reduce_bucket_size"))
        else:
            small = sum(math.prod(s) for s in shape.shapes if math.prod(s) < ds.stage3_param_persistence_threshold)
            # a parameter is released after its forward only if its backward (the blocks after it, twice)
            # is further than the reuse distance: the last blocks stay gathered, below 500M parameters all
            kept = min(n - small, MAX_REUSE_DISTANCE // 2 + shape.largest_layer_params)
            gathered = kept + small + min(ds.stage3_prefetch_bucket_size, n)
            add(Line("reduce bucket", bucket, dev, exact=False, note="deepspeed.reduce_bucket_size"))
            add(Line("gathered parameters", pb * gathered, dev, "forward/backward", exact=False,
                     note="those reused within DeepSpeed's stage3_max_reuse_distance + the prefetch bucket "
                          "+ persistent small parameters"))
            if ds.offload_optimizer == "none":  # the step flattens this rank's gradients into one fp32 tensor
                flat = [(part(t, True),)]
                add(Line("optimizer step temporaries", 4 * part(t, True) + planned_step_temporaries(
                    opt, plan.device == "cuda", flat), dev, "optimizer step", exact=False,
                         note=f"the fp32 gradient partition, and {opt.name}'s own on the flat partition"))

    @staticmethod
    def traffic_lines(plan, cfg, shape, world_size: int, half: bool) -> None:
        """The ZeRO paper's volumes in the training precision: stages 1 and 2 reduce-scatter the
        gradients and all-gather the updated parameters (stage 1 once per step, its gradients
        accumulated whole; stage 2 reduces every micro-batch's into its partition); stage 3
        all-gathers the parameters in each micro-batch's forward and backward and reduce-scatters
        its gradients. Offload adds PCIe copies: the gradient partition to the host and the updated
        one back (optimizer offload), every gathered partition from the host (parameter offload)."""
        import math

        from trainloop.parallel.memory import Transfer, ring_bytes

        ds, n, micro = cfg.deepspeed, world_size, cfg.trainer.gradient_accumulation_steps
        pb, N, t = (2 if half else 4), shape.num_params, shape.num_trainable
        add = plan.traffic.append
        reductions = 1 if ds.stage == 1 else micro
        if n > 1:
            add(Transfer("gradient reduce-scatter", reductions * ring_bytes("reduce-scatter", pb * t, n), "dp",
                         note=f"{pb} B/param, {'once per step' if reductions == 1 else 'every micro-batch'}"))
            if ds.stage == 3:
                add(Transfer("parameter all-gather", micro * 2 * ring_bytes("all-gather", pb * N, n), "dp",
                             note=f"{pb} B/param, forward and backward of every micro-batch"))
            else:
                add(Transfer("parameter all-gather", ring_bytes("all-gather", pb * t, n), "dp",
                             note=f"{pb} B/param, the updated partitions, once per step"))
        partition = math.ceil(t / n)
        if ds.offload_optimizer != "none":
            add(Transfer("gradients to the host", reductions * pb * partition, "pcie", note="this rank's partition"))
            add(Transfer("updated parameters to the device", pb * partition, "pcie", note="this rank's partition"))
        if ds.offload_param != "none":
            add(Transfer("parameters from the host", micro * 2 * pb * math.ceil(N / n), "pcie",
                         note="this rank's partition, before each all-gather (forward and backward)"))

    @staticmethod
    def keeps_world_size(cfg) -> str | None:
        return (f"under DeepSpeed ZeRO (deepspeed.stage={cfg.deepspeed.stage}) each rank saves its own partition of "
                "the optimizer state (and, at stage 3, of the parameters)")

    @staticmethod
    def problems(cfg) -> list[str]:
        from trainloop.optim.optimizers import OPTIMIZERS

        ds, opt, problems = cfg.deepspeed, OPTIMIZERS.get(cfg.optimizer.name), []
        if opt and ds.stage == 3 and not opt.zero3:
            library = f" ({opt.library})" if opt.library else ""
            problems.append(f"optimizer={cfg.optimizer.name}{library} cannot run under deepspeed stage 3: "
                            f"{opt.not_zero3_because}; use optimizer=adamw, or deepspeed={'zero2' if opt.zero else 'none'}")
        elif opt and ds.stage and not opt.zero:
            problems.append(f"optimizer={cfg.optimizer.name} cannot run under deepspeed=zero{ds.stage}: "
                            f"{opt.not_zero_because}; use optimizer=adamw, or deepspeed=none")
        if opt and ds.stage and ds.offload_optimizer != "none" and not opt.cpu_offload:
            problems.append(
                f"optimizer={cfg.optimizer.name} with deepspeed.offload_optimizer={ds.offload_optimizer}: "
                "the offloaded optimizer is DeepSpeed's CPU Adam; use optimizer=adamw"
            )
        if ds.config_file and not ds.stage:
            problems.append(NO_STAGE.format(file=ds.config_file))
        if ds.zero3_init and ds.stage != 3:
            problems.append(f"deepspeed.zero3_init=true needs deepspeed stage 3 (deepspeed.stage is {ds.stage})")
        if ds.offload_param != "none" and ds.stage != 3:
            problems.append(
                f"deepspeed.offload_param={ds.offload_param} needs deepspeed stage 3 "
                f"(deepspeed.stage is {ds.stage})"
            )
        if ds.offload_optimizer != "none" and ds.stage == 0:
            problems.append(
                f"deepspeed.offload_optimizer={ds.offload_optimizer} needs DeepSpeed: "
                "choose deepspeed=zero1, zero2 or zero3"
            )
        if "nvme" in (ds.offload_optimizer, ds.offload_param) and not ds.nvme_path:
            problems.append("deepspeed offload to nvme needs deepspeed.nvme_path=DIR on a fast local disk")
        if cfg.trainer.auto_batch_size and ds.stage:
            problems.append("trainer.auto_batch_size with DeepSpeed: ZeRO fixes the micro-batch in its engine; "
                            "set data.batch_size yourself, or deepspeed=none")
        if ds.stage and cfg.model.quantization != "none":
            problems.append(f"model.quantization={cfg.model.quantization} under DeepSpeed ZeRO-{ds.stage}: DeepSpeed "
                            "cannot partition or flatten bitsandbytes' packed weights; use DDP (torchrun) or one "
                            "process, or model.quantization=none")
        if (ds.stage or ds.config_file) and cfg.precision.name == "fp8":
            problems.append(f"precision=fp8 with deepspeed.stage={ds.stage}: DeepSpeed flattens the parameters and "
                            "runs its own bf16, not torchao's Float8Linear; use deepspeed=none (DDP or "
                            "fsdp=full_shard) or precision=bf16")
        if ds.stage and cfg.compile.backend != "none":
            problems.append(
                "compile.backend with DeepSpeed is not supported by trainloop yet: "
                "set compile=none, or deepspeed=none"
            )
        return problems
