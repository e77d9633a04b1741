"""`python -m trainloop.doctor [--json] [overrides]`: the machine as a training run will see it.

Library versions (and which DeepSpeed ops can build), every GPU (memory, compute capability,
bf16/TF32, power, temperature, clocks, throttling), how the GPUs are linked, CPU, RAM, free disk
and async I/O at deepspeed.nvme_path; then warnings in plain words. The overrides are those of
a run (e.g. `+preset=zero3 deepspeed.nvme_path=/local/nvme`): they say what to check against.
Every part is read on its own: a missing library or GPU is reported, never fatal.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import os
import platform
import sys

from trainloop.config.compose import compose_config
from trainloop.observe import hardware
from trainloop.parallel import chosen, row


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def torch_facts() -> dict:
    try:
        import torch
    except ImportError as err:
        return {"version": None, "error": str(err)}
    facts = {"version": torch.__version__, "cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
             "cudnn": None, "nccl": None, "hip": getattr(torch.version, "hip", None)}
    try:
        facts["cudnn"] = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    except Exception:
        pass
    if torch.cuda.is_available() and torch.distributed.is_nccl_available():
        try:
            facts["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:
            pass
    return facts


def deepspeed_facts(gpu_present: bool) -> dict:
    """DeepSpeed's version and, per op, whether it is prebuilt, JIT-cached, and able to build."""
    version = _version("deepspeed")
    if version is None:
        return {"version": None, "error": "not installed (pip install deepspeed)"}
    if not gpu_present:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # else importing it warns about CUDA
    try:
        with contextlib.redirect_stdout(sys.stderr):  # its import and probes print
            from deepspeed.accelerator import get_accelerator
            from deepspeed.git_version_info import installed_ops
            from deepspeed.ops.op_builder.all_ops import ALL_OPS
            from torch.utils.cpp_extension import _get_build_directory

            ops = {}
            for name, builder in ALL_OPS.items():
                if name == "deepspeed_not_implemented":  # a placeholder, not an op
                    continue
                try:
                    compatible = bool(builder.is_compatible(False))
                except Exception:
                    compatible = False
                try:
                    jit_dir = _get_build_directory(builder.name, verbose=False)
                    jit_built = any(f.endswith(".so") for f in os.listdir(jit_dir))
                except Exception:
                    jit_built = False
                ops[name] = {"compatible": compatible, "prebuilt": bool(installed_ops.get(name)),
                             "jit_built": jit_built}
            accelerator = get_accelerator()._name
    except Exception as err:
        return {"version": version, "error": f"import failed: {type(err).__name__}: {err}"}
    return {"version": version, "accelerator": accelerator, "ops": ops}


def bitsandbytes_facts() -> dict:
    version = _version("bitsandbytes")
    if version is None:
        return {"version": None, "error": "not installed (pip install bitsandbytes)"}
    try:
        with contextlib.redirect_stdout(sys.stderr):
            from bitsandbytes import cextension
    except Exception as err:
        return {"version": version, "error": f"import failed: {type(err).__name__}: {err}"}
    mock = getattr(cextension, "ErrorHandlerMockBNBNativeLibrary", None)
    native = mock is None or not isinstance(cextension.lib, mock)
    return {"version": version, "backend": getattr(cextension, "BNB_BACKEND", None), "native_library": native}


def async_io_facts(nvme_path: str | None, deepspeed: dict) -> dict:
    op = deepspeed.get("ops", {}).get("async_io", {})
    facts = {"nvme_path": nvme_path, "deepspeed_async_io_op": op.get("compatible"),
             "prebuilt": op.get("prebuilt"), "jit_built": op.get("jit_built")}
    if nvme_path:
        facts["disk"] = hardware.disk_facts(nvme_path)
        facts["direct_io"], facts["direct_io_detail"] = hardware.direct_io_works(nvme_path)
    return facts


def examine(overrides: list[str]) -> dict:
    """Everything the doctor reports, as plain data."""
    cfg = compose_config(overrides)
    gpus = hardware.read_gpus()
    facts = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "versions": {
            "torch": torch_facts(),
            **{name: _version(name) for name in ("accelerate", "transformers", "datasets", "hydra-core",
                                                  "nvidia-ml-py", "flash-attn", "torchao")},
            "deepspeed": deepspeed_facts(bool(gpus.gpus)),
            "bitsandbytes": bitsandbytes_facts(),
        },
        "gpu": gpus.to_dict(),
        "host": hardware.host_facts({"run dir (cwd)": os.getcwd()}),
        # the chosen strategy's own keys (trainloop.parallel: Strategy.settings)
        "config": {"strategy": chosen(cfg), **row(cfg).settings(cfg), "precision": cfg.precision.name},
    }
    facts["async_io"] = async_io_facts(facts["config"].get("deepspeed.nvme_path"), facts["versions"]["deepspeed"])
    facts["warnings"] = warnings(facts, gpus, cfg)
    return facts


def warnings(facts: dict, gpus: hardware.GpuReport, cfg) -> list[str]:
    found, chose = [], facts["config"]
    zero_stage = chose.get("deepspeed.stage", 0)
    for gpu in gpus.gpus:
        found += hardware.gpu_warnings(gpu)
    if gpus.topology is not None:
        found += hardware.topology_warnings(gpus.topology, zero_stage)
    elif len(gpus.gpus) > 1 and zero_stage:
        found.append("the GPU interconnect could not be read (no nvidia-smi, no NVML): check "
                     "`nvidia-smi topo -m` before running ZeRO across these GPUs")
    if cfg.precision.name == "bf16" and gpus.gpus and any(g.bf16 is False for g in gpus.gpus):
        found.append("precision=bf16 is chosen, but some GPU has no bf16 (compute capability "
                     "below 8.0): use precision=fp16")
    old_gpus = [g for g in gpus.gpus if g.compute_capability is not None and tuple(g.compute_capability) < (8, 9)]
    if cfg.precision.name == "fp8" and old_gpus and not cfg.precision.fp8_emulate:
        found.append("precision=fp8 is chosen, but some GPU has no float8 matmuls (compute capability below "
                     "8.9): use precision=bf16, or precision.fp8_emulate=true for the numerics only")
    io = facts["async_io"]
    if "nvme" in (chose.get("deepspeed.offload_optimizer"), chose.get("deepspeed.offload_param")):
        if io["deepspeed_async_io_op"] is False:
            found.append("offload to NVMe is chosen, but DeepSpeed's async_io op cannot build here: "
                         "install libaio (Debian/Ubuntu: apt-get install libaio-dev)")
        if io.get("disk", {}).get("filesystem") == "tmpfs":
            found.append(f"deepspeed.nvme_path={io['nvme_path']} is on tmpfs, which is RAM: offloading "
                         "there saves no memory; point it at a local NVMe disk")
        if io.get("direct_io") is False:
            found.append(f"offload to NVMe is chosen, but deepspeed.nvme_path={io['nvme_path']} "
                         f"cannot do O_DIRECT I/O: {io['direct_io_detail']}")
    for label, disk in facts["host"]["disks"].items():
        if disk["free"] < 10 * hardware.GIB:
            found.append(f"only {disk['free'] / hardware.GIB:.1f} GiB free at {disk['path']} ({label}): "
                         "checkpoints may not fit")
    return found


def _gib(n: int | None) -> str:
    return "?" if n is None else f"{n / hardware.GIB:.1f} GiB"


def _num(value, unit: str, fmt: str = ".0f") -> str:
    return "?" if value is None else f"{value:{fmt}} {unit}"


def render(facts: dict) -> str:
    v = facts["versions"]
    t = v["torch"]
    lines = ["trainloop doctor", "", "versions"]
    lines.append(f"  python {facts['python']} on {facts['platform']}")
    if t.get("version"):
        lines.append(f"  torch {t['version']}  CUDA {t['cuda'] or 'none (CPU build)'}  cuDNN {t['cudnn'] or '-'}  "
                     f"NCCL {t['nccl'] or '-'}")
    else:
        lines.append(f"  torch MISSING: {t.get('error')}")
    for name in ("accelerate", "transformers", "datasets", "hydra-core", "nvidia-ml-py", "flash-attn", "torchao"):
        lines.append(f"  {name} {v[name] or 'missing'}")
    ds = v["deepspeed"]
    if ds.get("ops"):
        ops = ds["ops"]
        ok = [n for n, o in ops.items() if o["compatible"]]
        built = [n for n, o in ops.items() if o["prebuilt"] or o["jit_built"]]
        lines.append(f"  deepspeed {ds['version']} (accelerator {ds['accelerator']}): can build "
                     f"{', '.join(ok) or 'none'}; cannot: {', '.join(n for n in ops if n not in ok) or 'none'}; "
                     f"built: {', '.join(built) or 'none (JIT-compiled on first use)'}")
    else:
        lines.append(f"  deepspeed {ds.get('version') or 'missing'}: {ds.get('error')}")
    bnb = v["bitsandbytes"]
    lines.append(f"  bitsandbytes {bnb.get('version') or 'missing'}: " + (
        f"backend {bnb['backend']}, native library {'loaded' if bnb['native_library'] else 'NOT loaded'}"
        if "backend" in bnb else bnb.get("error", "")))

    g = facts["gpu"]
    lines += ["", "gpus"]
    if not g["gpus"]:
        lines.append("  no GPU found: " + "; ".join(g["notes"]) + ". Training runs on the CPU.")
    for gpu in g["gpus"]:
        cc = gpu["compute_capability"]
        lines.append(
            f"  GPU{gpu['index']} {gpu['name']}: {_gib(gpu['memory_total'])} ({_gib(gpu['memory_used'])} used), "
            f"compute {'.'.join(map(str, cc)) if cc else '?'}, bf16 {_yes(gpu['bf16'])}, tf32 {_yes(gpu['tf32'])}, "
            f"{_num(gpu['temperature_c'], 'C')}, "
            f"power {_num(gpu['power_w'], 'W')} of {_num(gpu['power_limit_w'], 'W')}, "
            f"SM {_num(gpu['sm_clock_mhz'], 'MHz')} of {_num(gpu['max_sm_clock_mhz'], 'MHz')}, "
            f"throttle: {', '.join(gpu['throttle_reasons']) or 'none'}")
    if g["gpus"]:
        lines.append(f"  (read with {g['source']})")
    topo = g["topology"]
    if topo:
        lines += ["", f"interconnect (from {g['topology_source']})"]
        gpus = [d for d in topo["devices"] if d.startswith("GPU")]
        lines.append("        " + "".join(f"{d:>7}" for d in gpus))
        for a in gpus:
            lines.append(f"  {a:<6}" + "".join(f"{topo['matrix'][a][b]:>7}" for b in gpus))
        kinds = sorted({(p["code"], p["description"]) for p in topo["gpu_links"]})
        lines += [f"  {code}: {words}" for code, words in kinds]

    h = facts["host"]
    lines += ["", "host"]
    lines.append(f"  CPU: {h['usable_cores']} usable cores ({h['logical_cores']} logical, "
                 f"{h['physical_cores']} physical) {h['cpu_model'] or ''}".rstrip())
    lines.append(f"  RAM: {_gib(h['ram_total'])} total, {_gib(h['ram_available'])} available")
    for label, disk in h["disks"].items():
        lines.append(f"  disk: {_gib(disk['free'])} free of {_gib(disk['total'])} at {disk['path']} "
                     f"({label}, {disk['filesystem']})")
    io = facts["async_io"]
    line = f"  async I/O: DeepSpeed async_io op {'can build' if io['deepspeed_async_io_op'] else 'cannot build'}"
    if io["nvme_path"]:
        d = io["disk"]
        line += (f"; deepspeed.nvme_path={io['nvme_path']}: {_gib(d['free'])} free ({d['filesystem']}), "
                 f"{io['direct_io_detail']}")
    else:
        line += "; deepspeed.nvme_path is not set"
    lines.append(line)
    c = facts["config"]
    lines += ["", "checked against: " + ", ".join(f"{key} {value}" for key, value in c.items())]
    lines += ["", "warnings"] + ([f"  - {w}" for w in facts["warnings"]] or ["  none"])
    return "\n".join(lines)


def _yes(flag: bool | None) -> str:
    return {True: "yes", False: "no", None: "?"}[flag]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainloop.doctor", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("overrides", nargs="*", help="the run's config overrides, e.g. +preset=zero3")
    args = parser.parse_args(argv)
    from trainloop.config.compose import ConfigError

    try:
        facts = examine(args.overrides)
    except ConfigError as err:
        print(f"trainloop.doctor: error: {err}", file=sys.stderr)
        return 2
    print(json.dumps(facts, indent=2, default=str) if args.json else render(facts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
