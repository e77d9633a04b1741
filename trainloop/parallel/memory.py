"""The planner's line items: bytes a process holds, where and when. Each strategy states its own
model-state lines (trainloop.parallel: parameters, gradients, optimizer states and its buffers);
trainloop.tools.plan adds the activations and compares the sum with the machine."""

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
class MemoryPlan:
    label: str
    world_size: int
    procs_per_node: int
    device: str  # cuda or cpu: where "the device" is for this run
    num_params: int
    lines: list[Line] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def held(self, where: str) -> int:
        return sum(x.bytes for x in self.lines if x.where == where and x.phase is None)

    def phase(self, where: str, phase: str) -> int:
        return sum(x.bytes for x in self.lines if x.where == where and x.phase == phase)

    def peak(self, where: str) -> int:
        """Per process: what is held all along plus the larger of the two phases of a step."""
        return self.held(where) + max(self.phase(where, "forward/backward"), self.phase(where, "optimizer step"))

    def get(self, what: str) -> int:
        return sum(x.bytes for x in self.lines if x.what == what)

    def to_dict(self) -> dict:
        return {**{k: v for k, v in asdict(self).items() if k != "lines"},
                "lines": [asdict(x) for x in self.lines],
                "peak": {w: self.peak(w) for w in ("gpu", "cpu", "nvme")}}
