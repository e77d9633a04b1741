"""`python -m trainloop.plan --suggest --gpus N --gpu-memory GiB [overrides]`: the layouts that fit, fastest first.

Every layout of the table below (DDP, ZeRO-1/2/3 with and without CPU offload, FSDP2 with and
without CPU offload, FSDP2 x TP for each tp dividing the GPUs of a node, each with and without
sequence parallelism where the blocks are Llama's, FSDP2 with 2, 4 and 8 context-parallel ranks
splitting each sequence, and 2, 4 and 8 pipeline stages with FSDP2 on the rest), with and without
gradient checkpointing, at every micro-batch x accumulation that keeps the global batch, is
planned by the planner itself (plan_memory on the composed config, verdict against the GPUs:
GPU_USABLE of each, and the host RAM of a node). Each that fits gets an estimated step time:

    compute  FLOPs per token (trainloop/model/flops.py: 6 N + attention) x the step's tokens / (GPUs x
             peak x MFU); x 4/3 with gradient checkpointing (the forward runs twice); under tensor
             parallelism every tp rank also runs the whole output head (trainloop does not split it)
    + links  each transfer the plan counts (plan.traffic: the strategy's collectives, context
             parallelism's all-to-alls and PCIe copies) / its link's bandwidth, NOT overlapped with
             compute: an upper bound
    + CPU    an offloaded optimizer's step (plan.cpu_stepped_params) at an assumed rate
    + bubble a pipeline's idle stages: compute x (pp_size - 1) / micro-batches (Strategy.bubble)

Where the configured optimizer has a row in trainloop.optim.optimizers.OPTIMIZERS that stands in for it with
less state (8-bit and paged 8-bit AdamW for AdamW), every layout that accepts it is planned with it
too. Methods that train something else (LoRA, QLoRA: adapters on a frozen base) are planned apart
and listed under "if you can change the method". Every line printed fits in WIDTH characters.

Every number assumed is a row of ASSUMPTIONS, with its flag, printed with the answer. Not
modelled: kernel efficiency at small micro-batches (one MFU for all), overlap, shared PCIe
switches, stragglers. The memory side is measured on CPU (tests/test_suggest.py); the step-time
side cannot be here, only its monotone properties are tested.
"""

from __future__ import annotations

import copy
import json
import math
import os
import sys
import textwrap
from dataclasses import asdict, dataclass, field

from trainloop.config.compose import ConfigError, check_complete, check_presets, compose_config, validate
from trainloop.parallel import OFF, layouts, row, splits
from trainloop.parallel.memory import MemoryPlan
from trainloop.parallel.tp import SEQUENCE_PARALLEL
from trainloop.tools import plan as planner
from trainloop.tools.plan import GIB, GPU_USABLE, RUNTIME_RAM, Machine, _gib, plan_memory, verdict
from trainloop.tools.shape import model_shape


@dataclass(frozen=True)
class Assumption:
    flag: str
    default: float | str
    unit: str
    why: str


# Each number the estimate assumes, its command-line flag and why it is what it is.
ASSUMPTIONS = {
    "gpu": Assumption("--gpu", "H100", "", "the GPU whose dense peak (trainloop.model.flops.PEAK_TFLOPS) sets the compute "
                      "time; H100 is the SXM part, 989 TFLOPS bf16"),
    "peak_tflops": Assumption("--peak-tflops", "", "TFLOPS", "instead of the table's peak for --gpu"),
    "mfu": Assumption("--mfu", 0.40, "", "model FLOPs utilisation: a good dense-transformer run on H100s reaches "
                      "0.35-0.5; one number for every layout and micro-batch"),
    "intra_node_gbs": Assumption("--intra-node-gbs", 450.0, "GB/s", "what one GPU sends per second within a node: "
                                 "NVLink 4 is 900 GB/s both ways, 450 each way"),
    "inter_node_gbs": Assumption("--inter-node-gbs", 50.0, "GB/s", "what one GPU sends per second to other nodes: "
                                 "one 400 Gb/s NIC per GPU"),
    "pcie_gbs": Assumption("--pcie-gbs", 25.0, "GB/s", "host <-> device per GPU, pinned memory over PCIe 4 x16 "
                           "(32 GB/s nominal)"),
    "cpu_optimizer_gparams": Assumption("--cpu-optimizer-gparams", 1.0, "G params/s",
                                        "an offloaded AdamW step per process: about 30 bytes of memory traffic "
                                        "a parameter at some 30 GB/s of a node's memory bandwidth per process"),
    "host_ram_gib": Assumption("--cpu-memory", 1024.0, "GiB", "host RAM per node for the offloaded states when "
                               "--gpu-memory describes another machine (a DGX H100 has 2 TiB)"),
}

# Keys the suggestion chooses itself: the user's own are dropped (and said so). A layout sets every
# strategy's keys (trainloop.parallel.OFF), so none is left stale (an offload target without its stage).
CHOSEN = (*OFF, "model.gradient_checkpointing", "data.batch_size", "trainer.gradient_accumulation_steps")


WIDTH = 100  # the longest line printed (a terminal's, with room)


@dataclass(frozen=True)
class Method:
    overrides: tuple[str, ...]
    trains: str
    pretrained: bool = False  # quantizes pretrained weights: a run needs model=hf model.name_or_path=DIR


# What changes what is trained, listed apart ("if you can change the method"); each planned with the
# plain layout (every GPU holds the frozen base), the adapter's size from conf/adapter/lora.yaml.
METHODS = {
    "LoRA": Method(("adapter=lora",), "adapters (adapter.r) on every linear layer, the base frozen"),
    "QLoRA": Method(("adapter=lora", "model.quantization=4bit"), "LoRA on a base stored in 4 bits (NF4), "
                    "loaded from pretrained weights (model=hf model.name_or_path=DIR)", pretrained=True),
}


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass
class Cluster:
    gpus: int
    nodes: int
    device: str  # cuda, or cpu (processes on this machine's cores)
    gpu_memory: int | None  # bytes per GPU
    gpu_name: str
    host_ram: int  # bytes per node
    source: str

    @property
    def per_node(self) -> int:
        return self.gpus // self.nodes

    def machine(self) -> Machine:
        return Machine(self.device, self.gpu_memory, self.gpu_name, self.host_ram, self.host_ram, None, self.source)


@dataclass
class StepTime:
    compute: float
    dp: float  # collectives among data-parallel ranks
    tp: float  # tensor-parallel all-reduces
    pcie: float  # offload copies
    cpu_optimizer: float
    pp: float = 0.0  # a pipeline's activations and their gradients, point to point
    bubble: float = 0.0  # a pipeline's stages idle while it fills and drains
    cp: float = 0.0  # context parallelism's all-to-alls around attention
    ep: float = 0.0  # expert parallelism's all-to-alls around the experts

    @property
    def total(self) -> float:  # nothing overlapped
        return (self.compute + self.dp + self.tp + self.pcie + self.cpu_optimizer + self.pp + self.bubble + self.cp
                + self.ep)


@dataclass
class Option:
    layout: str  # with the optimizer that stands in for the configured one, or the method's name
    overrides: list[str]  # what to add to the command line for it
    micro_batch: int
    accumulation: int
    checkpointing: bool
    plan: MemoryPlan
    fits: bool | None
    verdict: list[str]
    time: StepTime  # estimated for every option; listed only for those that fit
    method: str = ""  # a METHODS key: it trains something else
    stand_in: str = ""  # the optimizer in the configured one's place (its layout says so too)
    also: list[str] = field(default_factory=list)  # other stand-ins with the same plan

    @property
    def name(self) -> str:
        return self.layout + "".join(f" or {name}" for name in self.also)

    @property
    def memory(self) -> int:
        return self.plan.peak("gpu" if self.plan.device == "cuda" else "cpu")

    def biggest_line(self) -> str:
        where = "gpu" if self.plan.device == "cuda" else "cpu"
        line = max((x for x in self.plan.lines if x.where == where), key=lambda x: x.bytes)
        return f"{line.what} {_gib(line.bytes)}"


@dataclass
class Suggestion:
    num_params: int
    cluster: Cluster
    global_batch: int
    seq_len: int
    flops_per_token: float
    peak_tflops: float
    values: dict  # ASSUMPTIONS' values used
    options: list[Option] = field(default_factory=list)
    not_applied: dict[str, str] = field(default_factory=dict)  # layout -> why it cannot run this config
    dropped: list[str] = field(default_factory=list)  # the user's overrides the layouts replace
    stand_ins: dict[str, list[str]] = field(default_factory=dict)  # optimizer -> the layouts that refuse it

    @property
    def fitting(self) -> list[Option]:
        return fastest(o for o in self.options if o.fits and not o.method)

    @property
    def fitting_methods(self) -> list[Option]:
        return fastest(o for o in self.options if o.fits and o.method)

    def not_fitting(self) -> list[Option]:
        """For each layout and checkpointing choice none of whose micro-batches fits: its smallest
        (the methods' are not listed: a method is only offered where it fits)."""
        groups: dict[tuple[str, bool], list[Option]] = {}
        for o in (o for o in self.options if not o.method):
            groups.setdefault((o.layout, o.checkpointing), []).append(o)
        return [min(g, key=lambda o: o.memory) for g in groups.values() if not any(o.fits for o in g)]


def fastest(options) -> list[Option]:
    return sorted(options, key=lambda o: (o.time.total, o.memory))


def key_of(override: str) -> str:
    return override.lstrip("+~").split("=", 1)[0]


def is_chosen(override: str) -> bool:
    return any(key_of(override) == c or key_of(override).startswith(c + ".") for c in CHOSEN)


def stand_ins(cfg, kept: list[str]) -> dict:
    """The optimizers that stand in for the configured one with less state (OPTIMIZERS' stands_in_for),
    each composed with the user's optimizer.* values: name -> its optimizer config."""
    from trainloop.optim.optimizers import OPTIMIZERS

    own = [o for o in kept if key_of(o) != "optimizer"]
    return {name: compose_config(own + [f"optimizer={name}"], check=False).optimizer
            for name, row in OPTIMIZERS.items() if row.stands_in_for == cfg.optimizer.name}


def layout_overrides(layout: dict) -> list[str]:
    return [f"{k}={v}" for k, v in {**OFF, **layout}.items()]


def peak_tflops(values: dict, precision) -> float:
    """The assumed GPU's dense peak for what the matmuls run in (fp8 against bf16's, as trainloop.model.flops does),
    looked up as a run looks up its own GPU's (trainloop.model.flops.table_peak)."""
    from trainloop.model.flops import PEAK_TFLOPS, table_peak

    if values["peak_tflops"]:
        return float(values["peak_tflops"])
    kind = {"fp8": "bf16", "fp32": "tf32" if precision.tf32 else "fp32"}.get(precision.name, precision.name)
    peak = table_peak(str(values["gpu"]), kind)
    if peak is None:
        raise ConfigError(f"--gpu {values['gpu']}: no {kind} peak known (known: {', '.join(PEAK_TFLOPS)}); "
                          "give --peak-tflops N")
    return peak


def model_flops(cfg, shape) -> tuple[float, float]:
    """(training FLOPs per token, those of the output head alone), from trainloop.model.flops."""
    from trainloop.data.loaders import build_tokenizer
    from trainloop.model.builder import build_model_config
    from trainloop.model.flops import flops_per_token

    config = build_model_config(cfg.model, len(build_tokenizer(cfg.data.tokenizer, cfg.model.name_or_path)))
    trained = None if shape.trainable is None else sum(math.prod(s) for s in shape.trainable if len(s) >= 2)
    head = (6 if shape.trainable is None else 4) * shape.vocab * shape.hidden  # a frozen head: no weight gradient
    return flops_per_token(config, cfg.data.seq_len, trained), head


def step_time(plan: MemoryPlan, checkpointing: bool, tp: int, s: Suggestion, model: tuple[float, float],
              bubble: float = 0.0) -> StepTime:
    """`model`: model_flops' (FLOPs per token, those of the head); `bubble`: a pipeline's idle
    fraction of its compute (Strategy.bubble)."""
    v, c = s.values, s.cluster
    tokens = s.global_batch * s.seq_len
    flops = tokens * (model[0] + (tp - 1) * model[1]) * (4 / 3 if checkpointing else 1)
    compute = flops / (c.gpus * s.peak_tflops * 1e12 * v["mfu"])
    link = v["intra_node_gbs"] if c.nodes == 1 else v["inter_node_gbs"]  # dp and pp groups span the nodes
    return StepTime(compute, dp=plan.sent("dp") / (link * 1e9), tp=plan.sent("tp") / (v["intra_node_gbs"] * 1e9),
                    pcie=plan.sent("pcie") / (v["pcie_gbs"] * 1e9),
                    cpu_optimizer=plan.cpu_stepped_params / (v["cpu_optimizer_gparams"] * 1e9),
                    pp=plan.sent("pp") / (link * 1e9), bubble=compute * bubble,
                    cp=plan.sent("cp") / (v["intra_node_gbs"] * 1e9), ep=plan.sent("ep") / (v["intra_node_gbs"] * 1e9))


def suggest(overrides: list[str], cluster: Cluster, values: dict, global_batch: int | None = None) -> Suggestion:
    """Every layout planned for this cluster; the ones that fit timed. Raises ConfigError for a
    config that does not compose or a global batch the cluster cannot split."""
    user = cfg = compose_config(overrides)  # the user's own config: its model and its global batch
    group = row(cfg).model_parallel(cfg)
    if cluster.gpus % group:
        sizes = " x ".join(splits(cfg))
        raise ConfigError(f"{sizes} does not divide --gpus {cluster.gpus}: the default global batch is "
                          f"data.batch_size x accumulation x (GPUs / {group}); give --global-batch N or other sizes")
    if global_batch is None:
        global_batch = cfg.data.batch_size * cfg.trainer.gradient_accumulation_steps * (cluster.gpus // group)
    peak = peak_tflops(values, cfg.precision)  # an unknown --gpu says so before the model is built
    shape = model_shape(cfg)  # the layouts do not change the model: built once
    flops = model_flops(cfg, shape)
    kept = [o for o in overrides if not is_chosen(o)]
    s = Suggestion(shape.num_params, cluster, global_batch, cfg.data.seq_len, flops[0], peak, values,
                   dropped=[o for o in overrides if is_chosen(o)])
    optimizers = stand_ins(cfg, kept)
    s.stand_ins = {name: [] for name in optimizers}
    methods = METHODS if user.adapter.name == "none" and user.model.quantization == "none" else {}
    for name, layout in layouts(cluster.per_node).items():
        tp = layout.get("parallel.tp_size", 1)
        group = tp * layout.get("parallel.pp_size", 1) * layout.get("parallel.cp_size", 1)  # one replica's processes
        dp = cluster.gpus // group
        if cluster.device == "cpu" and "cpu" in layout.values():
            s.not_applied[name] = "offload moves states to host memory; CPU processes hold them there already"
        elif cluster.gpus % group:
            s.not_applied[name] = f"its {group} model-parallel ranks do not divide the {cluster.gpus} GPUs"
        elif global_batch % dp:
            s.not_applied[name] = f"--global-batch {global_batch} does not divide over its {dp} data-parallel ranks"
        if name in s.not_applied:
            continue
        try:
            cfg = layout_config(kept + layout_overrides(layout))
        except ConfigError as err:
            s.not_applied[name] = one_line(err)
            continue
        if name.endswith(SEQUENCE_PARALLEL) and shape.sequence_parallel_problem:  # blocks not laid out as Llama's
            s.not_applied[name] = shape.sequence_parallel_problem
            continue
        shown = [f"{k}={v}" for k, v in layout.items()]
        add_options(s, name, cfg, shape, shown, dp, tp, flops)
        for optimizer, optimizer_cfg in optimizers.items():
            variant = copy.deepcopy(cfg)
            variant.optimizer = optimizer_cfg
            try:
                validate(variant)
            except ConfigError:  # the stand-in's row refuses this layout (ZeRO-3, FSDP2, CPU offload)
                s.stand_ins[optimizer].append(name)
                continue
            add_options(s, name, variant, shape, shown + [f"optimizer={optimizer}"], dp, tp, flops, stand_in=optimizer)
    for name, method in methods.items() if "DDP" not in s.not_applied else ():  # DDP over every GPU
        try:  # a shape without pretrained weights still plans a QLoRA run of that shape (a run needs model=hf)
            cfg = compose_config(kept + layout_overrides({}) + list(method.overrides),
                                 check=not method.pretrained or user.model.name == "hf")
        except ConfigError as err:
            s.not_applied[name] = one_line(err)
            continue
        trained = model_shape(cfg)
        add_options(s, name, cfg, trained, list(method.overrides), cluster.gpus, 1, model_flops(cfg, trained),
                    method=name)
    return s


def layout_config(overrides: list[str]):
    """The overrides composed and checked as a run checks them, with the fewest micro-batches a step
    of their layout takes where the config's own are fewer (a pipeline's: one per stage): each
    option sets its own, so the layout is checked at the least it needs. Composed once: Hydra's
    composition is most of a suggestion's time (0.7 s a layout on the 2-core CPU)."""
    try:
        cfg = compose_config(overrides, check=False)
    except Exception:  # noqa: BLE001 - the checked composition says what is wrong, in one line
        return compose_config(overrides)
    cfg.trainer.gradient_accumulation_steps = max(cfg.trainer.gradient_accumulation_steps,
                                                  row(cfg).min_accumulation(cfg))
    check_presets(overrides)
    check_complete(cfg)
    validate(cfg)
    return cfg


def one_line(err: ConfigError) -> str:
    return str(err).replace("invalid config:\n  ", "").replace("\n  ", "; ")


def add_options(s: Suggestion, layout: str, cfg, shape, shown: list[str], dp: int, tp: int,
                flops: tuple[float, float], stand_in: str = "", method: str = "") -> None:
    """One option per checkpointing choice and micro-batch of the global batch, planned; one with
    the same plan as another stand-in's on the same layout joins that one (paged AdamW and AdamW8bit)."""
    c = s.cluster
    name = f"{layout} + {stand_in}" if stand_in else layout
    strategy = row(cfg)
    for checkpointing in (False, True):
        for micro in divisors(s.global_batch // dp):
            accumulation = s.global_batch // dp // micro
            cfg.model.gradient_checkpointing = checkpointing  # the same composed config, resized
            cfg.data.batch_size, cfg.trainer.gradient_accumulation_steps = micro, accumulation
            if accumulation < strategy.min_accumulation(cfg):  # a pipeline's stages: one each at least
                continue
            plan = plan_memory(cfg, shape, c.gpus, c.device, c.per_node, name)
            fits, lines = verdict(plan, c.machine())
            option = Option(name, shown + (["model.gradient_checkpointing=true"] if checkpointing else [])
                            + [f"data.batch_size={micro}", f"trainer.gradient_accumulation_steps={accumulation}"],
                            micro, accumulation, checkpointing, plan, fits, lines,
                            step_time(plan, checkpointing, tp, s, flops, strategy.bubble(cfg)), method, stand_in)
            twin = next((o for o in s.options if stand_in and o.stand_in and o.layout == f"{layout} + {o.stand_in}"
                         and (o.micro_batch, o.checkpointing, o.memory, o.time) ==
                         (micro, checkpointing, option.memory, option.time)), None)
            if twin:
                twin.also.append(stand_in)
            else:
                s.options.append(option)


# ---------------------------------------------------------------------------------------------
# Output


def assumption_lines(s: Suggestion) -> list[str]:
    v, c = s.values, s.cluster
    gpu = f"{s.peak_tflops:g} TFLOPS peak (" + (f"{ASSUMPTIONS['peak_tflops'].flag})" if v["peak_tflops"] else
                                                 f"{v['gpu']}'s in trainloop/model/flops.py, {ASSUMPTIONS['gpu'].flag}; "
                                                 f"or {ASSUMPTIONS['peak_tflops'].flag})")
    out = [f"compute: {s.flops_per_token / 1e9:,.4g} GFLOP per token (6 x matmul weights + attention at "
           f"{s.seq_len:,} tokens, trainloop/model/flops.py), x 4/3 with gradient checkpointing, at MFU {v['mfu']:g} "
           f"({ASSUMPTIONS['mfu'].flag}) of {gpu}; under tensor parallelism each tp rank also runs the whole "
           "output head",
           "communication: the plan's bytes per step (ring collectives, trainloop/parallel/*.traffic_lines), NOT "
           "overlapped with compute: an upper bound on its cost"]
    for key in ("intra_node_gbs", "inter_node_gbs", "pcie_gbs", "cpu_optimizer_gparams"):
        a = ASSUMPTIONS[key]
        used = "" if key != "inter_node_gbs" or c.nodes > 1 else " (unused: one node)"
        out.append(f"{v[key]:g} {a.unit} ({a.flag}){used}: {a.why}")
    out.append(f"tensor and context parallelism within a node; data-parallel collectives and a pipeline's "
               f"point-to-point transfers at the {'inter' if c.nodes > 1 else 'intra'}-node bandwidth")
    out.append("a pipeline's bubble: its stages idle (pp_size - 1) / micro-batches of the step's compute while the "
               "micro-batches fill and drain it (1F1B), added to the step")
    gpu = (f"{GPU_USABLE:.0%} of each GPU's memory (the CUDA context, NCCL and fragmentation take the rest) and "
           if c.device == "cuda" else "")
    out.append(f"memory: the planner's plan of each layout against {gpu}{_gib(c.host_ram)} of host RAM per node "
               f"({c.source}; {_gib(RUNTIME_RAM)} of it per process for the runtime)")
    if c.device == "cpu":
        out.append("CPU processes: the step times still assume the GPUs above; only the memory side means anything")
    out.append("not modelled: kernel efficiency at small micro-batches (one MFU for all), a collective's latency "
               "(only its bytes), overlap, shared PCIe switches, stragglers, the data loader, QLoRA's dequantization")
    if s.dropped:
        out.append(f"your overrides the layouts replace: {' '.join(s.dropped)}")
    return out


def render(s: Suggestion, top: int) -> str:
    c = s.cluster
    what = (f"GPU{'s' if c.gpus > 1 else ''} of {_gib(c.gpu_memory)} ({_gib(GPU_USABLE * c.gpu_memory)} usable)"
            if c.device == "cuda" else f"CPU processes, {_gib(c.host_ram)} of RAM")
    out = [f"trainloop plan --suggest: {s.num_params / 1e6:,.1f}M parameters on {c.gpus} {what}, {c.nodes} node"
           f"{'s' if c.nodes > 1 else ''} of {c.per_node}",
           f"global batch {s.global_batch} x {s.seq_len:,} tokens; fastest first by the estimate below", ""]
    out += table(s, s.fitting, top) or ["no layout fits."]
    missed = s.not_fitting()
    if missed:
        out += ["", "does not fit (its smallest micro-batch):"]
        for o in sorted(missed, key=lambda o: o.memory):
            why = next((x for x in o.verdict if "does NOT fit" in x), o.verdict[0])
            out.append(f"  {o.layout}{' + checkpointing' if o.checkpointing else ''}: {why}; biggest: {o.biggest_line()}")
    methods = s.fitting_methods
    if methods:
        out += ["", "if you can change the method (what trains is no longer the whole model):"]
        out += [f"  {name}: {m.trains}" for name, m in METHODS.items() if any(o.method == name for o in methods)]
        out += table(s, methods, top)
    refused: dict[tuple, list[str]] = {}  # the layouts -> the stand-ins they refuse
    for name, refusing in s.stand_ins.items():
        if refusing:
            refused.setdefault(tuple(refusing), []).append(f"optimizer={name}")
    if s.not_applied or refused:
        out += ["", "does not apply to this config:"]
        out += [f"  {name}: {why}" for name, why in s.not_applied.items()]
        out += [f"  {' or '.join(names)} with {', '.join(refusing)}: refused by its row in trainloop/optim/optimizers.py"
                for refusing, names in refused.items()]
    out += ["", "assumptions:"] + [f"  {line}" for line in assumption_lines(s)]
    return "\n".join(wrap(line) for line in out)


def table(s: Suggestion, options: list[Option], top: int) -> list[str]:
    """A row of numbers per option, its overrides (what to add to the command line) on the lines below."""
    if not options:
        return []
    out = [f"  {'#':>3}  {'step ~':>8} {'tokens/s':>9}  {'memory':>10}  {'compute':>8} {'comm':>7}  layout"]
    for i, o in enumerate(options[:top or None], 1):
        t = o.time
        out.append(f"  {i:>3}  {_seconds(t.total):>8} {s.global_batch * s.seq_len / t.total:>9,.0f}  "
                   f"{_gib(o.memory):>10}  {_seconds(t.compute):>8} {_seconds(t.total - t.compute):>7}  {o.name}")
        out.append(" " * 7 + " ".join(o.overrides))
    if top and len(options) > top:
        out.append(f"  ... {len(options) - top} more fit (--top 0 lists them all)")
    return out


def wrap(line: str) -> str:
    """The line in lines of at most WIDTH characters, each continuation indented 2 past the line's own
    indent; an override (no spaces) is never split."""
    indent = " " * (len(line) - len(line.lstrip()) + 2)
    return "\n".join(textwrap.wrap(line, WIDTH, subsequent_indent=indent, break_long_words=False,
                                   break_on_hyphens=False)) or line


def _seconds(x: float) -> str:
    return f"{x:.2f}s" if x >= 0.1 else f"{x * 1e3:.3g}ms"


def to_json(s: Suggestion) -> dict:
    def option(o: Option) -> dict:
        return {"layout": o.name, "method": o.method, "overrides": o.overrides, "micro_batch": o.micro_batch,
                "accumulation": o.accumulation, "checkpointing": o.checkpointing, "fits": o.fits,
                "memory_bytes": o.memory, "verdict": o.verdict, "biggest": o.biggest_line(),
                "step_seconds": {**asdict(o.time), "total": o.time.total},
                "tokens_per_second": s.global_batch * s.seq_len / o.time.total,
                "peak": {w: o.plan.peak(w) for w in ("gpu", "cpu", "nvme")},
                "traffic": [asdict(x) for x in o.plan.traffic]}

    return {"num_params": s.num_params, "cluster": asdict(s.cluster), "global_batch": s.global_batch,
            "seq_len": s.seq_len, "flops_per_token": s.flops_per_token, "peak_tflops": s.peak_tflops,
            "assumptions": {**s.values, "lines": assumption_lines(s)}, "usable_fraction": GPU_USABLE,
            "fits": [option(o) for o in s.fitting], "does_not_fit": [option(o) for o in s.not_fitting()],
            "methods": [option(o) for o in s.fitting_methods], "does_not_apply": s.not_applied,
            "stand_ins_refused": s.stand_ins, "dropped_overrides": s.dropped}


# ---------------------------------------------------------------------------------------------
# The command line: python -m trainloop.plan is the planner's parser with these arguments added


def add_arguments(parser) -> None:
    group = parser.add_argument_group("--suggest: the layouts that fit, fastest first")
    group.add_argument("--suggest", action="store_true", help="plan every layout for --gpus GPUs and list those that fit")
    group.add_argument("--gpus", type=int, default=None, help="GPUs in all (with --suggest)")
    group.add_argument("--nodes", type=int, default=1, help="nodes they are spread over, evenly (default 1)")
    group.add_argument("--global-batch", type=int, default=None, metavar="SEQUENCES",
                       help="sequences per optimizer step (default: the config's batch x accumulation x data-parallel ranks)")
    group.add_argument("--top", type=int, default=15, help="rows of the table (0: all)")
    for key, a in ASSUMPTIONS.items():
        if a.flag in ("--cpu-memory",):  # plan's own flag, read for the host RAM
            continue
        kind = str if key == "gpu" else float
        default = f"{a.default} {a.unit}".strip() if a.default != "" else "--gpu's, from the table"
        group.add_argument(a.flag, dest=f"assume_{key}", type=kind, default=a.default or None,
                           metavar="NAME" if key == "gpu" else "N", help=f"{a.why} (default {default})")


def problem(args) -> str | None:
    """The first flag that cannot work with --suggest, in a line naming it; None if all can."""
    if args.gpus is None:
        return "--suggest needs --gpus N: the GPUs to plan for"
    checks = [(args.gpus < 1, f"--gpus {args.gpus} must be 1 or more"),
              (args.nodes < 1 or args.gpus % args.nodes, f"--nodes {args.nodes} must divide --gpus {args.gpus} "
                                                          "(the same GPUs on every node)"),
              (args.global_batch is not None and args.global_batch < 1,
               f"--global-batch {args.global_batch} must be 1 or more"),
              (args.world_size is not None,
               "--world-size with --suggest: the layouts are planned for --gpus; drop --world-size"),
              (bool(args.measure),
               "--measure with --suggest: measure one layout by running its overrides with --measure"),
              (args.top < 0, f"--top {args.top} must be 0 (all) or more"),
              (not 0 < args.assume_mfu <= 1, f"--mfu {args.assume_mfu} must be in (0, 1]")]
    checks += [(getattr(args, f"assume_{k}") <= 0, f"{ASSUMPTIONS[k].flag} {getattr(args, f'assume_{k}')} must be "
                "greater than 0") for k in ("intra_node_gbs", "inter_node_gbs", "pcie_gbs", "cpu_optimizer_gparams")]
    return next((say for bad, say in checks if bad), None)


def describe_cluster(args) -> Cluster:
    """The GPUs planned for: --gpu-memory describes them, else this machine's are read (trainloop.observe.hardware)."""
    device = "cpu" if args.device == "cpu" else "cuda"
    ram_default = ASSUMPTIONS["host_ram_gib"].default
    if device == "cpu":
        from trainloop.observe import hardware

        ram = int(args.cpu_memory * GIB) if args.cpu_memory else hardware.host_facts()["ram_available"]
        return Cluster(args.gpus, args.nodes, "cpu", None, "CPU", ram, "--cpu-memory" if args.cpu_memory else "this machine")
    if args.gpu_memory is not None:
        ram = int((args.cpu_memory or ram_default) * GIB)
        return Cluster(args.gpus, args.nodes, "cuda", int(args.gpu_memory * GIB), f"GPUs of {args.gpu_memory:g} GiB", ram,
                       "--cpu-memory" if args.cpu_memory else f"assumed: {ASSUMPTIONS['host_ram_gib'].flag}")
    from trainloop.observe import hardware

    gpus = hardware.read_gpus(with_topology=False).gpus
    if not gpus or not all(g.memory_total for g in gpus):
        raise ConfigError("--suggest found no GPU here: describe them with --gpu-memory GiB (or plan CPU processes "
                          "with --device cpu)")
    small = min(gpus, key=lambda g: g.memory_total)
    ram = int(args.cpu_memory * GIB) if args.cpu_memory else hardware.host_facts()["ram_total"]
    return Cluster(args.gpus, args.nodes, "cuda", small.memory_total, small.name, ram, "this machine")


def run(args) -> Suggestion:
    values = {key: getattr(args, f"assume_{key}", None) for key in ASSUMPTIONS if key != "host_ram_gib"}
    values["host_ram_gib"] = args.cpu_memory or ASSUMPTIONS["host_ram_gib"].default
    return suggest(args.overrides, describe_cluster(args), values, args.global_batch)


def main(argv: list[str] | None = None) -> int:
    """`python -m trainloop.plan`: with --suggest the layouts, else the planner's own report."""
    parser = planner.build_parser()
    add_arguments(parser)
    args = parser.parse_args(argv)
    if not args.suggest and args.gpus is None:
        return planner.run(parser, args)
    say = problem(args) if args.suggest else "--gpus plans layouts with --suggest: add --suggest"
    if say:
        print(f"trainloop.plan: error: {say}", file=sys.stderr)
        return 2
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        found = run(args)
    except ConfigError as err:
        print(f"trainloop.plan: error: {str(err).replace(chr(10), ' ')}", file=sys.stderr)
        return 2
    print(json.dumps(to_json(found), indent=2, default=str) if args.json else render(found, args.top))
    return 0
