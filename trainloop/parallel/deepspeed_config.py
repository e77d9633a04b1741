"""The DeepSpeed config, generated from the composed Hydra config (one source of truth).

Micro batch, accumulation, clipping and precision come from their own groups; the ZeRO stage,
offload and tuning knobs from `deepspeed.*`. A user's own JSON (`deepspeed.config_file`) is
merged in: what it adds is kept, what it contradicts stops the run before anything is built.
"""

from __future__ import annotations

import copy
import json
import logging
import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from trainloop.errors import ConfigError
from trainloop.parallel.process_group import environment_as_found

log = logging.getLogger("trainloop")


@dataclass
class DeepSpeedConfig:
    """The deepspeed.* keys (the ZeRO row, trainloop/parallel/zero.py), turned into DeepSpeed's JSON below."""

    stage: int = 0  # 0: DeepSpeed off; 1, 2, 3: ZeRO stage
    offload_optimizer: str = "none"  # none, cpu, nvme
    offload_param: str = "none"  # none, cpu, nvme (stage 3 only)
    nvme_path: Optional[str] = None  # the folder for nvme offload, on a fast local disk
    overlap_comm: bool = True  # overlap the gradient reduction with the backward pass
    contiguous_gradients: bool = True  # copy gradients into one buffer as they come: less fragmentation
    reduce_bucket_size: int = 500_000_000  # elements reduced at once; smaller: less memory, more messages
    allgather_bucket_size: int = 500_000_000  # elements gathered at once (stages 1 and 2)
    stage3_prefetch_bucket_size: int = 50_000_000  # stage 3: parameter elements fetched ahead of their use
    stage3_param_persistence_threshold: int = 100_000  # stage 3: smaller parameters stay whole on every rank
    gather_16bit_weights_on_model_save: bool = True  # stage 3: accelerate's save_model may gather 16-bit weights
    zero3_init: bool = False  # stage 3: build the model partitioned (zero.Init), never whole; changes a random init
    config_file: Optional[str] = None  # a user's DeepSpeed JSON, checked against this config


AUTO = "auto"
DEFAULTS = DeepSpeedConfig()
TUNING = ("overlap_comm", "contiguous_gradients", "reduce_bucket_size", "allgather_bucket_size",
          "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold")
INSTALL_LIBAIO = ("install libaio and run again: `apt-get install libaio-dev` (Debian/Ubuntu, as root), "
                  "`dnf install libaio-devel` (Fedora/RHEL) or `conda install -c conda-forge libaio`; "
                  "scripts/setup.sh installs it when run as root on Debian/Ubuntu")
# builder class -> (what the run uses it for, how long its first build took on a 2-core CPU machine)
OPS = {"ShareMemCommBuilder": ("collectives between CPU processes", "about a minute"),
       "CPUAdamBuilder": ("the CPU Adam of optimizer offload", "about a minute"),
       "AsyncIOBuilder": ("NVMe offload's async I/O", "up to 10 minutes")}


def owned_values(cfg, world_size: int, on_cuda: bool) -> dict[str, tuple[object, str]]:
    """DeepSpeed keys the Hydra config decides: dotted JSON key -> (value, the Hydra key it comes from)."""
    ds, tc = cfg.deepspeed, cfg.trainer
    batch, accumulation = cfg.data.batch_size, tc.gradient_accumulation_steps
    owned = {
        "train_micro_batch_size_per_gpu": (batch, "data.batch_size"),
        "gradient_accumulation_steps": (accumulation, "trainer.gradient_accumulation_steps"),
        "train_batch_size": (batch * accumulation * world_size,
                             f"data.batch_size x trainer.gradient_accumulation_steps x {world_size} processes"),
        "gradient_clipping": (tc.max_grad_norm or 0.0, "trainer.max_grad_norm"),
        "bf16.enabled": (cfg.precision.name == "bf16", "precision"),
        "fp16.enabled": (cfg.precision.name == "fp16", "precision"),
        "zero_optimization.stage": (ds.stage, "deepspeed.stage"),
    }
    for part, device in (("optimizer", ds.offload_optimizer), ("param", ds.offload_param)):
        owned[f"zero_optimization.offload_{part}.device"] = (device, f"deepspeed.offload_{part}")
        if device == "nvme":
            owned[f"zero_optimization.offload_{part}.nvme_path"] = (
                str(Path(ds.nvme_path).expanduser().resolve()), "deepspeed.nvme_path")
    return owned


def tuning_values(cfg, on_cuda: bool) -> dict[str, object]:
    """The other zero_optimization settings: trainloop's defaults, which a user's file may change."""
    ds = cfg.deepspeed
    zero = {key: ds[key] for key in TUNING if ds.stage == 3 or not key.startswith("stage3_")}
    if ds.stage == 3:
        zero["stage3_gather_16bit_weights_on_model_save"] = ds.gather_16bit_weights_on_model_save
    for part, device in (("optimizer", ds.offload_optimizer), ("param", ds.offload_param)):
        if device != "none":  # pinned host memory only speeds up copies to a GPU
            zero[f"offload_{part}.pin_memory"] = on_cuda
    return zero


def deepspeed_config(cfg, world_size: int, on_cuda: bool = False) -> dict:
    """DeepSpeed's JSON for this run: the user's file (if any) merged with the Hydra config."""
    owned = owned_values(cfg, world_size, on_cuda)
    user = load_config_file(cfg.deepspeed.config_file)
    config = copy.deepcopy(user)
    contradictions = []
    for key, (value, source) in owned.items():
        theirs = _lookup(config, key)
        if theirs is None or theirs == AUTO:
            _assign(config, key, value)
        elif not _same(theirs, value):
            contradictions.append(f"{key}={theirs!r} in the file, but {source} gives {value!r}"
                                  + _batch_hint(key, theirs, cfg, world_size))
    for key, value in tuning_values(cfg, on_cuda).items():
        hydra_key = "gather_16bit_weights_on_model_save" if key.endswith("_on_model_save") else key
        theirs = _lookup(config, f"zero_optimization.{key}")
        if theirs is None or theirs == AUTO:
            _assign(config, f"zero_optimization.{key}", value)
        elif not _same(theirs, value) and value != getattr(DEFAULTS, hydra_key, value):
            # a knob left at trainloop's default yields to the file; one set on purpose must agree
            contradictions.append(f"zero_optimization.{key}={theirs!r} in the file, but "
                                  f"deepspeed.{hydra_key}={value!r}")
    for section, group in (("optimizer", "optimizer"), ("scheduler", "scheduler")):
        if section in user:
            contradictions.append(f"the file has an {section!r} section, but trainloop builds the {section} "
                                  f"from {group}=...: remove the section and set {group}.* instead")
    if contradictions:
        raise ConfigError(f"deepspeed.config_file={cfg.deepspeed.config_file} contradicts the config:\n  "
                          + "\n  ".join(contradictions)
                          + "\nchange the file or the Hydra keys named so that they agree (or drop the key "
                          "from the file, or set it to \"auto\")")
    # trainloop builds the optimizer itself (DeepSpeed's CPU Adam under offload, trainloop/optim/optimizers.py);
    # left at true, accelerate would swap it for a CPU Adam of its own making with adamw_mode off.
    config["zero_force_ds_cpu_optimizer"] = False
    config.setdefault("zero_allow_untested_optimizer", True)
    config.setdefault("steps_per_print", 10**9)
    config.setdefault("wall_clock_breakdown", False)
    return config


def _batch_hint(key: str, theirs, cfg, world_size: int) -> str:
    if key != "train_batch_size" or not isinstance(theirs, int):
        return ""
    per_step = cfg.data.batch_size * world_size
    if theirs % per_step:
        return (f" ({theirs} is not divisible by data.batch_size={cfg.data.batch_size} x {world_size} "
                "processes: change the batch, the file, or the number of processes)")
    return f" (with {world_size} processes, trainer.gradient_accumulation_steps={theirs // per_step} gives it)"


def load_config_file(path: str | None) -> dict:
    if path is None:
        return {}
    file = Path(path).expanduser()
    try:
        config = json.loads(file.read_text())
    except OSError as err:
        raise ConfigError(f"deepspeed.config_file={path}: cannot read it ({err.strerror})") from None
    except json.JSONDecodeError as err:
        raise ConfigError(f"deepspeed.config_file={path} is not valid JSON: {err}") from None
    if not isinstance(config, dict):
        raise ConfigError(f"deepspeed.config_file={path} must hold a JSON object")
    return config


def _lookup(config: dict, dotted: str):
    node = config
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _assign(config: dict, dotted: str, value) -> None:
    *parents, last = dotted.split(".")
    node = config
    for part in parents:
        node = node.setdefault(part, {})
    node[last] = value


def _same(a, b) -> bool:
    if isinstance(a, str) and isinstance(b, str) and "/" in a + b:  # paths
        return Path(a).expanduser().resolve() == Path(b).expanduser().resolve()
    if isinstance(a, str) and isinstance(b, str):
        return a.lower() == b.lower()
    return a == b


def require_deepspeed(cfg) -> None:
    try:
        import deepspeed  # noqa: F401
    except ImportError as err:
        raise ConfigError(f"deepspeed.stage={cfg.deepspeed.stage} needs DeepSpeed, which cannot be imported "
                          f"here ({err}): pip install deepspeed, or set deepspeed=none") from None


def require_async_io(cfg) -> None:
    """NVMe offload swaps through DeepSpeed's async I/O op, which needs libaio to build."""
    ds = cfg.deepspeed
    if "nvme" not in (ds.offload_optimizer, ds.offload_param):
        return
    check_nvme_path(ds.nvme_path)
    from deepspeed.ops.op_builder import AsyncIOBuilder

    if not AsyncIOBuilder().is_compatible():
        raise ConfigError("deepspeed offload to nvme needs DeepSpeed's async I/O, which cannot be built "
                          f"here: libaio (headers and library) was not found; {INSTALL_LIBAIO}")


def check_nvme_path(nvme_path: str) -> None:
    """DeepSpeed creates its swap files under nvme_path deep inside engine setup: a folder it cannot
    write to would surface there as a long traceback from every rank."""
    import tempfile

    path = Path(nvme_path).expanduser()
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):  # permissions alone miss read-only mounts (and root)
            pass
    except OSError as err:
        problem = "cannot create it" if not path.is_dir() else "cannot write files in it"
        raise ConfigError(f"deepspeed.nvme_path={nvme_path}: {problem} ({err.strerror}); DeepSpeed "
                          "swaps the optimizer state and parameters to files there: choose a writable "
                          "folder on a fast local disk") from None


def build_deepspeed_plugin(cfg, world_size: int, on_cuda: bool):
    """accelerate's DeepSpeedPlugin around the generated JSON; checks what DeepSpeed needs first."""
    require_deepspeed(cfg)
    logging.getLogger("compilers").setLevel(logging.WARNING)  # DeepSpeed's libaio probe logs each gcc call
    require_async_io(cfg)
    announce_op_builds(cfg, on_cuda)
    from accelerate.utils import DeepSpeedPlugin

    config = deepspeed_config(cfg, world_size, on_cuda)
    return DeepSpeedPlugin(hf_ds_config=config, zero3_init_flag=cfg.deepspeed.stage == 3 and cfg.deepspeed.zero3_init)


def ops_for(cfg, on_cuda: bool) -> list[str]:
    """The DeepSpeed op builders this run will load (a JIT build each, the first time)."""
    ds = cfg.deepspeed
    names = [] if on_cuda else ["ShareMemCommBuilder"]
    if ds.offload_optimizer != "none":
        names.append("CPUAdamBuilder")  # trainloop/optim/optimizers.py builds DeepSpeedCPUAdam under offload
    if "nvme" in (ds.offload_optimizer, ds.offload_param):
        names.append("AsyncIOBuilder")
    return names


def _builder(name: str):
    from deepspeed.accelerator import get_accelerator
    from deepspeed.ops.op_builder import AsyncIOBuilder

    # DeepSpeed's swapper loads the generic AsyncIOBuilder; the others come from the accelerator
    return AsyncIOBuilder() if name == "AsyncIOBuilder" else get_accelerator().create_op_builder(name)


def pending_build(builder) -> Path | None:
    """The op's build folder if loading it will compile (nothing built there yet, or sources newer)."""
    from deepspeed.git_version_info import installed_ops
    from torch.utils.cpp_extension import _get_build_directory

    if builder is None or installed_ops.get(builder.name) or not builder.is_compatible():
        return None  # prebuilt at install (DS_BUILD_OPS=1), or DeepSpeed will not load it here
    folder = Path(_get_build_directory(builder.name, verbose=False))
    library = folder / f"{builder.name}.so"
    if not library.exists():
        return folder
    sources = [Path(builder.deepspeed_src_path(s)) for s in builder.strip_empty_entries(builder.sources())]
    built_at = library.stat().st_mtime
    return folder if any(s.exists() and s.stat().st_mtime > built_at for s in sources) else None


def announce_op_builds(cfg, on_cuda: bool) -> None:
    """Say which one-time compile is about to run, and where it is cached: otherwise the run is
    silent for a minute (CPU Adam) to ten (async I/O) on a small machine."""
    if int(os.environ.get("LOCAL_RANK", "0")) != 0:
        return  # each machine builds once: the other local ranks wait for the same lock
    for name in ops_for(cfg, on_cuda):
        builder = _builder(name)
        folder = pending_build(builder)
        if folder is None:
            continue
        purpose, duration = OPS[name]
        log.info("DeepSpeed compiles its %s op (%s) in this run: one time only, %s on a small machine; cached in %s "
                 "for later runs (`python -m trainloop.deepspeed` builds DeepSpeed's ops ahead of a run)",
                 builder.name, purpose, duration, folder)
        if (folder / "lock").exists():
            log.info("another process is building %s already: waiting for its lock %s (if no build is running, "
                     "the lock is stale: delete it)", builder.name, folder / "lock")


def restore_cpu_adam_step_count(optimizer) -> None:
    """After a resume, bring DeepSpeed's CPU Adam to where the uninterrupted run's would be.

    Its C++ side keeps beta^t for the bias correction, multiplied up one step at a time; a fresh
    one that is handed step t+1 computes pow(beta, t+1) instead, which differs in the last bit
    (0.95 from step 6 on, in fp32) and moved ZeRO-3 offload's weights by 1.2e-7 relative. Replaying
    steps 1..t on empty tensors builds the same product, so a resume stays bitwise.
    """
    import sys

    if "deepspeed" not in sys.modules:  # no DeepSpeed in this run, so no CPU Adam
        return
    import torch
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    cpu_adam = optimizer
    for _ in range(4):  # accelerate's wrapper -> DeepSpeed's ZeRO optimizer -> the CPU Adam
        if isinstance(cpu_adam, DeepSpeedCPUAdam) or cpu_adam is None:
            break
        cpu_adam = getattr(cpu_adam, "optimizer", None)
    if not isinstance(cpu_adam, DeepSpeedCPUAdam):
        return
    steps = max((int(state["step"]) for state in cpu_adam.state.values() if "step" in state), default=0)
    empty = torch.empty(0)
    for step in range(1, steps + 1):
        for group in cpu_adam.param_groups:  # in the order its step() visits them
            beta1, beta2 = group["betas"]
            cpu_adam.ds_opt_adam.adam_update(cpu_adam.opt_id, step, group["lr"], beta1, beta2, group["eps"],
                                             group["weight_decay"], group["bias_correction"],
                                             empty, empty, empty, empty)


@contextmanager
def compiler_cache():
    """Compile through ccache where it is installed: torch's JIT build runs `c++` (its CXX), here a link
    to ccache, which finds the real compiler after it on PATH. Paths under the venv are hashed relative
    to the build folder (CCACHE_BASEDIR) and the folder itself not at all (CCACHE_NOHASHDIR), so a new
    venv (a clean clone's) reuses the objects another venv compiled from the same sources, flags and
    headers: minutes of compiler on a small machine, seconds then. The environment comes back after."""
    import shutil
    import sys
    import tempfile

    ccache = shutil.which("ccache")
    if ccache is None or "CXX" in os.environ:  # not installed, or the user chose the compiler
        yield
        return
    with tempfile.TemporaryDirectory(prefix="trainloop-ccache-") as masquerade, \
            environment_as_found("PATH", "CCACHE_BASEDIR", "CCACHE_NOHASHDIR"):
        (Path(masquerade) / "c++").symlink_to(ccache)
        os.environ["PATH"] = f"{masquerade}{os.pathsep}{os.environ.get('PATH', '')}"
        os.environ.setdefault("CCACHE_BASEDIR", sys.prefix)
        os.environ.setdefault("CCACHE_NOHASHDIR", "1")
        yield


def build_ops() -> list[str]:
    """JIT-build (or load from ~/.cache/torch_extensions) the DeepSpeed ops trainloop runs with,
    through ccache where it is installed (compiler_cache).

    The first build takes minutes on a small CPU machine; scripts/setup.sh and the tests call
    this once so that no training process waits for a compiler.
    """
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.accelerator import get_accelerator
    from deepspeed.ops.op_builder import AsyncIOBuilder

    names = ["CPUAdamBuilder"]
    if get_accelerator().device_name() == "cpu":
        names.append("ShareMemCommBuilder")  # DeepSpeed's collectives on CPU ranks
    built = []
    with compiler_cache():
        for name in names:
            get_accelerator().create_op_builder(name).load(verbose=False)
            built.append(name)
        if AsyncIOBuilder().is_compatible():
            AsyncIOBuilder().load(verbose=False)
            built.append("AsyncIOBuilder")
    return built
