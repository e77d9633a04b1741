"""What the machine offers a training run: GPUs, how they are linked, CPU, RAM, disk.

The parsers take plain text or plain readings (`nvidia-smi topo -m` output, NVML numbers,
`nvidia-smi --query-gpu` CSV), so they are checked against real outputs on any machine. The
readers below them ask this machine, through NVML (`pip install nvidia-ml-py`, optional) or
the `nvidia-smi` binary, and never fail: what cannot be read is reported as missing.
Shared by the doctor, the planner and the telemetry sampler (trainloop/observe/telemetry.py).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import asdict, dataclass, field

GIB = 1024**3
MIB = 1024**2

# ---------------------------------------------------------------------------------------------
# The interconnect: `nvidia-smi topo -m`

# nvidia-smi's own legend, in its words.
LINK_LEGEND = {
    "X": "self",
    "SYS": "PCIe plus the SMP interconnect between NUMA nodes (e.g. QPI/UPI)",
    "NODE": "PCIe plus the interconnect between PCIe host bridges within a NUMA node",
    "PHB": "PCIe plus a PCIe host bridge (typically the CPU)",
    "PXB": "multiple PCIe bridges, without a PCIe host bridge",
    "PIX": "at most a single PCIe bridge",
    "NV#": "a bonded set of # NVLinks",
}
# Older drivers print SOC for SYS and CPU for PHB.
LINK_ALIASES = {"SOC": "SYS", "CPU": "PHB"}
# Paths that go through the CPU's host bridge(s): every collective pays for it.
HOST_BRIDGE_PATHS = ("PHB", "NODE", "SYS")

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_NVLINK = re.compile(r"^NV(\d+)$")


@dataclass(frozen=True)
class Link:
    """One cell of the matrix: how two devices reach each other."""

    code: str  # as nvidia-smi prints it: X, NV12, PIX, PXB, PHB, NODE, SYS

    @property
    def path(self) -> str:
        """The code with old aliases resolved, and NV# for every NVLink count."""
        if _NVLINK.match(self.code):
            return "NV#"
        return LINK_ALIASES.get(self.code, self.code)

    @property
    def kind(self) -> str:
        return {"X": "self", "NV#": "nvlink"}.get(self.path, "pcie")

    @property
    def nvlinks(self) -> int:
        m = _NVLINK.match(self.code)
        return int(m.group(1)) if m else 0

    @property
    def crosses_host_bridge(self) -> bool:
        return self.path in HOST_BRIDGE_PATHS

    @property
    def description(self) -> str:
        if self.kind == "nvlink":
            return f"{self.nvlinks} bonded NVLink{'s' if self.nvlinks != 1 else ''}"
        return LINK_LEGEND[self.path]

    def to_dict(self) -> dict:
        return {"code": self.code, "kind": self.kind, "nvlinks": self.nvlinks,
                "crosses_host_bridge": self.crosses_host_bridge, "description": self.description}


def parse_link(code: str) -> Link:
    code = code.strip()
    link = Link(code)
    if link.path not in LINK_LEGEND:
        raise ValueError(f"unknown link code {code!r} (known: {', '.join(LINK_LEGEND)})")
    return link


@dataclass
class Topology:
    """The matrix of `nvidia-smi topo -m`: GPUs and NICs, and the link between each pair."""

    devices: list[str]  # column order: GPU0.., then NICs
    links: dict[tuple[str, str], Link]
    cpu_affinity: dict[str, str] = field(default_factory=dict)
    numa_affinity: dict[str, str] = field(default_factory=dict)
    nic_names: dict[str, str] = field(default_factory=dict)  # NIC0 -> mlx5_0, from the NIC legend

    @property
    def gpus(self) -> list[str]:
        return [d for d in self.devices if d.startswith("GPU")]

    @property
    def nics(self) -> list[str]:
        return [d for d in self.devices if not d.startswith("GPU")]

    def link(self, a: str, b: str) -> Link:
        return self.links[(a, b)]

    def gpu_pairs(self) -> list[tuple[str, str, Link]]:
        gpus = self.gpus
        return [(a, b, self.links[(a, b)]) for i, a in enumerate(gpus) for b in gpus[i + 1:]]

    def to_dict(self) -> dict:
        return {
            "devices": self.devices,
            "gpu_links": [{"a": a, "b": b, **link.to_dict()} for a, b, link in self.gpu_pairs()],
            "matrix": {a: {b: self.links[(a, b)].code for b in self.devices} for a in self.devices},
            "cpu_affinity": self.cpu_affinity, "numa_affinity": self.numa_affinity,
            "nic_names": self.nic_names,
        }


def parse_topology(text: str) -> Topology:
    """Parse the output of `nvidia-smi topo -m` (tabs or spaces, with or without colour codes)."""
    lines = [_ANSI.sub("", line).rstrip() for line in text.splitlines()]
    header_at = next((i for i, line in enumerate(lines)
                      if line[:1].isspace() and line.split()[:1] == ["GPU0"]), None)
    if header_at is None:
        raise ValueError("not an `nvidia-smi topo -m` matrix: no header line starting with GPU0")
    names = lines[header_at].split()
    devices = names[:names.index("CPU")] if "CPU" in names else names
    links, cpu_affinity, numa_affinity = {}, {}, {}
    for line in lines[header_at + 1:]:
        cells = line.split()
        if not cells or cells[0] not in devices:
            break  # a blank line, then the legend
        row, entries, rest = cells[0], cells[1:len(devices) + 1], cells[len(devices) + 1:]
        if len(entries) != len(devices):
            raise ValueError(f"row {row} has {len(entries)} links for {len(devices)} devices")
        for col, code in zip(devices, entries):
            links[(row, col)] = parse_link(code)
        if rest:
            cpu_affinity[row] = rest[0]
        if len(rest) > 1:
            numa_affinity[row] = rest[1]
    missing = [d for d in devices if (d, d) not in links]
    if missing:
        raise ValueError(f"the matrix has no row for {', '.join(missing)}")
    nic_names = dict(re.findall(r"^\s*(NIC\d+):\s*(\S+)\s*$", "\n".join(lines), flags=re.M))
    return Topology(devices, links, cpu_affinity, numa_affinity, nic_names)


def topology_warnings(topology: Topology, zero_stage: int, env: dict | None = None) -> list[str]:
    """Plain-words warnings about how the GPUs talk, for the chosen ZeRO stage."""
    env = os.environ if env is None else env
    warnings = []
    slow = [(a, b, link) for a, b, link in topology.gpu_pairs() if link.crosses_host_bridge]
    if zero_stage and slow:
        pairs = ", ".join(f"{a}-{b} ({link.code})" for a, b, link in slow[:6])
        more = f" and {len(slow) - 6} more pairs" if len(slow) > 6 else ""
        warnings.append(
            f"ZeRO stage {zero_stage} is chosen, but GPUs talk through PCIe host bridges: {pairs}{more}. "
            "ZeRO exchanges parameters and gradients every step, so it is limited by that path; "
            "use NVLink-connected GPUs (NV# in `nvidia-smi topo -m`), or plain DDP "
            "(+preset=ddp) when the model fits, which syncs only gradients")
    nvlinked = [pair for pair in topology.gpu_pairs() if pair[2].kind == "nvlink"]
    if nvlinked and env.get("NCCL_P2P_DISABLE", "0") not in ("", "0"):
        warnings.append("NCCL_P2P_DISABLE is set: NCCL will not use the NVLinks between the GPUs "
                        "(the HF guide measured DDP ~23% slower that way); unset it")
    return warnings


# ---------------------------------------------------------------------------------------------
# GPU readings: NVML numbers, or the same from `nvidia-smi --query-gpu`

HOT_C = 80  # the HF guide: under 80 C is good; throttling starts around 84-90 C

# NVML's clocks event (throttle) reason bits (nvml.h: nvmlClocksEventReason*), in plain words.
# `harmful`: the GPU runs slower than it could because of it.
THROTTLE_REASONS = (
    (0x001, "gpu_idle", "idle", False),
    (0x002, "applications_clocks_setting", "application clocks set by the user", False),
    (0x004, "sw_power_cap", "at its power limit (clocks lowered to stay under it)", True),
    (0x008, "hw_slowdown", "hardware slowdown (overheating or a power-supply problem)", True),
    (0x010, "sync_boost", "held to the clocks of a sync-boost group", False),
    (0x020, "sw_thermal_slowdown", "thermal slowdown by the driver (GPU or memory too hot)", True),
    (0x040, "hw_thermal_slowdown", "thermal slowdown by the hardware (too hot)", True),
    (0x080, "hw_power_brake_slowdown", "external power brake (the system's power supply asked)", True),
    (0x100, "display_clock_setting", "display clock setting", False),
    (0x200, "board_limit", "a board limit", True),
    (0x400, "reliability", "a reliability limit", True),
)


def throttle_reasons(mask: int | None) -> list[str]:
    """Names of the reason bits set in an NVML clocks event reasons mask."""
    if not mask:
        return []
    names = [name for bit, name, _, _ in THROTTLE_REASONS if mask & bit]
    unknown = mask & ~sum(bit for bit, *_ in THROTTLE_REASONS)
    return names + ([f"unknown_0x{unknown:x}"] if unknown else [])


def harmful_throttle(mask: int | None) -> list[tuple[str, str]]:
    """(name, plain words) of the reasons that slow the GPU down."""
    return [(name, words) for bit, name, words, harmful in THROTTLE_REASONS
            if harmful and mask and mask & bit]


@dataclass
class GpuReading:
    """One GPU as NVML (or nvidia-smi) sees it. None: not readable on this GPU/driver."""

    index: int
    name: str = "?"
    uuid: str | None = None
    bus_id: str | None = None
    memory_total: int | None = None  # bytes
    memory_used: int | None = None
    temperature_c: float | None = None
    power_w: float | None = None
    power_limit_w: float | None = None
    power_default_limit_w: float | None = None
    sm_clock_mhz: float | None = None
    max_sm_clock_mhz: float | None = None
    utilization_pct: float | None = None
    compute_capability: tuple[int, int] | None = None
    throttle_mask: int | None = None

    @property
    def bf16(self) -> bool | None:  # bf16 and TF32 tensor cores: Ampere (8.0) and newer
        return None if self.compute_capability is None else tuple(self.compute_capability) >= (8, 0)

    @property
    def tf32(self) -> bool | None:
        return self.bf16

    def to_dict(self) -> dict:
        return {**asdict(self), "bf16": self.bf16, "tf32": self.tf32,
                "throttle_reasons": throttle_reasons(self.throttle_mask)}


def gpu_warnings(gpu: GpuReading) -> list[str]:
    """Plain-words warnings for one GPU reading, with the HF guide's thresholds."""
    warnings, who = [], f"GPU{gpu.index} ({gpu.name})"
    if gpu.temperature_c is not None and gpu.temperature_c > HOT_C:
        warnings.append(
            f"{who} is at {gpu.temperature_c:.0f} C, above {HOT_C} C: check its cooling and airflow. "
            "GPUs start throttling around 84-90 C, and long runs that hot shorten their life")
    harmful = harmful_throttle(gpu.throttle_mask)
    if harmful:
        clocks = ""
        if gpu.sm_clock_mhz and gpu.max_sm_clock_mhz:
            clocks = f" (SM clock {gpu.sm_clock_mhz:.0f} of {gpu.max_sm_clock_mhz:.0f} MHz)"
        warnings.append(f"{who} is throttling{clocks}: " + "; ".join(words for _, words in harmful))
    if any(name == "sw_power_cap" for name, _ in harmful) and gpu.power_w and gpu.power_limit_w:
        warnings.append(f"{who} draws {gpu.power_w:.0f} W of its {gpu.power_limit_w:.0f} W limit: "
                        "make sure every power socket has its own PSU cable (no pigtail splitters)")
    if (gpu.power_limit_w and gpu.power_default_limit_w
            and gpu.power_limit_w < 0.95 * gpu.power_default_limit_w):
        warnings.append(f"{who}'s power limit was lowered to {gpu.power_limit_w:.0f} W "
                        f"(default {gpu.power_default_limit_w:.0f} W): it will run slower")
    return warnings


# Fields of `nvidia-smi --query-gpu`, and where they go in a GpuReading (units with nounits:
# MiB, C, W, MHz, %). The reasons field was renamed in newer drivers; both are tried.
SMI_FIELDS = (
    ("index", "index", int), ("name", "name", str), ("uuid", "uuid", str),
    ("pci.bus_id", "bus_id", str), ("memory.total", "memory_total", lambda v: int(float(v) * MIB)),
    ("memory.used", "memory_used", lambda v: int(float(v) * MIB)),
    ("temperature.gpu", "temperature_c", float), ("power.draw", "power_w", float),
    ("power.limit", "power_limit_w", float), ("power.default_limit", "power_default_limit_w", float),
    ("clocks.sm", "sm_clock_mhz", float), ("clocks.max.sm", "max_sm_clock_mhz", float),
    ("utilization.gpu", "utilization_pct", float),
    ("compute_cap", "compute_capability", lambda v: tuple(int(x) for x in v.split("."))),
    ("clocks_event_reasons.active", "throttle_mask", lambda v: int(v, 16)),
)
SMI_REASONS_OLD = "clocks_throttle_reasons.active"


def parse_smi_csv(text: str, fields: list[str]) -> list[GpuReading]:
    """Rows of `nvidia-smi --query-gpu=FIELDS --format=csv,noheader,nounits` as readings."""
    where = {smi: (attr, conv) for smi, attr, conv in SMI_FIELDS}
    where[SMI_REASONS_OLD] = where["clocks_event_reasons.active"]
    readings = []
    for line in text.strip().splitlines():
        values = [v.strip() for v in line.split(",")]
        if len(values) != len(fields):
            raise ValueError(f"nvidia-smi row has {len(values)} values for {len(fields)} fields: {line!r}")
        reading = GpuReading(index=len(readings))
        for smi, value in zip(fields, values):
            attr, conv = where[smi]
            if value.startswith("[") or value in ("N/A", ""):  # [N/A], [Not Supported]
                continue
            try:
                setattr(reading, attr, conv(value))
            except ValueError:
                pass
        readings.append(reading)
    return readings


def _smi(args: list[str], timeout: float = 10.0) -> str | None:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        proc = subprocess.run([exe, *args], capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout if proc.returncode == 0 else None


def smi_query(select: str | None = None) -> list[GpuReading] | None:
    """GPU readings from the nvidia-smi binary; None when it is missing or fails."""
    fields = [smi for smi, _, _ in SMI_FIELDS]
    for reasons in ("clocks_event_reasons.active", SMI_REASONS_OLD):
        fields[-1] = reasons
        args = [f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits"]
        out = _smi(args + ([f"--id={select}"] if select else []))
        if out is not None:
            return parse_smi_csv(out, fields)
    return None


def _nvml():
    """The pynvml module, initialised; None when it is not installed or finds no driver."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...
        return None
    return pynvml


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def nvml_reading(nvml, handle, index: int) -> GpuReading:
    """Read one GPU through NVML; each field that this GPU or driver cannot give stays None."""
    def read(fn, *args):
        try:
            return fn(handle, *args)
        except Exception:  # NVMLError_NotSupported, or a function the driver lacks
            return None

    reading = GpuReading(index=index, name=_text(read(nvml.nvmlDeviceGetName) or "?"))
    uuid, pci, mem = read(nvml.nvmlDeviceGetUUID), read(nvml.nvmlDeviceGetPciInfo), read(nvml.nvmlDeviceGetMemoryInfo)
    reading.uuid = _text(uuid) if uuid else None
    reading.bus_id = _text(pci.busId) if pci else None
    if mem:
        reading.memory_total, reading.memory_used = int(mem.total), int(mem.used)
    reading.temperature_c = read(nvml.nvmlDeviceGetTemperature, nvml.NVML_TEMPERATURE_GPU)
    for attr, fn in (("power_w", "nvmlDeviceGetPowerUsage"), ("power_limit_w", "nvmlDeviceGetEnforcedPowerLimit"),
                     ("power_default_limit_w", "nvmlDeviceGetPowerManagementDefaultLimit")):
        milliwatts = read(getattr(nvml, fn))
        setattr(reading, attr, None if milliwatts is None else milliwatts / 1000)
    reading.sm_clock_mhz = read(nvml.nvmlDeviceGetClockInfo, nvml.NVML_CLOCK_SM)
    reading.max_sm_clock_mhz = read(nvml.nvmlDeviceGetMaxClockInfo, nvml.NVML_CLOCK_SM)
    util = read(nvml.nvmlDeviceGetUtilizationRates)
    reading.utilization_pct = None if util is None else util.gpu
    cc = read(nvml.nvmlDeviceGetCudaComputeCapability)
    reading.compute_capability = None if cc is None else tuple(cc)
    reasons = getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
        nvml.nvmlDeviceGetCurrentClocksThrottleReasons
    reading.throttle_mask = read(reasons)
    return reading


# NVML's topology levels, as the codes nvidia-smi prints for them.
NVML_TOPOLOGY_CODES = {0: "PIX", 10: "PIX", 20: "PXB", 30: "PHB", 40: "NODE", 50: "SYS"}


def nvml_topology(nvml, handles: list) -> Topology:
    """The GPU-to-GPU matrix from NVML: NVLink counts where linked, else the PCIe path."""
    devices = [f"GPU{i}" for i in range(len(handles))]
    bus = []
    for h in handles:
        try:
            bus.append(_text(nvml.nvmlDeviceGetPciInfo(h).busId).lower())
        except Exception:
            bus.append(None)
    nvlinks = [[0] * len(handles) for _ in handles]
    for i, h in enumerate(handles):
        for link in range(getattr(nvml, "NVML_NVLINK_MAX_LINKS", 18)):
            try:
                if nvml.nvmlDeviceGetNvLinkState(h, link) != nvml.NVML_FEATURE_ENABLED:
                    continue
                remote = _text(nvml.nvmlDeviceGetNvLinkRemotePciInfo(h, link).busId).lower()
            except Exception:
                continue
            if remote in bus:
                nvlinks[i][bus.index(remote)] += 1
    links = {}
    for i, a in enumerate(devices):
        for j, b in enumerate(devices):
            if i == j:
                code = "X"
            elif nvlinks[i][j]:
                code = f"NV{nvlinks[i][j]}"
            else:
                try:
                    level = nvml.nvmlDeviceGetTopologyCommonAncestor(handles[i], handles[j])
                    code = NVML_TOPOLOGY_CODES.get(int(level), "SYS")
                except Exception:
                    code = "SYS"
            links[(a, b)] = Link(code)
    return Topology(devices, links)


@dataclass
class GpuReport:
    """Every GPU this machine shows, the matrix between them, and where it was read from."""

    gpus: list[GpuReading]
    source: str | None  # nvml, nvidia-smi, torch, or None when no GPU was found
    topology: Topology | None = None
    topology_source: str | None = None
    notes: list[str] = field(default_factory=list)  # why something could not be read

    def to_dict(self) -> dict:
        return {"gpus": [g.to_dict() for g in self.gpus], "source": self.source,
                "topology": None if self.topology is None else self.topology.to_dict(),
                "topology_source": self.topology_source, "notes": self.notes}


def read_gpus(with_topology: bool = True) -> GpuReport:
    """All GPUs of this machine: NVML first, then nvidia-smi, then torch (memory only)."""
    notes = []
    nvml = _nvml()
    handles, gpus, source = [], [], None
    if nvml is not None:
        try:
            handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]
            gpus, source = [nvml_reading(nvml, h, i) for i, h in enumerate(handles)], "nvml"
        except Exception as err:
            notes.append(f"NVML failed: {err}")
    else:
        notes.append("NVML is not available (pip install nvidia-ml-py; needs the NVIDIA driver)")
    if not gpus:
        smi = smi_query()
        if smi:
            gpus, source = smi, "nvidia-smi"
        else:
            notes.append("nvidia-smi " + ("found no GPU" if shutil.which("nvidia-smi") else "is not installed"))
    if not gpus:
        gpus = torch_gpus()
        source = "torch" if gpus else None
        if not gpus:
            notes.append("torch.cuda.is_available() is False")
    report = GpuReport(gpus, source, notes=notes)
    if with_topology and len(gpus) > 1:
        text = _smi(["topo", "-m"])
        if text:
            try:
                report.topology, report.topology_source = parse_topology(text), "nvidia-smi topo -m"
            except ValueError as err:
                notes.append(f"could not parse `nvidia-smi topo -m`: {err}")
        if report.topology is None and handles:
            report.topology, report.topology_source = nvml_topology(nvml, handles), "nvml"
    if nvml is not None:
        try:
            nvml.nvmlShutdown()
        except Exception:
            pass
    return report


def torch_gpus() -> list[GpuReading]:
    """What torch alone can say about the visible GPUs (no NVML, no nvidia-smi)."""
    import torch

    if not torch.cuda.is_available():
        return []
    gpus = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        gpus.append(GpuReading(index=i, name=props.name, memory_total=props.total_memory,
                               compute_capability=(props.major, props.minor)))
    return gpus


class GpuMonitor:
    """Reads one CUDA device of this process, repeatedly (telemetry). Never raises."""

    def __init__(self, device_index: int):
        import torch

        self.index = device_index
        self.nvml, self.handle, self.uuid = _nvml(), None, None
        try:
            self.uuid = "GPU-" + str(torch.cuda.get_device_properties(device_index).uuid)
        except Exception:
            pass
        if self.nvml is not None and self.uuid:
            try:  # by UUID: NVML numbers all GPUs, ignoring CUDA_VISIBLE_DEVICES
                self.handle = self.nvml.nvmlDeviceGetHandleByUUID(self.uuid)
            except Exception:
                self.handle = None

    def read(self) -> GpuReading | None:
        if self.handle is not None:
            return nvml_reading(self.nvml, self.handle, self.index)
        if self.uuid and shutil.which("nvidia-smi"):
            found = smi_query(select=self.uuid)
            if found:
                found[0].index = self.index
                return found[0]
        return None


# ---------------------------------------------------------------------------------------------
# The host: CPU, RAM, disk, async I/O


def host_facts(paths: dict[str, str] | None = None) -> dict:
    """CPU cores, RAM, and free space at each named path (that exists, or its nearest parent)."""
    import psutil

    mem = psutil.virtual_memory()
    facts = {
        "cpu_model": _cpu_model(),
        "logical_cores": os.cpu_count(),
        "physical_cores": psutil.cpu_count(logical=False),
        "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "ram_total": int(mem.total),
        "ram_available": int(mem.available),
        "disks": {},
    }
    for label, path in (paths or {}).items():
        facts["disks"][label] = disk_facts(path)
    return facts


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def _existing(path: str) -> str:
    path = os.path.abspath(os.path.expanduser(path))
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return path


def filesystem_type(path: str) -> str | None:
    """The type of the filesystem holding `path` (the longest mount point that contains it)."""
    path, best, fstype = os.path.realpath(_existing(path)), "", None
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                mount = parts[1].replace("\\040", " ")
                if (path == mount or path.startswith(mount.rstrip("/") + "/")) and len(mount) >= len(best):
                    best, fstype = mount, parts[2]
    except OSError:
        return None
    return fstype


def disk_facts(path: str) -> dict:
    usage = shutil.disk_usage(_existing(path))
    return {"path": path, "exists": os.path.exists(os.path.expanduser(path)), "free": usage.free,
            "total": usage.total, "filesystem": filesystem_type(path)}


def direct_io_works(directory: str) -> tuple[bool, str]:
    """Write and read back one block with O_DIRECT, as DeepSpeed's async I/O does; (ok, why)."""
    import mmap

    if not hasattr(os, "O_DIRECT"):
        return False, "this OS has no O_DIRECT"
    directory = os.path.expanduser(directory)
    if not os.path.isdir(directory):
        return False, f"{directory} is not a directory"
    path = os.path.join(directory, f".trainloop_direct_io_{os.getpid()}")
    block = mmap.mmap(-1, 4096)  # page-aligned, as O_DIRECT needs
    block.write(b"trainloop" * 455)
    try:
        fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_DIRECT, 0o600)
        try:
            os.write(fd, block)
        finally:
            os.close(fd)
        back = mmap.mmap(-1, 4096)
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        try:
            os.readv(fd, [back])
        finally:
            os.close(fd)
        if back[:] != block[:]:
            return False, "O_DIRECT read back different bytes"
        return True, "O_DIRECT write and read work"
    except OSError as err:
        return False, f"O_DIRECT failed: {err.strerror} (tmpfs and some network filesystems refuse it)"
    finally:
        try:
            os.unlink(path)
        except OSError:
            pass
