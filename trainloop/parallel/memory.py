"""The planner's line items: bytes a process holds, where and when. Each strategy states its own
model-state lines (trainloop.parallel: parameters, gradients, optimizer states and its buffers)
and the bytes each process sends per optimizer step (Transfer: collectives and host copies, not
memory); trainloop.tools.plan adds the activations and compares the sum with the machine."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

# bitsandbytes' storage per quantized weight: NF4 with double-quantized block scales (64-blocks,
# fp8 absmax, fp32 per 256 blocks), LLM.int8 with one fp32 scale per row (counted as per weight here)
QUANTIZED_BYTES = {"4bit": 0.5 + 1 / 64 + 4 / (64 * 256), "8bit": 1.0}


@dataclass
class Line:
    what: str
    bytes: int
    where: str  # gpu, cpu or nvme
    phase: str | None = None  # None: held all along; else counted only in that phase of a step
    exact: bool = True
    note: str = ""


@dataclass
class Transfer:
    what: str
    bytes: int  # sent by one process per optimizer step (a ring collective's share: ring_bytes)
    link: str  # dp: among the data-parallel ranks; tp: within a tensor-parallel group; pcie: host <-> device
    note: str = ""


def ring_bytes(collective: str, nbytes: int, ranks: int) -> int:
    """Bytes one rank sends in a ring collective over `ranks` of a tensor of `nbytes` (whole, not
    a shard): all-gather and reduce-scatter (ranks - 1) / ranks of it, all-reduce twice that
    (a reduce-scatter, then an all-gather), as NCCL's ring algorithm does."""
    share = (ranks - 1) * nbytes // ranks
    return {"all-gather": share, "reduce-scatter": share, "all-reduce": 2 * share}[collective]


@dataclass
class MemoryPlan:
    label: str
    world_size: int
    procs_per_node: int
    device: str  # cuda or cpu: where "the device" is for this run
    num_params: int
    lines: list[Line] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    traffic: list[Transfer] = field(default_factory=list)  # per optimizer step; not memory: peak() ignores it
    cpu_stepped_params: int = 0  # parameters this process's optimizer updates on the CPU (an offloaded optimizer)

    def held(self, where: str) -> int:
        return sum(x.bytes for x in self.lines if x.where == where and x.phase is None)

    def phase(self, where: str, phase: str) -> int:
        return sum(x.bytes for x in self.lines if x.where == where and x.phase == phase)

    def peak(self, where: str) -> int:
        """Per process: what is held all along plus the larger of the two phases of a step."""
        return self.held(where) + max(self.phase(where, "forward/backward"), self.phase(where, "optimizer step"))

    def get(self, what: str) -> int:
        return sum(x.bytes for x in self.lines if x.what == what)

    def sent(self, link: str) -> int:
        """Bytes this process sends over `link` per optimizer step."""
        return sum(x.bytes for x in self.traffic if x.link == link)

    def to_dict(self) -> dict:
        return {**{k: v for k, v in asdict(self).items() if k != "lines"},
                "lines": [asdict(x) for x in self.lines],
                "peak": {w: self.peak(w) for w in ("gpu", "cpu", "nvme")}}
