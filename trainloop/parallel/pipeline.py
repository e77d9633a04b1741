"""Pipeline parallelism (parallel.pp_size > 1): each process holds a slice of the decoder blocks and
passes activations to the next, with torch.distributed.pipelining's schedules (GPipe, 1F1B,
Interleaved 1F1B, as torchtitan runs them).

The model is cut in place: a rank keeps the blocks of its stages under their own names
(`model.layers.5` stays `model.layers.5`), the embedding on the first stage's rank, the final norm
and the output layer on the last's, and drops the rest, so checkpoints and the export hold the
model's own names. A stage's forward is the model's own layers called in turn; every stage gets
the micro-batch's position ids (the schedules pass keyword arguments to every stage), and the
layers attend through trainloop's training attention (trainloop.model.attention), which builds
the packed documents' mask from them, so no stage needs transformers' mask. A step's micro-batches
(trainer.gradient_accumulation_steps) are the schedule's: the last stage takes each one's summed
loss over the step's units, the same sum one process takes. This version pipelines over every
process (pp_size = the process count): the data-parallel dimension, FSDP2 and tensor parallelism
beside it come next.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainloop.errors import ConfigError
from trainloop.parallel.base import Strategy

SCHEDULES = {"1f1b": "Schedule1F1B", "gpipe": "ScheduleGPipe", "interleaved_1f1b": "ScheduleInterleaved1F1B"}


@dataclass
class PipelineConfig:
    """The parallel.* keys of pipeline parallelism."""

    # processes that each hold a slice of the decoder blocks, passing activations on (pipeline
    # parallelism); 1: none. This version needs it to equal the process count
    pp_size: int = 1
    pp_schedule: str = "1f1b"  # the order of the micro-batches' forwards and backwards: 1f1b, gpipe, interleaved_1f1b
    pp_stages_per_rank: int = 1  # stages each process holds (interleaved_1f1b: 2 or more, taken round robin)


def stage_blocks(num_blocks: int, stages: int) -> list[range]:
    """Contiguous blocks per stage, their counts differing by at most one (the earlier stages the larger)."""
    base, extra = divmod(num_blocks, stages)
    bounds = [0]
    for s in range(stages):
        bounds.append(bounds[-1] + base + (s < extra))
    return [range(bounds[s], bounds[s + 1]) for s in range(stages)]


def decoder_parts(model):
    """(the causal LM, its decoder, its blocks) of a model transformers lays out as
    `model.embed_tokens`, `model.layers`, `model.rotary_emb`, `model.norm` and `lm_head` (Llama,
    Qwen, Mistral...), under a peft wrapper or not, or a ConfigError naming the class."""
    model = model.get_base_model() if hasattr(model, "get_base_model") else model  # LoRA: cut the model it wraps
    inner = getattr(model, "model", None)
    wanted = ("embed_tokens", "layers", "rotary_emb", "norm")
    if inner is None or not all(hasattr(inner, part) for part in wanted) or not hasattr(model, "lm_head"):
        raise ConfigError(f"parallel.pp_size: {type(model).__name__}'s blocks cannot be cut into stages here "
                          "(it is not laid out as model.embed_tokens / model.layers / model.rotary_emb / model.norm "
                          "/ lm_head, as Llama is); use model.arch=llama or parallel.pp_size=1")
    return model, inner, inner.layers


def _stage_module(model, first: bool, last: bool, blocks: list[str]):
    import torch

    class Stage(torch.nn.Module):
        """One stage's forward over the cut model's own layers: ids (first stage) or the previous
        stage's hidden states in, hidden states (or, on the last stage, logits) out."""

        def __init__(self):
            super().__init__()
            self.model = model  # registered: the stage's parameters are the model's

        def forward(self, hidden, position_ids, document_mask=None):
            inner = self.model.model
            if first:
                hidden = inner.embed_tokens(hidden)
            position_embeddings = inner.rotary_emb(hidden, position_ids=position_ids)
            for name in blocks:
                hidden = inner.layers[name](hidden, attention_mask=None, position_ids=position_ids,
                                            position_embeddings=position_embeddings, use_cache=False,
                                            document_mask=document_mask)
            if last:
                hidden = self.model.lm_head(inner.norm(hidden))
            return hidden

    return Stage()


class Pipeline(Strategy):
    name = "pipeline"

    def __init__(self, cfg, accelerator):
        super().__init__(cfg, accelerator)
        p = cfg.parallel
        self.pp, self.per_rank = p.pp_size, p.pp_stages_per_rank
        self.num_stages = self.pp * self.per_rank
        if accelerator.num_processes != self.pp:
            raise ConfigError(f"parallel.pp_size={self.pp} with {accelerator.num_processes} process(es): this version "
                              "pipelines over every process; launch parallel.pp_size processes")
        rank = accelerator.process_index
        self.stage_ids = [rank + k * self.pp for k in range(self.per_rank)]  # round robin: the interleaved order
        self.last_rank = (self.num_stages - 1) % self.pp
        self.stages, self.schedule, self.blocks = [], None, []
        self._scale = None  # the step's 1 / units, read by the loss on the last stage

    @property
    def dp_size(self) -> int:
        return 1

    @property
    def dp_rank(self) -> int:
        return 0

    def reduce_sum(self, tensor):
        return tensor  # one data-parallel rank: every stage reads the same batches

    # -- the build -------------------------------------------------------------------------------
    def shard(self, model):
        """Cut the model in place to this rank's stages, and build them and the schedule."""
        import torch
        from torch.distributed import pipelining

        causal, inner, layers = decoder_parts(model)
        if len(layers) < self.num_stages:
            raise ConfigError(f"parallel.pp_size={self.pp} x parallel.pp_stages_per_rank={self.per_rank}: "
                              f"{self.num_stages} stages but the model has {len(layers)} blocks; use fewer stages")
        if model.get_output_embeddings().weight is model.get_input_embeddings().weight:
            raise ConfigError("parallel.pp_size: the model ties its output layer to its input embedding, which "
                              "would live on two stages; set model.tie_embeddings=false (or parallel.pp_size=1)")
        self.blocks = stage_blocks(len(layers), self.num_stages)
        self.whole_groups = optimizer_groups(self.cfg.optimizer, model)  # a whole model's checkpoint maps by them
        kept = sorted(i for s in self.stage_ids for i in self.blocks[s])
        inner.layers = torch.nn.ModuleDict({str(i): layers[i] for i in kept})  # the blocks keep their names
        first, last = 0 in self.stage_ids, self.num_stages - 1 in self.stage_ids
        if not first:
            inner.embed_tokens = None
        if not last:
            inner.norm, causal.lm_head = None, None
        model.to(self.device)
        self.stages = [pipelining.PipelineStage(
            _stage_module(causal, s == 0, s == self.num_stages - 1, [str(i) for i in self.blocks[s]]),
            s, self.num_stages, self.device) for s in self.stage_ids]
        schedule = getattr(pipelining, SCHEDULES[self.cfg.parallel.pp_schedule])
        micro = self.cfg.trainer.gradient_accumulation_steps
        self.schedule = schedule(self.stages if self.per_rank > 1 else self.stages[0], n_microbatches=micro,
                                 loss_fn=self._loss, scale_grads=False)
        return model

    def prepare(self, model, optimizer):
        return model, self.accelerator.prepare(optimizer)  # each rank steps its own stages' parameters

    def _loss(self, logits, labels):
        from trainloop.objectives.chunked_loss import summed_nll

        return summed_nll(logits, labels) * self._scale

    # -- each step -------------------------------------------------------------------------------
    def forward_backward(self, objective, model, group: list[dict], units, forward_context, alone: bool = False):
        """The schedule runs the step's micro-batches; the last stage's losses (each summed over its
        targets / the step's units) are summed and sent to every rank."""
        import torch
        import torch.distributed as dist

        self._scale = 1.0 / units
        ids = torch.cat([b["input_ids"] for b in group])
        labels = torch.cat([b["labels"] for b in group])
        inputs = stage_inputs(model, group)
        losses = []
        with forward_context(), self.accelerator.autocast():
            args = (ids,) if 0 in self.stage_ids else ()
            self.schedule.step(*args, **inputs, target=labels, losses=losses, return_outputs=False)
        step_loss = torch.stack(losses).sum().detach() if losses else torch.zeros((), device=self.device)
        dist.broadcast(step_loss, src=self.last_rank)
        return step_loss

    def eval_sums(self, objective, model, batch: dict):
        """The stages' forwards in order (activations sent on between ranks), the summed loss and
        units taken on the last, and sent to every rank."""
        import torch
        import torch.distributed as dist

        from trainloop.objectives.base import loss_sums
        from trainloop.objectives.chunked_loss import summed_nll

        inputs = stage_inputs(model, [batch])
        hidden = batch["input_ids"]
        rank = self.accelerator.process_index
        with self.accelerator.autocast():
            for s in range(self.num_stages):
                owner, before, after = s % self.pp, (s - 1) % self.pp, (s + 1) % self.pp
                if owner != rank:
                    continue
                if s > 0 and before != rank:
                    hidden = receive(batch["input_ids"].shape + (model.config.hidden_size,), before, self.device)
                hidden = self.stages[self.stage_ids.index(s)].submod(hidden, **inputs)
                if s < self.num_stages - 1 and after != rank:
                    send(hidden, after)
        if self.num_stages - 1 in self.stage_ids:
            sums = loss_sums(summed_nll(hidden, batch["labels"]), objective.count(batch))
        else:
            sums = torch.zeros(2, dtype=torch.float64, device=self.device)
        dist.broadcast(sums, src=self.last_rank)
        return sums

    def clip_grad_norm(self, model, max_norm: float):
        """The norm over every stage's gradients (summed squares over the ranks), the same on each."""
        import torch
        import torch.distributed as dist

        params = [p for p in model.parameters() if p.grad is not None]
        local = torch.nn.utils.get_total_norm([p.grad for p in params], 2.0) if params else torch.zeros(())
        squared = local.to(self.device, torch.float32) ** 2
        dist.all_reduce(squared)
        norm = squared.sqrt()
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
        return norm

    # -- state -----------------------------------------------------------------------------------
    def save_state(self, directory, model, adapter_only: bool) -> None:
        from trainloop.parallel import dcp

        dcp.save(directory, model, self.accelerator._optimizers[0], adapter_only, flatten=True)
        dcp.save_rank_states(self.accelerator, directory)

    def load_state(self, path, model, adapter_only: bool) -> None:
        """A pipeline's checkpoint (DCP, by name) at any number of stages, or one process's (accelerate's
        files, the whole model): each rank takes its stages' tensors."""
        from pathlib import Path

        from trainloop.parallel import dcp

        if (Path(path) / dcp.MODEL_DIR).is_dir():
            dcp.load(path, model, self.accelerator._optimizers[0], adapter_only, flatten=True)
        else:
            load_whole(Path(path), model, self.accelerator._optimizers[0], self.whole_groups, adapter_only)
        dcp.load_rank_states(self.accelerator, path)

    def full_state_dict(self, model) -> dict:
        """Every rank's stages, gathered on the main process (CPU tensors, the model's own names)."""
        import torch.distributed as dist

        mine = {name: tensor.detach().cpu() for name, tensor in model.state_dict().items()}
        gathered = [None] * self.world_size if self.accelerator.is_main_process else None
        dist.gather_object(mine, gathered, dst=0)
        return {k: v for part in gathered for k, v in part.items()} if gathered else {}

    def whole_model(self, model):
        """This rank holds its stages only: the whole model's modules, on the meta device (no memory),
        with the live configs, for the export to name every stage's tensors (peft walks the modules)."""
        import torch
        from transformers import AutoModelForCausalLM

        from trainloop.model.adapter import wrap_lora

        causal = decoder_parts(model)[0]
        with torch.device("meta"):
            whole = AutoModelForCausalLM.from_config(causal.config)
        whole.config, whole.generation_config = causal.config, causal.generation_config
        return wrap_lora(whole, self.cfg.adapter) if model is not causal else whole

    def describe(self, model) -> str:
        counts = "/".join(str(len(self.blocks[s])) for s in range(self.num_stages))
        return (f"pipeline: {self.num_stages} stages over {self.pp} processes ({self.cfg.parallel.pp_schedule}), "
                f"blocks per stage {counts}, this rank's stages {self.stage_ids} ({self.where()})")

    # -- the planner's terms ---------------------------------------------------------------------
    @staticmethod
    def memory_lines(plan, cfg, shape, world_size: int, dev: str, half: bool) -> None:
        """A stage's share of the blocks' parameters, gradients and optimizer states (the embedding
        and output layer counted whole, as the first and last stages hold them)."""
        from trainloop.optim.optimizers import planned_state_bytes
        from trainloop.parallel.memory import Line

        add, n, t = plan.lines.append, shape.num_params, shape.num_trainable
        share = 1 / cfg.parallel.pp_size
        add(Line("parameters", round(4 * n * share), dev, exact=False,
                 note=f"fp32, 1/{cfg.parallel.pp_size} of the blocks on each stage"))
        add(Line("gradients", round(4 * t * share), dev, exact=False, note="fp32, this stage's"))
        states = planned_state_bytes(cfg.optimizer, shape.trainable_shapes, shape.hidden_matrix)
        add(Line("optimizer states", round(states * share), dev, exact=False,
                 note=f"{cfg.optimizer.name}, this stage's"))

    @staticmethod
    def traffic_lines(plan, cfg, shape, world_size: int, half: bool) -> None:
        """Each micro-batch's activations sent forward and their gradients back, at each stage boundary."""
        from trainloop.parallel.memory import Transfer

        p = cfg.parallel
        boundary = cfg.data.batch_size * cfg.data.seq_len * shape.hidden * (2 if half else 4)
        sent = 2 * boundary * cfg.trainer.gradient_accumulation_steps * p.pp_stages_per_rank
        plan.traffic.append(Transfer("activations and their gradients", sent, "pp",
                                     note="point to point, each micro-batch, forward and backward"))

    @staticmethod
    def settings(cfg) -> dict:
        p = cfg.parallel
        return {"parallel.pp_size": p.pp_size, "parallel.pp_schedule": p.pp_schedule,
                "parallel.pp_stages_per_rank": p.pp_stages_per_rank}

    @staticmethod
    def problems(cfg) -> list[str]:
        """What parallel.pp_size > 1 cannot run (a pretrained model's layout is checked when it is cut)."""
        p = cfg.parallel
        if p.pp_size <= 1:
            return []
        key, found = f"parallel.pp_size={p.pp_size}", []
        if p.pp_schedule == "interleaved_1f1b" and p.pp_stages_per_rank < 2:
            found.append("parallel.pp_schedule=interleaved_1f1b interleaves several stages on each process: "
                         "set parallel.pp_stages_per_rank=2 (or more)")
        elif p.pp_schedule != "interleaved_1f1b" and p.pp_stages_per_rank != 1:
            found.append(f"parallel.pp_stages_per_rank={p.pp_stages_per_rank} with parallel.pp_schedule="
                         f"{p.pp_schedule}: one stage per process; use parallel.pp_schedule=interleaved_1f1b")
        stages = p.pp_size * p.pp_stages_per_rank
        if cfg.trainer.gradient_accumulation_steps < stages:
            found.append(f"{key}: trainer.gradient_accumulation_steps={cfg.trainer.gradient_accumulation_steps} "
                         f"micro-batches a step are fewer than the {stages} stages, which would idle; "
                         f"set trainer.gradient_accumulation_steps={stages} or more")
        if cfg.model.name == "tiny" and cfg.model.num_layers < stages:
            found.append(f"{key}: {stages} stages but model.num_layers={cfg.model.num_layers}; use fewer stages")
        others = {f"deepspeed=zero{cfg.deepspeed.stage}": (cfg.deepspeed.stage, "deepspeed=none"),
                  f"fsdp={cfg.fsdp.name}": (cfg.fsdp.name != "none", "fsdp=none"),
                  f"parallel.tp_size={cfg.parallel.tp_size}": (cfg.parallel.tp_size > 1, "parallel.tp_size=1")}
        found += [f"{key} with {other}: this version pipelines over every process alone; set {off}"
                  for other, (on, off) in others.items() if on]
        unsupported = {
            "objective": (cfg.objective.name != "causal_lm", f"objective={cfg.objective.name}: the pipeline "
                          "trains objective=causal_lm for now; use parallel.pp_size=1"),
            "arch": (cfg.model.name == "tiny" and cfg.model.arch != "llama", f"model.arch={cfg.model.arch}: only "
                     "model.arch=llama is cut into stages for now"),
            "attention": (cfg.model.attn_implementation != "sdpa" or cfg.data.packing == "none",
                          f"model.attn_implementation={cfg.model.attn_implementation} with data.packing="
                          f"{cfg.data.packing}: stages attend through trainloop's sdpa attention, which needs "
                          "data.packing=documents or stream and model.attn_implementation=sdpa"),
            "chunk": (cfg.trainer.loss_chunk_tokens > 0, "trainer.loss_chunk_tokens: the last stage takes the "
                      "loss from the full logits for now; set trainer.loss_chunk_tokens=0"),
            "prompts": (bool(cfg.eval.prompts), "eval.prompts: generation across stages is not built; set "
                        "eval.prompts=[]"),
            "fp16": (cfg.precision.name in ("fp16", "fp8"), f"precision={cfg.precision.name}: use bf16 or fp32"),
            "auto": (cfg.trainer.auto_batch_size, "trainer.auto_batch_size: its trials run the whole model on one "
                     "process; set data.batch_size yourself"),
            "compile": (cfg.compile.backend != "none" and not cfg.compile.regional, "compile of the whole model: "
                        "stages call the blocks themselves; set compile.regional=true"),
            "quantized": (cfg.model.quantization != "none", f"model.quantization={cfg.model.quantization}: "
                          "quantized base weights are not cut into stages yet; use model.quantization=none"),
            "tied": (cfg.model.name == "tiny" and cfg.model.tie_embeddings, "model.tie_embeddings=true: the output "
                     "layer and the input embedding would live on two stages; set model.tie_embeddings=false"),
        }
        found += [f"{key} with {message}" for on, message in unsupported.values() if on]
        return found


def optimizer_groups(cfg, model) -> list[list[str]]:
    """The names of the parameters in each group trainloop.optim builds its optimizer on, in order:
    how a checkpoint of the whole model (accelerate's, keyed by position) names its optimizer state."""
    from trainloop.optim.optimizers import optimizer_named

    names = {id(p): name for name, p in model.named_parameters()}
    groups = optimizer_named(cfg.name).groups(model, cfg.weight_decay)
    return [[names[id(p)] for p in group["params"]] for group in groups]


def load_whole(path, model, optimizer, whole_groups: list[list[str]], adapter_only: bool) -> None:
    """A checkpoint of the whole model (one process, or DDP: accelerate's model.safetensors and
    optimizer.bin) into this rank's stages: their weights by name, their optimizer state by the
    position each name had in the whole model's groups (`whole_groups`)."""
    import torch
    from safetensors.torch import load_file

    from trainloop.errors import CheckpointError

    for file in ("model.safetensors", "optimizer.bin"):
        if not (path / file).is_file():
            raise CheckpointError(f"{path / file} is missing: {path} holds neither a pipeline's shards nor "
                                  "a whole model's checkpoint; resume another checkpoint")
    weights = load_file(path / "model.safetensors")
    wanted = [n for n, p in model.named_parameters() if p.requires_grad] if adapter_only else list(model.state_dict())
    missing = [name for name in wanted if name not in weights]
    if missing:
        raise CheckpointError(f"{path / 'model.safetensors'} lacks {missing[:3]} of this stage: it was saved "
                              "with another model or adapter config; start a new run in a new hydra.run.dir")
    model.load_state_dict({name: weights[name] for name in wanted}, strict=not adapter_only)

    saved = torch.load(path / "optimizer.bin", map_location="cpu", weights_only=True)
    position = {name: i for i, name in enumerate(n for group in whole_groups for n in group)}
    group_of = {name: g for g, group in enumerate(whole_groups) for name in group}
    optimizer = getattr(optimizer, "optimizer", optimizer)
    names = {id(p): name for name, p in model.named_parameters()}
    state, groups, index = {}, [], 0
    for group in optimizer.param_groups:
        mine = [names[id(p)] for p in group["params"]]
        hyper = {k: v for k, v in saved["param_groups"][group_of[mine[0]]].items() if k != "params"}
        groups.append({**hyper, "params": list(range(index, index + len(mine)))})
        for name in mine:
            if position[name] in saved["state"]:
                state[index] = saved["state"][position[name]]
            index += 1
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def stage_inputs(model, group: list[dict]) -> dict:
    """What every stage gets of the micro-batches (concatenated; the schedule splits them again):
    their position ids, the plain count where a batch carries none (trainloop.data.loaders.collate),
    and, where some row restarts them, the documents' mask (trainloop.model.attention)."""
    import torch

    from trainloop.model.attention import with_document_mask

    positions = [b["position_ids"] if "position_ids" in b else
                 torch.arange(b["input_ids"].shape[1], device=b["input_ids"].device).expand_as(b["input_ids"])
                 for b in group]
    inputs = {"position_ids": torch.cat(positions)}
    return with_document_mask(model, inputs) if any("position_ids" in b for b in group) else inputs


DTYPES = ("float32", "bfloat16", "float16")


def send(hidden, to: int) -> None:
    """Hidden states to the rank of the next stage: their dtype's code, then themselves."""
    import torch
    import torch.distributed as dist

    code = torch.tensor([DTYPES.index(str(hidden.dtype).removeprefix("torch."))], device=hidden.device)
    dist.send(code, dst=to)
    dist.send(hidden.contiguous(), dst=to)


def receive(shape, source: int, device):
    """What `send` sent from the rank of the previous stage."""
    import torch
    import torch.distributed as dist

    code = torch.zeros(1, dtype=torch.long, device=device)
    dist.recv(code, src=source)
    hidden = torch.empty(shape, dtype=getattr(torch, DTYPES[int(code)]), device=device)
    dist.recv(hidden, src=source)
    return hidden
