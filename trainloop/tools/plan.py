"""`python -m trainloop.plan [options] [overrides]`: will this run fit, before it is started?

The model is built on the meta device (shapes, no weights). From the parameter shapes, the
optimizer, the precision, the ZeRO stage, the offload targets and the world size it predicts
the bytes each process needs on the GPU, in CPU RAM and on NVMe:

- parameters, gradients and optimizer states: exact for a plain run (counted from the shapes:
  AdamW 8 B/param plus a 4-byte step per tensor, 8-bit AdamW 2 B plus block scales, Adafactor
  its factored row/column statistics, SGD 4 B); under DeepSpeed the ZeRO paper's formulas:
  16-bit weights and gradients (2 + 2 B) and fp32 master weights plus optimizer states
  (K = 12 B for AdamW), stage 1 partitioning the optimizer states over the world size,
  stage 2 also the gradients, stage 3 also the parameters; offload moves them to CPU or NVMe;
  under FSDP2 (fsdp=full_shard) each process's fp32 shards of the parameters, their gradients and
  optimizer state (exact: rows split over the world size), the gathered block(s) and unsharded
  gradients of the block being computed, and with fsdp.offload=cpu the shards in CPU memory
  (each strategy states its own lines: memory_lines in trainloop/parallel/);
- activations for the micro-batch and sequence length, per layer of the transformer's shape,
  with and without gradient checkpointing (coefficients of Hugging Face's Llama and GPT-2
  code, checked against saved-tensor measurements in tests/test_plan.py);
- the loss: the full logits' two gradients at the start of the backward, or, with
  trainer.loss_chunk_tokens, one chunk's logits and the output layer's gradient made in the
  forward (trainloop/objectives/chunked_loss.py); a note gives the loss's memory both ways;
- the optimizer step's temporaries, DDP's gradient buckets, DeepSpeed's buffers (estimates).

Then it compares them with this machine (trainloop.hardware, as the doctor reads it) for the
config and for every preset in conf/preset/. `--measure N` also runs N real steps here and
prints what they used. Apart from memory, each strategy counts what one process sends per
optimizer step (traffic_lines: its collectives, offload's PCIe copies). `--suggest` (the same
command, trainloop/tools/suggest.py) plans every layout for described GPUs. The model's shape is
trainloop/tools/shape.py's; `--measure` runs trainloop/tools/measure.py.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, dataclass

from trainloop.config.compose import CONFIG_DIR, ConfigError, compose_config
from trainloop.objectives import OBJECTIVES
from trainloop.parallel import context_size, row
from trainloop.parallel.memory import Line, MemoryPlan, activation_bytes, context_parallel_traffic
from trainloop.parallel.tp import layout_problem
from trainloop.tools.measure import measure_training
from trainloop.tools.shape import ModelShape, model_shape

GIB = 1024**3

def presets() -> list[str]:
    return sorted(p.stem for p in (CONFIG_DIR / "preset").glob("*.yaml"))


# ---------------------------------------------------------------------------------------------
# Model states: parameters, gradients, optimizer states (their sizes: trainloop/optim/optimizers.py's table)


def loss_lines(plan: MemoryPlan, cfg, shape: ModelShape, dev: str, autocast: bool, batch: int) -> None:
    """What the loss holds beyond the saved activations, at the start of the backward, when the
    activations are all still held (estimates, fp32 cross-entropy):
    - the full logits (trainer.loss_chunk_tokens=0): the gradient of the log-softmax output and
      the logits' own gradient, 4 B x vocabulary per token each;
    - chunked (trainloop/objectives/chunked_loss.py): the output layer's fp32 gradient, made in the forward and
      held until the backward (when the output layer trains), the hidden states' gradient, and
      one chunk's fp32 logits twice (the logits and the log-sum-exp's temporary), with the 16-bit
      copy of the output weight under autocast.
    The note gives the logits term both ways."""
    V, h, chunk = shape.vocab, shape.hidden, cfg.trainer.loss_chunk_tokens
    tokens = batch * cfg.data.seq_len // context_size(cfg)  # a forward's sequences (a preference pair is two)
    head_trains = shape.trainable is None  # an adapter freezes the output layer

    def chunked(c: int) -> int:
        return ((4 * V * h if head_trains else 0) + 4 * h * tokens + 8 * min(c, tokens) * V
                + (2 * V * h if autocast else 0))

    if chunk:
        plan.lines.append(Line("chunked loss", chunked(chunk), dev, "forward/backward", exact=False,
                               note=f"{min(chunk, tokens)} tokens x {V:,} fp32 logits at a time"
                               + (", the output layer's gradient" if head_trains else "")))
    else:
        plan.lines.append(Line("logits' gradients", 8 * V * tokens, dev, "forward/backward", exact=False,
                               note=f"{tokens} tokens x {V:,} fp32, twice, at the start of the backward"))
    example = chunk or 1024
    plan.notes.append(f"the loss: {_gib(12 * V * tokens)} through the full logits (the log-softmax kept, its "
                      f"gradients); {_gib(chunked(example))} with trainer.loss_chunk_tokens={example}")


def plan_memory(cfg, shape: ModelShape, world_size: int, device: str, procs_per_node: int | None = None,
                label: str = "config") -> MemoryPlan:
    """Per-process bytes on GPU, CPU and NVMe for this config, world size and device: the strategy's
    model states (trainloop.parallel's memory_lines), then the activations."""
    n, t = shape.num_params, shape.num_trainable  # all, and those with gradients and optimizer state
    dev = "gpu" if device == "cuda" else "cpu"
    plan = MemoryPlan(label, world_size, procs_per_node or world_size, device, n)
    half = cfg.precision.name in ("bf16", "fp16", "fp8")
    add = plan.lines.append
    if shape.trainable is not None:
        plan.notes.append(f"adapter={cfg.adapter.name}: {t / 1e6:,.2f}M parameters train, "
                          f"{(n - t) / 1e6:,.1f}M are frozen (no gradients, no optimizer state)")
    strategy = row(cfg)
    strategy.memory_lines(plan, cfg, shape, world_size, dev, half)  # parameters, gradients, optimizer states, buffers
    strategy.traffic_lines(plan, cfg, shape, world_size, half)  # what each process sends per step: not memory
    objective = OBJECTIVES[cfg.objective.name]
    objective.memory_lines(plan, cfg)  # what the objective holds itself: DPO's reference copy
    batch = cfg.data.batch_size * objective.sequences  # a forward's sequences: a preference pair is two

    autocast = half and strategy.autocast  # the others compute on 16-bit copies of the parameters
    fp8 = cfg.precision.name == "fp8"
    tp, sp = strategy.tensor_parallel(cfg)
    blocks, outputs = strategy.activations_held(cfg, shape)
    cp = context_size(cfg)
    if cp > 1:
        plan.traffic.append(context_parallel_traffic(shape, batch, cfg.data.seq_len, half, cp,
                                                     cfg.model.gradient_checkpointing,
                                                     cfg.trainer.gradient_accumulation_steps))

    def activations(checkpointing: bool) -> tuple[int, int]:  # this run's, with or without checkpointing
        return activation_bytes(shape, batch, cfg.data.seq_len, half, autocast=autocast, checkpointing=checkpointing,
                                attention=cfg.model.attn_implementation, chunked=cfg.trainer.loss_chunk_tokens > 0,
                                fp8=fp8, tp=tp, sequence_parallel=sp,
                                blocks=blocks, outputs=outputs, cp=cp)

    saved, recompute = activations(cfg.model.gradient_checkpointing)
    if fp8:
        plan.notes.append("precision=fp8: the blocks' linear weights are cast to float8 (1 B/param) for the matmuls "
                          "and kept for the backward; torchao's float8 inputs are counted at 16 bits (an overestimate)")
    offloaded = cfg.trainer.activation_offload and dev == "gpu"  # on the CPU they are in host memory already
    add(Line("activations", saved, "cpu" if offloaded else dev, "forward/backward", exact=False,
             note=f"micro-batch {batch} x {cfg.data.seq_len} tokens"
                  + (", gradient checkpointing" if cfg.model.gradient_checkpointing else "")
                  + (f", attention{'' if shape.num_experts else ' and MLP'} inner tensors 1/{tp} (tensor parallel)"
                     if tp > 1 else "")
                  + (f", norms and residual stream 1/{tp} (sequence parallel)" if sp else "")
                  + (f", 1/{cp} of every sequence (context parallel)" if cp > 1 else "")
                  + (", offloaded to pinned host memory (trainer.activation_offload)" if offloaded else "")))
    if shape.vision is not None:
        vision_lines(plan, cfg, shape, dev, half, autocast)
    if offloaded:
        add(Line("activations in flight", saved // max(1, shape.num_layers), dev, "forward/backward", exact=False,
                 note="about a block's worth on the device while it is copied out or back"))
    if outputs:  # a pipeline stage without the output layer takes no loss
        loss_lines(plan, cfg, shape, dev, autocast, batch)
    if recompute:
        add(Line("recomputed layer", recompute, dev, "forward/backward", exact=False,
                 note="one layer's activations, rebuilt during the backward pass"))
    if not cfg.model.gradient_checkpointing:
        without = saved
        with_gc = sum(activations(True))
        plan.notes.append(f"activations {_gib(without)}; with model.gradient_checkpointing=true {_gib(with_gc)}")
    else:
        without = activations(False)[0]
        plan.notes.append(f"activations {_gib(saved + recompute)} with gradient checkpointing; "
                          f"{_gib(without)} without")
    return plan


def vision_lines(plan: MemoryPlan, cfg, shape: ModelShape, dev: str, half: bool, autocast: bool) -> None:
    """A vision-language model's own: its vision tower's activations for the micro-batch's images (one image a
    row assumed: the rows say how many), as a GPT-2-like encoder over each image's patches keeps them, and a note
    of the tower's parameters (counted with the model's above) and the image tokens a row holds."""
    rows = cfg.data.batch_size
    patches = shape.image_patches or 1
    saved, _ = activation_bytes(shape.vision, rows, patches, half, autocast=autocast,
                                checkpointing=cfg.model.gradient_checkpointing, attention="eager", chunked=True,
                                outputs=0)
    plan.lines.append(Line("vision tower activations", saved, dev, "forward/backward", exact=False,
                           note=f"{rows} image(s) a micro-batch (one a row) x {patches} patches, "
                                f"{shape.vision.num_layers} blocks {shape.vision.hidden} wide"))
    tokens = (f"{shape.image_tokens} image tokens an image of each row's {cfg.data.seq_len}" if shape.image_tokens
              else "an image's tokens as its processor decides (by its size)")
    plan.notes.append(f"vision tower and projector: {shape.vision_params / 1e6:,.2f}M of the "
                      f"{shape.num_params / 1e6:,.2f}M parameters; {tokens}")


# ---------------------------------------------------------------------------------------------
# Against this machine


@dataclass
class Machine:
    device: str  # cuda or cpu
    gpu_memory: int | None  # the smallest GPU's, bytes
    gpu_name: str | None
    ram_available: int
    ram_total: int
    nvme_free: int | None
    source: str


GPU_USABLE = 0.92  # the CUDA context, NCCL and allocator fragmentation take the rest
RUNTIME_RAM = 1 * GIB  # python, torch and the data of one process: what the lines above leave out


def read_machine(cfg, device: str = "auto", gpu_memory_gib: float | None = None,
                 cpu_memory_gib: float | None = None) -> Machine:
    from trainloop.observe import hardware

    report = hardware.read_gpus(with_topology=False) if gpu_memory_gib is None and device != "cpu" else None
    gpus = report.gpus if report else []
    host = hardware.host_facts()
    nvme_path = row(cfg).settings(cfg).get("deepspeed.nvme_path")
    nvme = hardware.disk_facts(nvme_path)["free"] if nvme_path else None
    if device == "auto":
        device = "cuda" if gpus or gpu_memory_gib else "cpu"
    if gpu_memory_gib is not None:
        memory, name, source = int(gpu_memory_gib * GIB), f"GPUs of {gpu_memory_gib:g} GiB", "--gpu-memory"
    elif gpus and all(g.memory_total for g in gpus):
        small = min(gpus, key=lambda g: g.memory_total)
        memory, name, source = small.memory_total, small.name, report.source
    else:
        memory, name, source = None, None, "no GPU found" if not gpus else report.source
    ram_available, ram_total = host["ram_available"], host["ram_total"]
    if cpu_memory_gib is not None:
        ram_available = ram_total = int(cpu_memory_gib * GIB)
        source += ", --cpu-memory"
    return Machine(device, memory, name, ram_available, ram_total, nvme, source)


def verdict(plan: MemoryPlan, machine: Machine) -> tuple[bool | None, list[str]]:
    """(fits, one line per resource with the numbers). None: cannot tell (no GPU size known)."""
    fits, lines, node = True, [], plan.procs_per_node
    if plan.device == "cuda":
        need = plan.peak("gpu")
        if machine.gpu_memory is None:
            fits = None
            lines.append(f"GPU: {_gib(need)} per process; GPU memory unknown (give --gpu-memory GiB)")
        else:
            usable = GPU_USABLE * machine.gpu_memory
            ok = need <= usable
            fits &= ok
            lines.append(f"GPU: {_gib(need)} per process of {_gib(usable)} usable on {machine.gpu_name} "
                         f"({'fits' if ok else 'does NOT fit'})")
    ram = node * (plan.peak("cpu") + RUNTIME_RAM)
    ok = ram <= machine.ram_available
    fits = fits and ok if fits is not None else None if ok else False
    lines.append(f"CPU RAM: {_gib(ram)} for {node} process(es) ({_gib(plan.peak('cpu'))} each + "
                 f"{_gib(RUNTIME_RAM)} runtime) of {_gib(machine.ram_available)} available "
                 f"({'fits' if ok else 'does NOT fit'})")
    if plan.peak("nvme"):
        disk = node * plan.peak("nvme")
        ok = machine.nvme_free is not None and disk <= machine.nvme_free
        fits = fits and ok if fits is not None else None if ok else False
        lines.append(f"NVMe: {_gib(disk)} for {node} process(es) of "
                     f"{_gib(machine.nvme_free) if machine.nvme_free is not None else '?'} free at "
                     f"deepspeed.nvme_path ({'fits' if ok else 'does NOT fit'})")
    return fits, lines


# ---------------------------------------------------------------------------------------------
# The command


def _gib(n: float | None) -> str:
    if n is None:
        return "?"
    return f"{n / GIB:.2f} GiB" if n >= 0.01 * GIB else f"{n / 1024**2:.2f} MiB"


def without_preset(overrides: list[str]) -> list[str]:
    return [o for o in overrides if not o.lstrip("+~").startswith("preset=")]


def build_report(overrides: list[str], world_size: int, procs_per_node: int | None, device: str,
                 gpu_memory_gib: float | None, cpu_memory_gib: float | None = None,
                 compare_presets: bool = True) -> dict:
    cfg = compose_config(overrides)
    machine = read_machine(cfg, device, gpu_memory_gib, cpu_memory_gib)
    cache: dict[str, ModelShape] = {}

    def shape_of(c) -> ModelShape:
        from omegaconf import OmegaConf

        key = OmegaConf.to_yaml(c.model) + str(c.data.tokenizer)
        if key not in cache:
            cache[key] = model_shape(c)
        return cache[key]

    def one(c, label: str) -> dict:
        tp = row(c).tensor_parallel(c)[0]
        if layout_problem(tp, world_size):  # a mesh these processes cannot form
            raise ConfigError(layout_problem(tp, world_size))
        plan = plan_memory(c, shape_of(c), world_size, machine.device, procs_per_node, label)
        fits, lines = verdict(plan, machine)
        if c.trainer.auto_batch_size and fits is False:
            lines = [*lines, f"trainer.auto_batch_size=true: the run tries micro-batch {c.data.batch_size} (this plan) "
                             "first and halves it until a step fits, keeping the effective batch"]
        return {"plan": plan, "fits": fits, "verdict": lines, "shape": shape_of(c)}

    report = {"machine": machine, "world_size": world_size, "config": one(cfg, "the config"), "presets": {}}
    if compare_presets:
        base = without_preset(overrides)
        for name in presets():
            try:
                c = compose_config(base + [f"+preset={name}"])
                report["presets"][name] = one(c, f"+preset={name}")
            except ConfigError as err:
                report["presets"][name] = {"error": str(err).replace("\n", " ")}
    return report


def render(report: dict) -> str:
    m, c = report["machine"], report["config"]
    plan: MemoryPlan = c["plan"]
    where_dev = "GPU" if plan.device == "cuda" else "device (CPU)"
    shape: ModelShape = c["shape"]
    experts = (f" ({shape.num_experts} experts per block, {shape.experts_per_token} per token: "
               f"{shape.active_params / 1e6:,.1f}M active)" if shape.num_experts else "")
    out = [f"trainloop plan: {plan.num_params / 1e6:,.1f}M parameters{experts}, {plan.world_size} process(es) "
           f"({plan.procs_per_node} per node), training on {plan.device}", ""]
    out.append(f"  {'per process':<28}{'bytes':>14}  {'where':<6} {'when':<18} note")
    for x in (x for x in plan.lines if x.bytes):
        where = {"gpu": "GPU", "cpu": "CPU", "nvme": "NVMe"}[x.where]
        out.append(f"  {x.what + ('' if x.exact else ' ~'):<28}{_gib(x.bytes):>14}  {where:<6} "
                   f"{x.phase or 'all along':<18} {x.note}")
    out.append("")
    for w, name in (("gpu", where_dev if plan.device == "cuda" else None), ("cpu", "CPU RAM"), ("nvme", "NVMe")):
        if name and (plan.peak(w) or w == "cpu"):
            out.append(f"  peak {name}: {_gib(plan.peak(w))} per process")
    out += [f"  {note}" for note in plan.notes]
    out.append("  (~: an estimate; the rest is exact for a plain run and FSDP2's shards, the ZeRO paper's formula "
               "under DeepSpeed)")
    out += render_traffic(plan)
    out += ["", f"this machine ({m.source}): " + (f"{m.gpu_name} ({_gib(m.gpu_memory)}); " if m.gpu_memory else "")
            + f"RAM {_gib(m.ram_available)} available of {_gib(m.ram_total)}"
            + (f"; NVMe {_gib(m.nvme_free)} free" if m.nvme_free is not None else "")]
    out.append(f"  the config: {_fits(c['fits'])}")
    out += [f"    {line}" for line in c["verdict"]]
    if report["presets"]:
        out += ["", "presets (your overrides + +preset=NAME):"]
        for name, p in report["presets"].items():
            if "error" in p:
                out.append(f"  {name}: does not apply: {p['error']}")
                continue
            out.append(f"  {name}: {_fits(p['fits'])} ({p['plan'].num_params / 1e6:,.1f}M parameters)")
            out += [f"    {line}" for line in p["verdict"]]
    return "\n".join(out)


LINKS = {"dp": "among the data-parallel ranks", "tp": "within each tensor-parallel group",
         "cp": "within each context-parallel group", "ep": "within each expert-parallel group",
         "pp": "between pipeline stages",
         "pcie": "between host and device (PCIe)"}


def render_traffic(plan: MemoryPlan) -> list[str]:
    """The communication section: bytes one process sends per optimizer step (not memory)."""
    if not plan.traffic:
        return ["", "communication per optimizer step: none (one process, nothing offloaded)"]
    out = ["", "communication per optimizer step, bytes each process sends (ring collectives; not memory):",
           f"  {'what':<52}{'bytes':>12}  {'over':<5} note"]
    out += [f"  {x.what:<52}{_gib(x.bytes):>12}  {x.link:<5} {x.note}" for x in plan.traffic if x.bytes]
    out += [f"  total {LINKS[link]}: {_gib(plan.sent(link))}" for link in LINKS if plan.sent(link)]
    if plan.cpu_stepped_params:
        out.append(f"  the optimizer steps {plan.cpu_stepped_params / 1e6:,.1f}M parameters per process on the CPU")
    return out


def _fits(flag: bool | None) -> str:
    return {True: "fits", False: "does NOT fit", None: "cannot tell"}[flag]


def to_json(report: dict) -> dict:
    def part(p: dict) -> dict:
        return p if "error" in p else {"plan": p["plan"].to_dict(), "fits": p["fits"], "verdict": p["verdict"]}

    return {"machine": asdict(report["machine"]), "world_size": report["world_size"],
            "config": part(report["config"]), "presets": {k: part(v) for k, v in report["presets"].items()},
            **({"measured": report["measured"]} if "measured" in report else {})}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m trainloop.plan", description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=None,
                        help="processes in the run (default: $WORLD_SIZE, else 1)")
    parser.add_argument("--nproc-per-node", type=int, default=None,
                        help="processes sharing this machine's RAM and disk (default: the world size)")
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                        help="plan for GPUs or for CPU training (auto: what this machine has)")
    parser.add_argument("--gpu-memory", type=float, default=None, metavar="GIB",
                        help="plan for GPUs of this size instead of this machine's")
    parser.add_argument("--cpu-memory", type=float, default=None, metavar="GIB",
                        help="plan for nodes with this much RAM instead of this machine's available RAM")
    parser.add_argument("--no-presets", action="store_true", help="do not compare the presets")
    parser.add_argument("--measure", type=int, default=0, metavar="STEPS",
                        help="also train STEPS steps here (in each process of a launcher: torchrun "
                             "--nproc_per_node N -m trainloop.plan ...) and print the memory they used")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("overrides", nargs="*", help="the run's config overrides")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    return run(parser, parser.parse_args(argv))


def run(parser: argparse.ArgumentParser, args) -> int:
    """The plan of the config (and the presets), and with --measure the measurement beside it."""
    world_size = args.world_size or int(os.environ.get("WORLD_SIZE", "1"))
    if world_size < 1:
        parser.error("--world-size must be 1 or more")
    if args.measure and world_size != int(os.environ.get("WORLD_SIZE", "1")):
        parser.error("--measure trains here, in the processes launched: for N processes run "
                     "`torchrun --nproc_per_node N -m trainloop.plan --measure STEPS ...` (no --world-size)")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        report = build_report(args.overrides, world_size, args.nproc_per_node, args.device, args.gpu_memory,
                              args.cpu_memory, compare_presets=not args.no_presets)
        if args.measure:
            measured = measure_training(compose_config(args.overrides), args.measure)
            report["measured"] = measured = compare(report["config"]["plan"], measured)
    except ConfigError as err:
        print(f"trainloop.plan: error: {err}", file=sys.stderr)
        return 2
    if int(os.environ.get("RANK", "0")) != 0:  # under a launcher: one report, from rank 0
        return 0
    if args.json:
        print(json.dumps(to_json(report), indent=2, default=str))
    else:
        print(render(report))
        if args.measure:
            for m in report["measured"].get("per_process", [report["measured"]]):
                got = m.get("gpu_training_bytes", m["cpu_training_bytes"])
                print(f"\n{'measured here' if world_size == 1 else 'process %d measured' % m['rank']} over "
                      f"{m['steps']} steps: {_gib(got)} (predicted {_gib(m['predicted_bytes'])}, "
                      f"ratio {m['ratio']:.3f})")
    return 0


def compare(plan: MemoryPlan, measured: dict) -> dict:
    """The prediction beside each process's measurement, and their ratio."""
    for m in measured.get("per_process", [measured]):
        predicted = plan.peak("gpu" if "gpu_training_bytes" in m else "cpu")
        got = m.get("gpu_training_bytes", m["cpu_training_bytes"])
        m["predicted_bytes"], m["ratio"] = predicted, predicted / got
    return measured


if __name__ == "__main__":
    sys.exit(main())
