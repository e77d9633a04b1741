"""The Accelerator, built from the composed config, and the run directory every rank agrees on.

On a machine without a GPU and with WORLD_SIZE > 1, a plain `Accelerator()` reports
DistributedType.NO in every process and each trains alone, unsynchronised (seen with accelerate
1.15 under torchrun and `accelerate launch --multi_gpu` on CPU); trainloop picks the CPU path
(gloo) itself instead.
Without a launcher, a DeepSpeed run is a 1-process group on loopback that trainloop describes
itself. DeepSpeed is configured from the config alone (trainloop/parallel/deepspeed_config.py): launcher flags that
say otherwise stop the run, and the log states the ZeRO stage the engine really runs.
"""

from __future__ import annotations

import io
import logging
import os
import sys
from contextlib import contextmanager, redirect_stdout
from datetime import timedelta
from pathlib import Path

import torch
from omegaconf import OmegaConf

from trainloop.errors import ConfigError
from trainloop.parallel.process_group import MPI_SIZE_VARS, environment_as_found, world_size_from_env
from trainloop.parallel.zero import NO_STAGE

log = logging.getLogger("trainloop")

# precision group -> accelerate's mixed_precision. fp8 is bf16 autocast to accelerate: trainloop swaps
# the float8 layers itself (trainloop.model.fp8 says why not through accelerate's "fp8").
MIXED_PRECISION = {"fp32": "no", "bf16": "bf16", "fp16": "fp16", "fp8": "bf16"}


def _asked_processes() -> str:
    """The N of `--num_processes N` on the parent's (accelerate launch's) command line, if readable."""
    try:
        command = Path(f"/proc/{os.getppid()}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:  # not Linux, or the parent is gone
        return "N"
    for i, arg in enumerate(command):
        name, eq, value = arg.partition("=")
        if name in ("--num_processes", "--num-processes"):
            value = value if eq else (command[i + 1] if i + 1 < len(command) else "")
            return value if value.isdigit() else "N"
    return "N"


def check_single_process_accelerate_launch(env: dict[str, str]) -> None:
    """`accelerate launch --num_processes N` without --multi_gpu starts ONE process where there
    are not N GPUs (seen with accelerate 1.15 on a CPU machine). Its single-process launcher exports ACCELERATE_USE_CPU
    always, and MASTER_ADDR only when asked for several processes, but never RANK or WORLD_SIZE."""
    started_alone = "ACCELERATE_USE_CPU" in env and "MASTER_ADDR" in env and "WORLD_SIZE" not in env
    if not started_alone or any(k in env for k in MPI_SIZE_VARS):  # mpirun
        return
    n = _asked_processes()
    raise ConfigError(
        f"`accelerate launch --num_processes {n}` started one process, not {n}: without --multi_gpu "
        f"(and with fewer than {n} GPUs) it runs the script once, with no RANK or WORLD_SIZE. "
        f"For {n} processes type `accelerate launch --multi_gpu --num_processes {n} -m trainloop ...` "
        f"(on CPU too) or `torchrun --nproc_per_node {n} -m trainloop ...`; for one process, "
        "`python -m trainloop ...`")


def check_device_support(cfg, on_cuda: bool) -> None:
    """Refuse precisions the hardware cannot run, before anything is built."""
    from trainloop.model import fp8

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
    fp8.check_device(cfg, on_cuda)
    if cfg.compile.backend == "cudagraphs" and not on_cuda:
        raise ConfigError("compile=cudagraphs records CUDA graphs and needs a CUDA GPU; "
                          "on this machine use compile=inductor (or aot_eager to debug)")


# launcher flag (as accelerate launch sets it in the environment) -> (trainloop key, the flag)
LAUNCHER_ENV = {
    "ACCELERATE_DEEPSPEED_ZERO_STAGE": ("deepspeed.stage", "--zero_stage"),
    "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": ("deepspeed.offload_optimizer", "--offload_optimizer_device"),
    "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE": ("deepspeed.offload_param", "--offload_param_device"),
    "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_NVME_PATH": ("deepspeed.nvme_path", "offload_optimizer_nvme_path"),
    "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_NVME_PATH": ("deepspeed.nvme_path", "offload_param_nvme_path"),
    "ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL": ("deepspeed.gather_16bit_weights_on_model_save",
                                                    "--zero3_save_16bit_model"),
    "ACCELERATE_DEEPSPEED_ZERO3_INIT": ("deepspeed.zero3_init", "--zero3_init_flag"),
    "ACCELERATE_GRADIENT_ACCUMULATION_STEPS": ("trainer.gradient_accumulation_steps", "--gradient_accumulation_steps"),
    "ACCELERATE_GRADIENT_CLIPPING": ("trainer.max_grad_norm", "--gradient_clipping"),
}


def _launcher_value_agrees(key: str, launcher: str, ours) -> bool:
    if key == "deepspeed.nvme_path":
        return ours is not None and Path(launcher).resolve() == Path(ours).expanduser().resolve()
    if key == "trainer.max_grad_norm":
        return float(launcher) == float(ours or 0.0)
    return launcher.lower() == str(ours).lower()


def check_launcher_env(cfg, env: dict[str, str]) -> None:
    """`accelerate launch`'s own DeepSpeed and precision flags must agree with the config.

    trainloop generates every DeepSpeed setting from the config; a launcher flag that says
    otherwise would be ignored silently, so it stops the run instead. A launcher's DeepSpeed
    config file is taken as deepspeed.config_file (and checked like one).
    """
    ds = cfg.deepspeed
    problems = []
    if env.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true" and not ds.stage:
        problems.append("the launcher enables DeepSpeed (accelerate launch --use_deepspeed, "
                        "ACCELERATE_USE_DEEPSPEED=true) but deepspeed.stage=0: add deepspeed=zero1/zero2/zero3 "
                        "(or +preset=zero3), or launch without --use_deepspeed")
    if env.get("ACCELERATE_USE_FSDP", "false").lower() == "true":
        # accelerate's FSDP would wrap the model a second time on GPUs and not at all on CPU
        problems.append("the launcher enables accelerate's FSDP (accelerate launch --use_fsdp, "
                        "ACCELERATE_USE_FSDP=true); trainloop applies FSDP2 itself: launch without --use_fsdp"
                        + ("" if cfg.fsdp.name != "none" else " and add +preset=fsdp (fsdp=full_shard)"))
    for name, (key, flag) in LAUNCHER_ENV.items():
        value = env.get(name)
        if value is None or (key == "deepspeed.nvme_path" and value.lower() == "none"):
            continue
        if key.startswith("deepspeed.") and not ds.stage:
            continue  # reported above, when the launcher turned DeepSpeed on
        if key in ("deepspeed.gather_16bit_weights_on_model_save", "deepspeed.zero3_init") and ds.stage != 3:
            continue  # a ZeRO-3 setting
        ours = OmegaConf.select(cfg, key)
        if not _launcher_value_agrees(key, value, ours):
            problems.append(f"the launcher sets {flag} {value} ({name}={value}) but the config has {key}={ours}")
    launcher_precision = env.get("ACCELERATE_MIXED_PRECISION", "no").lower()
    # `accelerate launch` always exports "no" when not told otherwise: only a precision it was
    # given on purpose can contradict the precision group.
    agrees = "fp8" if cfg.precision.name == "fp8" else MIXED_PRECISION[cfg.precision.name]
    if launcher_precision not in ("no", agrees):
        problems.append(f"the launcher sets --mixed_precision {launcher_precision} (ACCELERATE_MIXED_PRECISION) "
                        f"but the config has precision={cfg.precision.name}")
    launcher_file = env.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
    if launcher_file and launcher_file.lower() != "none":
        if not ds.stage:
            if env.get("ACCELERATE_USE_DEEPSPEED", "false").lower() != "true":  # else said above
                problems.append(NO_STAGE.format(file=launcher_file) + " (the launcher's --deepspeed_config_file)")
        elif ds.config_file is None:
            ds.config_file = launcher_file
        elif Path(ds.config_file).expanduser().resolve() != Path(launcher_file).expanduser().resolve():
            problems.append(f"the launcher sets --deepspeed_config_file {launcher_file} but the config has "
                            f"deepspeed.config_file={ds.config_file}")
    if problems:
        raise ConfigError("the launcher and the config disagree:\n  " + "\n  ".join(problems)
                          + "\ntrainloop takes these settings from its config only: drop the launcher flags "
                          "(or the ACCELERATE_* variables), or change the config keys named to match")


@contextmanager
def _accelerate_env_for_plugin():
    """Let accelerate take trainloop's DeepSpeed JSON, then leave the environment as it was.

    After check_launcher_env, DeepSpeed fields that an accelerate config file named agree with
    the JSON, so accelerate's refusal to mix the two is moot; and the ACCELERATE_USE_DEEPSPEED
    it exports must not leak into a later run in the same process (sweeps, tests).
    """
    with environment_as_found("ACCELERATE_CONFIG_DS_FIELDS", "ACCELERATE_USE_DEEPSPEED"):
        os.environ.pop("ACCELERATE_CONFIG_DS_FIELDS", None)
        yield


def _is_op_load_notice(line: str) -> bool:
    return line.startswith("DeepSpeed ") and line.rstrip().endswith(" built successfully")


@contextmanager
def _without_op_load_notices():
    """DeepSpeed prints `DeepSpeed <op> built successfully` from every rank each time it loads its
    CPU collectives op, built or not; trainloop says once when a build really runs. Other output passes."""
    captured = io.StringIO()
    try:
        with redirect_stdout(captured):
            yield
    finally:
        lines = captured.getvalue().splitlines(keepends=True)
        sys.stdout.write("".join(line for line in lines if not _is_op_load_notice(line)))


def unused_parameters(cfg) -> list:
    """DDP's kwargs for a vision-language model (a data format whose rows carry images): a VLM's forward leaves
    parameters unused (LLaVA's vision tower past its feature layer, its post-norm), whose gradients DDP would wait
    for forever, so DDP looks for them each step (find_unused_parameters, the HF Trainer's default too); [] else."""
    from accelerate.utils import DistributedDataParallelKwargs

    from trainloop.data.formats import FORMATS

    fmt = FORMATS.get(cfg.data.name)
    return [DistributedDataParallelKwargs(find_unused_parameters=True)] if fmt is not None and fmt.images else []


def build_accelerator(cfg):
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import DataLoaderConfiguration, GradientAccumulationPlugin, InitProcessGroupKwargs

    from trainloop.parallel import row  # the strategy the config chooses: its Accelerator arguments

    on_cuda = torch.cuda.is_available()
    check_device_support(cfg, on_cuda)
    check_launcher_env(cfg, dict(os.environ))
    check_single_process_accelerate_launch(dict(os.environ))
    if cfg.precision.tf32 and on_cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

    if not on_cuda:
        # accelerate's unwrap_model (export, samples) imports DeepSpeed whenever it is installed,
        # used or not; on a CPU DeepSpeed's own detection picks the same, with a banner.
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    strategy = row(cfg)
    # accelerate keeps process-wide singletons: a run before this one in this process (a notebook's, a sweep's
    # job) would otherwise lend its precision or DeepSpeed plugin to this Accelerator, or have it refused
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    with _accelerate_env_for_plugin(), _without_op_load_notices():
        kwargs, group = strategy.accelerator_arguments(cfg, on_cuda)
        group = {"timeout": timedelta(seconds=cfg.trainer.collective_timeout_s), **group}
        process_group = InitProcessGroupKwargs(**group)
        # its to_kwargs drops a value equal to the class default (600 s, for nccl): always pass ours
        process_group.to_kwargs = lambda: dict(group)
        accelerator = Accelerator(
            mixed_precision=MIXED_PRECISION[cfg.precision.name],
            gradient_accumulation_plugin=GradientAccumulationPlugin(
                num_steps=cfg.trainer.gradient_accumulation_steps, sync_with_dataloader=True),
            # both loaders' orders are trainloop.data.order's: accelerate prepares neither
            dataloader_config=DataLoaderConfiguration(non_blocking=on_cuda),
            # the process group's timeout (accelerate hands it to DeepSpeed's init too); data is
            # built outside any collective (trainloop.data.node_turns), so this bounds training collectives
            kwargs_handlers=[process_group, *unused_parameters(cfg)],
            **kwargs,
        )
    strategy.accelerator_built(cfg)
    expected = world_size_from_env()
    if accelerator.num_processes != expected:
        raise ConfigError(
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
