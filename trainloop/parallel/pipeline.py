"""Pipeline parallelism (parallel.pp_size > 1): each process holds a slice of the decoder blocks and
passes activations to the next, with torch.distributed.pipelining's schedules (GPipe, 1F1B,
Interleaved 1F1B, as torchtitan runs them).

The model is cut in place: a rank keeps the blocks of its stages under their own names
(`model.layers.5` stays `model.layers.5`), the embedding on the first stage's rank, the final norm
and the output layer on the last's, and drops the rest, so checkpoints and the export hold the
model's own names. A stage's forward is the model's own layers called in turn; every stage gets
the micro-batch's position ids (the schedules pass keyword arguments to every stage), and the
layers attend through trainloop's training attention (trainloop.model.attention), which takes
the micro-batch's packed documents as another input, so no stage needs transformers' mask. A step's micro-batches
(trainer.gradient_accumulation_steps) are the schedule's: the last stage takes each one's summed
loss over the step's units, the same sum one process takes.

The processes form a pp x dp_shard mesh (pp outermost, as torchtitan lays it out): each pipeline
reads its data-parallel rank's share of the global batch, and its stages are replicated over
dp_shard (their gradients summed after the schedule) or, with fsdp=full_shard, sharded over it by
FSDP2 (each block, then each stage as the root of the rest; the schedule reduce-scatters once,
after the last micro-batch). Tensor parallelism inside the stages comes next.
"""

from __future__ import annotations

from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass

from trainloop.errors import ConfigError
from trainloop.model.forwarded import Forwarded
from trainloop.parallel.base import Strategy

OUTPUT_HEADS = {"lm_head": "lm", "score": "score"}  # a model's output head -> its name in trainloop.model.heads
WIDTH_MULTIPLE = 8  # micro-batches of other widths are padded to a multiple of this (same_width)
SCHEDULES = {"1f1b": "Schedule1F1B", "gpipe": "ScheduleGPipe", "interleaved_1f1b": "ScheduleInterleaved1F1B"}


@dataclass
class PipelineConfig:
    """The parallel.* keys of pipeline parallelism."""

    # processes that each hold a slice of the decoder blocks, passing activations on (pipeline
    # parallelism); 1: none. Must divide the process count: the rest form the data-parallel dimension (dp_shard)
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
    """(the model, its decoder, its blocks, the name of its output head) of a model transformers lays out as
    `model.embed_tokens`, `model.layers`, `model.rotary_emb`, `model.norm` and an output head, `lm_head` (Llama,
    Qwen, Mistral...) or a sequence classifier's `score`, under a peft wrapper or not, or a ConfigError naming the
    class."""
    model = model.get_base_model() if hasattr(model, "get_base_model") else model  # LoRA: cut the model it wraps
    inner = getattr(model, "model", None)
    wanted = ("embed_tokens", "layers", "rotary_emb", "norm")
    head = next((name for name in OUTPUT_HEADS if hasattr(model, name)), None)
    if inner is None or not all(hasattr(inner, part) for part in wanted) or head is None:
        raise ConfigError(f"parallel.pp_size: {type(model).__name__}'s blocks cannot be cut into stages here "
                          "(it is not laid out as model.embed_tokens / model.layers / model.rotary_emb / model.norm "
                          "/ lm_head, as Llama is); use model.arch=llama or parallel.pp_size=1")
    return model, inner, inner.layers, head


def _stage_module(causal, head: str, first: bool, last: bool, blocks: list[str], head_loss=None):
    import torch

    class Stage(torch.nn.Module):
        """One stage's forward over the cut model's own layers: ids (first stage) or the previous
        stage's hidden states in, hidden states (or, on the last stage, the output head's: logits, or a
        score head's per-token scores) out. It registers its own parts only (the embedding, its blocks, the
        final norm and output head), so that FSDP2 makes it the root of exactly them."""

        def __init__(self):
            super().__init__()
            inner = causal.model
            self.embed = inner.embed_tokens if first else None
            self.blocks = torch.nn.ModuleDict({name: inner.layers[name] for name in blocks})
            self.rotary = inner.rotary_emb
            self.norm, self.head = (inner.norm, getattr(causal, head)) if last else (None, None)

        def forward(self, hidden, position_ids, document_mask=None, documents=None, labels=None):
            """labels: with trainer.loss_chunk_tokens, the last stage returns the summed loss of its targets,
            `head_loss(final hidden states, output weight, bias, labels)` (the objective's, chunk by chunk),
            never the full logits."""
            if self.embed is not None:
                hidden = self.embed(hidden)
            position_embeddings = self.rotary(hidden, position_ids=position_ids)
            for block in self.blocks.values():
                hidden = block(hidden, attention_mask=None, position_ids=position_ids,
                               position_embeddings=position_embeddings, use_cache=False, document_mask=document_mask,
                               documents=documents)
            if self.head is None:
                return hidden
            if head_loss is not None:  # inside the forward: the weight FSDP2 gathered for it
                return head_loss(self.norm(hidden), self.head.weight, self.head.bias, labels)
            return self.head(self.norm(hidden))

    return Stage()


def each_micro_batch(stage):
    """A plain parent of an FSDP2-sharded stage (fsdp.sync_each_batch=true). Handed an FSDP module,
    torch's PipelineStage turns its gradient sync off for every backward and reduce-scatters once,
    after the last micro-batch, holding the stage's unsharded fp32 gradients until then. Behind a
    plain module it runs a plain backward, and FSDP2's own hooks reduce-scatter each micro-batch's
    gradients into the shards, as FSDP2 alone does."""
    import torch

    class EachMicroBatch(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.stage = stage

        def forward(self, *args, **kwargs):
            return self.stage(*args, **kwargs)

    return EachMicroBatch()


class Pipeline(Strategy):
    name = "pipeline"
    interleaved = True
    off = {"parallel.pp_size": 1, "parallel.pp_schedule": "1f1b", "parallel.pp_stages_per_rank": 1}
    keys = PipelineConfig
    read_when = {f"parallel.{key}": (lambda c: c.parallel.pp_size > 1, "parallel.pp_size > 1")
                 for key in ("pp_schedule", "pp_stages_per_rank")}

    @staticmethod
    def chooses(cfg) -> bool:
        return cfg.parallel.pp_size > 1

    @staticmethod
    def forwards_together(cfg) -> str | None:
        return "a pipeline (parallel.pp_size > 1)"

    @staticmethod
    def layouts(gpus_per_node: int) -> dict[str, dict]:
        """2, 4 and 8 stages (1F1B), FSDP2 over the rest of the GPUs (dp_shard)."""
        return {f"PP{n} x FSDP2": {"parallel.pp_size": n, "fsdp": "full_shard"} for n in (2, 4, 8)}

    @staticmethod
    def model_parallel(cfg) -> int:
        return cfg.parallel.pp_size * cfg.parallel.tp_size

    @staticmethod
    def min_accumulation(cfg) -> int:
        return cfg.parallel.pp_size * cfg.parallel.pp_stages_per_rank  # one micro-batch per stage at least

    @staticmethod
    def bubble(cfg) -> float:
        """(pp_size - 1) / (micro-batches x stages per rank): each stage idles while the first
        micro-batches fill the pipeline and the last drain it (GPipe and 1F1B alike; the interleaved
        schedule's stages are that many times shorter)."""
        p = cfg.parallel
        return (p.pp_size - 1) / (cfg.trainer.gradient_accumulation_steps * p.pp_stages_per_rank)

    def __init__(self, cfg, accelerator):
        p = cfg.parallel
        self.pp, self.per_rank = p.pp_size, p.pp_stages_per_rank
        self.num_stages = self.pp * self.per_rank
        processes, self.tp = accelerator.num_processes, p.tp_size
        if processes % (self.pp * self.tp):
            layout = f"parallel.pp_size={self.pp}" + (f" x parallel.tp_size={self.tp}" if self.tp > 1 else "")
            raise ConfigError(f"{layout} does not divide the {processes} process(es): launch a multiple of "
                              f"{'pp_size x tp_size' if self.tp > 1 else 'parallel.pp_size'} processes (the rest "
                              "form the data-parallel dimension)")
        self.dp = processes // (self.pp * self.tp)
        super().__init__(cfg, accelerator)  # the mesh: pp outermost, tp innermost (trainloop.parallel.mesh)
        self.pp_rank = self.mesh.local_rank("pp")
        self.sharded = cfg.fsdp.name != "none"  # FSDP2 over dp_shard; else each stage replicated over it
        self.stage_ids = [self.pp_rank + k * self.pp for k in range(self.per_rank)]  # round robin: interleaved
        self.last_rank = self.rank_of((self.num_stages - 1) % self.pp)  # the last stage's, in this dp position
        self.schedule, self.width, self.blocks = None, 0, []  # the schedule, of micro-batches this wide (_schedule)
        self.chunk = cfg.trainer.loss_chunk_tokens  # the last stage takes the chunked loss in its forward
        self._scale = None  # what the loss on the last stage is multiplied by this step
        self._objective = None  # whose loss the last stage takes (handed in by the step or the evaluation)
        self._pending = deque()  # (micro-batch, its forward's input ids) whose losses the last stage takes next
        # id(a model) -> its stage modules, in the order of stage_ids: the policy's (whose the schedule runs) and a
        # frozen copy's, whose forwards Strategy.computed runs
        self.forwards: dict[int, list] = {}
        self.policy = 0  # id of the policy
        self.pad_id = None  # the policy's score head's padding id: its output is read at the last token before it

    def rank_of(self, pp_rank: int) -> int:
        """The global rank holding pipeline position `pp_rank` in this process's data-parallel position."""
        return (pp_rank * self.dp + self.dp_rank) * self.tp + self.mesh.local_rank("tp")

    @property
    def dp_size(self) -> int:
        return self.dp

    @property
    def dp_rank(self) -> int:
        return self.mesh.local_rank("dp_shard")

    def reduce_sum(self, tensor):
        """Summed over dp_shard: every stage of a pipeline reads the same batches."""
        import torch.distributed as dist

        if self.dp == 1:
            return tensor
        summed = tensor.clone()
        dist.all_reduce(summed, group=self.mesh.group("dp_shard"))
        return summed

    # -- the build -------------------------------------------------------------------------------
    def shard(self, model):
        """Cut the model in place to this rank's stages and build them (their schedule: _schedule)."""
        causal, _, layers, head = decoder_parts(model)
        if head == "lm_head" and causal.lm_head.weight is model.get_input_embeddings().weight:
            raise ConfigError("parallel.pp_size: the model ties its output layer to its input embedding, which "
                              "would live on two stages; set model.tie_embeddings=false (or parallel.pp_size=1)")
        self.blocks = stage_blocks(len(layers), self.num_stages)
        self.whole_groups = optimizer_groups(self.cfg.optimizer, model)  # a whole model's checkpoint maps by them
        self.pad_id = causal.config.pad_token_id if head == "score" else None  # a score head's rows end before it
        self.policy = id(model)
        modules = self._cut(model, self._chunked_loss if self.chunk else None)
        if self.sharded and self.cfg.fsdp.sync_each_batch:  # each micro-batch's gradients reduce-scattered
            modules = [each_micro_batch(module) for module in modules]
        self.forwards[id(model)] = modules
        return model

    def _schedule(self, width: int):
        """The schedule of micro-batches `width` tokens wide. torch's stages fix their buffers' shapes at their
        first step, so micro-batches of another width (grpo's completions) get stages and a schedule of their
        own, over the same modules."""
        from torch.distributed import pipelining

        if self.schedule is None or self.width != width:
            modules = self.forwards[self.policy]
            stages = [pipelining.PipelineStage(module, s, self.num_stages, self.device, group=self.mesh.group("pp"))
                      for module, s in zip(modules, self.stage_ids)]
            schedule = getattr(pipelining, SCHEDULES[self.cfg.parallel.pp_schedule])
            self.schedule = schedule(stages if self.per_rank > 1 else stages[0],
                                     n_microbatches=self.cfg.trainer.gradient_accumulation_steps, loss_fn=self._loss,
                                     scale_grads=False)
            self.width = width
        return self.schedule

    def prepare_frozen(self, model):
        """A frozen copy (a reference, a teacher) cut into the same stages as the policy, placed and sharded like
        it: its forwards run through them in Strategy.computed, before the schedule (Objective.beside). A teacher
        with other blocks than the policy's is cut into as many stages, by its own count."""
        self.forwards[id(model)] = self._cut(model, None)
        return model.eval()

    def holds_frozen(self, frozen) -> str:
        how = ", each sharded by FSDP2 over dp_shard" if self.sharded else ""
        return f"cut into the pipeline's stages like the policy{how}"

    def _cut(self, model, head_loss) -> list:
        """The model cut in place to this rank's stages (their blocks under their own names), on the device, split
        over tp and sharded over dp_shard as configured: its stage modules, in the order of stage_ids."""
        import torch

        causal, inner, layers, head = decoder_parts(model)
        if len(layers) < self.num_stages:
            raise ConfigError(f"parallel.pp_size={self.pp} x parallel.pp_stages_per_rank={self.per_rank}: "
                              f"{self.num_stages} stages but {type(causal).__name__} has {len(layers)} blocks; use "
                              "fewer stages")
        blocks = stage_blocks(len(layers), self.num_stages)
        kept = sorted(i for s in self.stage_ids for i in blocks[s])
        inner.layers = torch.nn.ModuleDict({str(i): layers[i] for i in kept})  # the blocks keep their names
        first, last = 0 in self.stage_ids, self.num_stages - 1 in self.stage_ids
        if not first:
            inner.embed_tokens = None
        if not last:
            inner.norm = None
            setattr(causal, head, None)
        model.to(self.device)
        if self.tp > 1:  # each block's matrices split over tp, then sharded over dp_shard (2-D DTensors)
            from trainloop.parallel.tensor_parallel import apply_tensor_parallel, tensor_parallel_plan

            apply_tensor_parallel(model, self.mesh["tp"], tensor_parallel_plan(causal.config, self.tp))
        if head_loss is not None and last:
            from trainloop.model.output_layer import output_layer

            output_layer(causal)  # a plain Linear, nothing applied to its logits: or refused naming the key
        modules = [_stage_module(causal, head, s == 0, s == self.num_stages - 1, [str(i) for i in blocks[s]],
                                 head_loss) for s in self.stage_ids]
        if self.sharded:  # each block, then each stage as the root of what no block holds
            from torch.distributed.fsdp import fully_shard

            from trainloop.parallel.sharding import fsdp_options

            options = fsdp_options(self.cfg, self.mesh["dp_shard"], self.device)
            for module in modules:
                for block in module.blocks.values():
                    fully_shard(block, **options)
                fully_shard(module, **options)
        return modules

    def prepare(self, model, optimizer):
        return model, self.accelerator.prepare(optimizer)  # each rank steps its own stages' parameters

    def _loss(self, output, target):
        """The last stage's output (its logits, or with the chunked loss their summed loss) as the next
        micro-batch's summed loss over the step's units: the schedule's loss_fn, called on the micro-batches in
        order. The logits go to the objective's own batch_loss (Forwarded), which sums its metrics as on one process."""
        if self.chunk:
            return output * self._scale
        if not self._initialized():  # torch's first step infers the gradients' shapes from a forward of its own
            return output.float().sum() * 0.0  # on made-up activations: a loss of the shape's, counting nothing
        batch, ids = self._pending.popleft()
        output = output[:, output.shape[1] - ids.shape[1]:]  # without the padding same_width put before its rows
        loss = self._objective.batch_loss(Forwarded(output, ids, self.pad_id), batch)
        if loss.penalty is not None:
            raise RuntimeError(f"objective={self._objective.name}: a loss with a penalty runs no pipeline")
        return loss.summed * self._scale

    def _initialized(self) -> bool:
        """Whether the schedule has inferred its stages' shapes (its first step does, calling loss_fn once more)."""
        schedule = self.schedule
        return bool(getattr(schedule, "_stage_backward_initialized", False) or
                    getattr(schedule, "_stages_backward_initialized", False))

    def _chunked_loss(self, hidden, weight, bias, labels):
        return self._objective.chunked_token_loss(hidden, weight, bias, labels, self.chunk)

    # -- each step -------------------------------------------------------------------------------
    def forward_backward(self, objective, model, group: list[dict], units, forward_context, alone: bool = False):
        """What each micro-batch's loss reads from forwards without gradients first (Objective.beside: a frozen
        copy's, through its own stages), then the schedule runs the step's micro-batches; the last stage's losses
        (each summed over its targets / the step's units) are summed and sent to every rank of its pipeline.
        Replicated stages then sum their gradients over dp_shard; FSDP2 reduce-scatters them in the schedule."""
        import torch
        import torch.distributed as dist

        group = [objective.beside(self, model, b) for b in group]
        # FSDP2 averages the gradients it reduce-scatters over dp_shard: the loss is multiplied back
        factor = self.dp if self.sharded else 1
        self._scale, self._objective = factor / units, objective
        forwards = [objective.forward_inputs(b) for b in group]
        self._pending = deque((b, f["input_ids"]) for b, f in zip(group, forwards))
        forwards = same_width(forwards)
        ids = torch.cat([f["input_ids"] for f in forwards])
        schedule = self._schedule(ids.shape[1])
        inputs = stage_inputs(model, forwards)
        if self.chunk:
            inputs["labels"] = torch.cat([b["labels"] for b in group])
        losses = []
        with forward_context(), self.accelerator.autocast():
            args = (ids,) if 0 in self.stage_ids else ()
            schedule.step(*args, **inputs, target=ids, losses=losses, return_outputs=False)
        if self.num_stages - 1 in self.stage_ids and self._pending and not self.chunk:
            raise RuntimeError(f"the pipeline's last stage took {len(group) - len(self._pending)} of {len(group)} "
                               "micro-batches' losses")
        if self.dp > 1 and not self.sharded:
            self._sum_replicas(model)
        step_loss = torch.stack(losses).sum().detach() / factor if losses else torch.zeros((), device=self.device)
        dist.broadcast(step_loss, src=self.last_rank, group=self.mesh.group("pp"))
        return step_loss  # this data-parallel rank's share, on each of its stages

    def _sum_replicas(self, model) -> None:
        """Each stage replicated over dp_shard: its gradients summed over the replicas, in one flat buffer."""
        import torch
        import torch.distributed as dist

        grads = [p.grad for p in model.parameters() if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self.mesh.group("dp_shard"))
        for grad, summed in zip(grads, flat.split([g.numel() for g in grads])):
            grad.copy_(summed.view_as(grad))

    def eval_sums(self, objective, model, batch: dict):
        """The stages' forwards in order (activations sent on between ranks), the summed loss and
        units taken on the last, and sent to every rank of its pipeline."""
        if objective.prompts:  # it evaluates what it generates (Pipeline.generator), not one forward of the batch
            return objective.eval_sums(model, batch)
        batch = objective.beside(self, model, batch)

        def sums(hidden, forward):  # the logits, or with the chunked loss their summed loss
            return (objective.token_loss_sums(hidden, batch) if self.chunk else
                    objective.eval_sums(Forwarded(hidden, forward["input_ids"], self.pad_id), batch))

        return self._last_stage(objective, model, batch, sums)

    def computed(self, objective, model, batch: dict, compute, inputs: dict | None = None):
        """compute(the last stage's output, as Forwarded) after the forwards of `model`'s stages (the policy's, or a
        frozen copy's: prepare_frozen) of `inputs` (the objective's forward_inputs(batch) if None), on every rank
        of the pipeline."""
        pad_id = self.pad_id if id(model) == self.policy else None  # a frozen copy ends in an output layer
        return self._last_stage(objective, model, batch, lambda hidden, forward: compute(
            Forwarded(hidden, forward["input_ids"], pad_id)), inputs)

    def _last_stage(self, objective, model, batch: dict, compute, forward: dict | None = None):
        """compute(the last stage's output, the forward's inputs) after the forwards of `model`'s stages of `forward`
        (objective.forward_inputs(batch) if None) in order (activations sent on between ranks), without gradients,
        sent to every rank of its pipeline in its shape and dtype."""
        import torch
        import torch.distributed as dist

        if objective is not None:  # the chunked loss inside the last stage's forward is its
            self._objective = objective
        forward = objective.forward_inputs(batch) if forward is None else forward
        stages = self.forwards[id(model)]
        inputs = stage_inputs(model, [forward]) | ({"labels": batch["labels"]} if self.chunk else {})
        hidden = forward["input_ids"]
        rank = self.accelerator.process_index
        with torch.no_grad(), self.accelerator.autocast():
            for s in range(self.num_stages):
                owner, before, after = (self.rank_of(k % self.pp) for k in (s, s - 1, s + 1))
                if owner != rank:
                    continue
                if s > 0 and before != rank:
                    hidden = receive(forward["input_ids"].shape + (model.config.hidden_size,), before, self.device)
                hidden = stages[self.stage_ids.index(s)](hidden, **inputs)
                if s < self.num_stages - 1 and after != rank:
                    send(hidden, after)
        pp = self.mesh.group("pp")
        last = self.num_stages - 1 in self.stage_ids
        with torch.no_grad():
            values = compute(hidden, forward) if last else None
        # what the last stage computed, its dtype and shape first: [dtype code, dimensions, size of each (at most 4)]
        meta = torch.zeros(6, dtype=torch.long, device=self.device)
        if last:
            meta[:2 + values.dim()] = torch.tensor([DTYPES.index(str(values.dtype).removeprefix("torch.")),
                                                    values.dim(), *values.shape])
        dist.broadcast(meta, src=self.last_rank, group=pp)
        if not last:
            code, dims, *shape = meta.tolist()
            values = torch.empty(shape[:dims], dtype=getattr(torch, DTYPES[code]), device=self.device)
        values = values.contiguous()
        dist.broadcast(values, src=self.last_rank, group=pp)
        return values

    @contextmanager
    def generator(self, model):
        """The model to call `generate` on: its forward runs the stages in order for every new token (no cache:
        each rank holds its stages' layers only) and hands every rank of the pipeline the last one's logits,
        so that every rank of a pipeline writes the same tokens."""
        import copy

        import torch
        from transformers.modeling_outputs import CausalLMOutputWithPast

        causal = decoder_parts(model)[0]
        generate = model.generate

        def forward(input_ids=None, attention_mask=None, **_):
            mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
            rows = {"input_ids": input_ids, "attention_mask": mask, "position_ids": (mask.cumsum(1) - 1).clamp(min=0)}
            return CausalLMOutputWithPast(logits=self._last_stage(None, model, rows, lambda hidden, _: hidden, rows))

        def uncached(*args, **kwargs):
            if kwargs.get("generation_config") is None:
                kwargs["use_cache"] = False
            else:
                kwargs["generation_config"] = copy.deepcopy(kwargs["generation_config"])
                kwargs["generation_config"].use_cache = False
            return generate(*args, **kwargs)

        causal.forward, model.generate = forward, uncached
        try:
            yield model
        finally:
            del causal.forward, model.generate

    def reduce_computed(self, tensor):
        """What the last stage accumulated from its losses, on every stage of its pipeline, summed over dp_shard."""
        import torch.distributed as dist

        held = tensor.clone()
        dist.broadcast(held, src=self.last_rank, group=self.mesh.group("pp"))
        return self.reduce_sum(held)

    def clip_grad_norm(self, model, max_norm: float):
        """The norm over every stage's gradients (summed squares over the ranks), the same on each."""
        import torch
        import torch.distributed as dist

        from trainloop.model.tensors import is_dtensor

        by_mesh: dict = {}  # DTensor gradients per mesh (dp_shard; dp_shard x tp), plain ones (replicated stages)
        for p in model.parameters():
            if p.grad is not None:
                by_mesh.setdefault(p.grad.device_mesh if is_dtensor(p.grad) else None, []).append(p)
        squared = torch.zeros((), device=self.device)
        for params in by_mesh.values():  # the stage's norm: DTensor placements count a replicated shard once
            norm = torch.nn.utils.get_total_norm([p.grad for p in params], 2.0)
            squared += (norm.to(self.device).full_tensor() if is_dtensor(norm) else norm.to(self.device)).float() ** 2
        dist.all_reduce(squared, group=self.mesh.group("pp"))  # the stages' together
        norm = squared.sqrt()
        for params in by_mesh.values():
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
        return norm

    # -- state -----------------------------------------------------------------------------------
    def save_state(self, directory, model, adapter_only: bool, record) -> None:
        from trainloop.parallel import dcp

        dcp.save(directory, model, self.accelerator._optimizers[0], adapter_only, record, flatten=True)
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

        from trainloop.model.tensors import is_dtensor

        mine = {name: (tensor.full_tensor() if is_dtensor(tensor) else tensor).detach().cpu()  # over dp_shard
                for name, tensor in model.state_dict().items()}
        mine = mine if self.dp_rank == 0 and self.mesh.local_rank("tp") == 0 else {}  # one copy of each stage
        gathered = [None] * self.world_size if self.accelerator.is_main_process else None
        dist.gather_object(mine, gathered, dst=0)
        return {k: v for part in gathered for k, v in part.items()} if gathered else {}

    def count_parameters(self, model) -> tuple[int, int]:
        """This rank's stages' counts, summed over the pipeline's ranks."""
        import torch
        import torch.distributed as dist

        counts = torch.tensor(super().count_parameters(model), device=self.device)
        dist.all_reduce(counts, group=self.mesh.group("pp"))
        return tuple(counts.tolist())

    def whole_model(self, model):
        """This rank holds its stages only: the whole model's modules, on the meta device (no memory),
        with the live configs, for the export to name every stage's tensors (peft walks the modules)."""
        import torch

        from trainloop.model.adapter import wrap_lora
        from trainloop.model.heads import auto_class

        causal, _, _, head = decoder_parts(model)
        with torch.device("meta"):
            whole = auto_class(OUTPUT_HEADS[head]).from_config(causal.config)
        whole.config, whole.generation_config = causal.config, causal.generation_config
        return wrap_lora(whole, self.cfg.adapter, OUTPUT_HEADS[head]) if model is not causal else whole

    def describe(self, model) -> str:
        counts = "/".join(str(len(self.blocks[s])) for s in range(self.num_stages))
        how = "FSDP2 on dp_shard" if self.sharded else "replicated"
        tp = f" x {self.tp} tp" if self.tp > 1 else ""
        dp = "" if self.dp == 1 and self.tp == 1 else (f", x {self.dp} data-parallel ({how}{tp and ', tensor parallel'}"
                                                     f", mesh {self.device.type} {self.pp} pp x {self.dp} dp_shard"
                                                     f"{tp})")
        return (f"pipeline: {self.num_stages} stages over {self.pp} processes ({self.cfg.parallel.pp_schedule}){dp}, "
                f"blocks per stage {counts}, this rank's stages {self.stage_ids} ({self.where()})")

    # -- the planner's terms ---------------------------------------------------------------------
    @staticmethod
    def memory_lines(plan, cfg, shape, world_size: int, dev: str, half: bool) -> None:
        """The planned process's stages, held as one process holds a whole model (DataParallel's lines
        on its part: parameters, gradients, optimizer states, the step's temporaries). The planned
        process is the one whose part and activations in flight add up to the most."""
        from trainloop.parallel.ddp import DataParallel
        from trainloop.parallel.fsdp2 import FSDP2
        from trainloop.parallel.memory import Line
        from trainloop.parallel.tp import FSDP2xTP

        rank, tp = planned_rank(cfg, shape), cfg.parallel.tp_size
        dp = max(1, world_size // (cfg.parallel.pp_size * tp))
        part = rank_part(cfg, shape, rank)
        if tp > 1:  # the stage split over tp, then sharded over dp_shard, as FSDP2 x TP holds a whole model
            FSDP2xTP.memory_lines(plan, cfg, part, dp * tp, dev, half)
        elif cfg.fsdp.name != "none":  # the stage sharded over dp_shard, as FSDP2 shards a whole model
            FSDP2.memory_lines(plan, cfg, part, dp, dev, half)
        else:
            DataParallel.memory_lines(plan, cfg, part, 1, dev, half)
            if dp > 1:
                plan.lines.append(Line("gradient all-reduce buffer", 4 * part.num_trainable, dev, "optimizer step",
                                       exact=False, note="the stage's gradients in one flat buffer, summed over "
                                       "dp_shard"))
        blocks, outputs = in_flight(cfg, rank, shape.num_layers)
        p = cfg.parallel
        plan.notes.append(f"pipeline ({p.pp_schedule}): planned for rank {rank} of {p.pp_size}, the largest, with "
                          f"{part.num_layers} of {shape.num_layers} blocks ({part.num_params / 1e6:,.1f}M parameters) "
                          f"and {blocks:g} blocks' activations in flight"
                          + (f" and {outputs} micro-batches' logits" if outputs else ""))

    @staticmethod
    def activations_held(cfg, shape) -> tuple[float, int]:
        return in_flight(cfg, planned_rank(cfg, shape), shape.num_layers)

    @staticmethod
    def tensor_parallel(cfg) -> tuple[int, bool]:
        return cfg.parallel.tp_size, False  # sequence parallelism is refused beside the pipeline

    @staticmethod
    def traffic_lines(plan, cfg, shape, world_size: int, half: bool) -> None:
        """Each micro-batch's activations sent forward and their gradients back, at each stage boundary."""
        from trainloop.parallel.fsdp2 import FSDP2
        from trainloop.parallel.memory import Transfer, ring_bytes

        p = cfg.parallel
        boundary = cfg.data.batch_size * cfg.data.seq_len * shape.hidden * (2 if half else 4)
        sent = 2 * boundary * cfg.trainer.gradient_accumulation_steps * p.pp_stages_per_rank
        plan.traffic.append(Transfer("activations and their gradients", sent, "pp",
                                     note="point to point, each micro-batch, forward and backward"))
        from trainloop.parallel.tp import FSDP2xTP

        dp, part = max(1, world_size // (p.pp_size * p.tp_size)), rank_part(cfg, shape, planned_rank(cfg, shape))
        if p.tp_size > 1:
            FSDP2xTP.traffic_lines(plan, cfg, part, dp * p.tp_size, half)
        elif cfg.fsdp.name != "none":  # over dp_shard, the stage's part
            FSDP2.traffic_lines(plan, cfg, part, dp, half)
        elif dp > 1:
            plan.traffic.append(Transfer("gradient all-reduce", ring_bytes("all-reduce", 4 * part.num_trainable, dp),
                                         "dp", note="fp32, the stage's gradients over dp_shard, once per step"))

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
        stages = Pipeline.min_accumulation(cfg)
        if cfg.trainer.gradient_accumulation_steps < stages:
            found.append(f"{key}: trainer.gradient_accumulation_steps={cfg.trainer.gradient_accumulation_steps} "
                         f"micro-batches a step are fewer than the {stages} stages, which would idle; "
                         f"set trainer.gradient_accumulation_steps={stages} or more")
        if cfg.model.name == "tiny" and cfg.model.num_layers < stages:
            found.append(f"{key}: {stages} stages but model.num_layers={cfg.model.num_layers}; use fewer stages")
        if cfg.deepspeed.stage:
            found.append(f"{key} with deepspeed=zero{cfg.deepspeed.stage}: DeepSpeed's engine runs the whole model "
                         "on each process; set deepspeed=none (fsdp=full_shard shards each stage over dp_shard)")
        if cfg.parallel.sequence_parallel:
            found.append(f"{key} with parallel.sequence_parallel=true: the stages pass whole hidden states on; "
                         "set parallel.sequence_parallel=false")
        if cfg.fsdp.name != "none" and cfg.fsdp.offload != "none":
            found.append(f"{key} with fsdp.offload={cfg.fsdp.offload}: the stages' shards stay on the device; "
                         "set fsdp.offload=none")
        unsupported = {
            "arch": (cfg.model.name == "tiny" and cfg.model.arch != "llama", f"model.arch={cfg.model.arch}: only "
                     "model.arch=llama is cut into stages for now"),
            "attention": (cfg.model.attn_implementation != "sdpa", f"model.attn_implementation="
                          f"{cfg.model.attn_implementation}: stages attend through trainloop's sdpa attention, which "
                          "needs model.attn_implementation=sdpa"),
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


def rank_blocks(cfg, num_layers: int, rank: int) -> list[int]:
    """The blocks of `rank`'s stages (round robin under interleaved_1f1b), as Pipeline.shard cuts them."""
    p = cfg.parallel
    blocks = stage_blocks(num_layers, p.pp_size * p.pp_stages_per_rank)
    return sorted(i for k in range(p.pp_stages_per_rank) for i in blocks[rank + k * p.pp_size])


def in_flight(cfg, rank: int, num_layers: int) -> tuple[float, int]:
    """For the planner: (the blocks' activations `rank` keeps at its peak, in one micro-batch's
    blocks; the micro-batches whose output layer and logits it keeps). GPipe runs every micro-batch's
    forward before any backward; 1F1B holds at most pp_size - rank micro-batches (its warm-up, then
    one forward per backward); Interleaved 1F1B as torch's schedule warms up: (stages per rank - 1)
    x pp_size + 2 x (pp_size - 1 - rank) stage forwards, one more in its steady state."""
    p, micro = cfg.parallel, cfg.trainer.gradient_accumulation_steps
    pp, per_rank = p.pp_size, p.pp_stages_per_rank
    stage = len(rank_blocks(cfg, num_layers, rank)) / per_rank  # blocks per stage of this rank
    last = rank == (pp * per_rank - 1) % pp
    if p.pp_schedule == "gpipe":
        return micro * stage, micro if last else 0
    if p.pp_schedule == "1f1b":
        return min(micro, pp - rank) * stage, int(last)
    return min(per_rank * micro, (per_rank - 1) * pp + 2 * (pp - 1 - rank) + 1) * stage, int(last)


def rank_part(cfg, shape, rank: int):
    """The planner's shape (trainloop.tools.shape.ModelShape) of what `rank` holds: its blocks, the
    embeddings on the first stage's rank, the final norm and the output layer on the last's."""
    from dataclasses import replace

    p = cfg.parallel
    blocks, stages = set(rank_blocks(cfg, shape.num_layers, rank)), p.pp_size * p.pp_stages_per_rank
    first, last = rank == 0, rank == (stages - 1) % p.pp_size

    def held(position: int) -> bool:
        return position in blocks or (position < 0 and first) or (position >= shape.num_layers and last)

    def kept(values: list | None, positions: list[int]) -> list | None:
        return None if values is None else [v for v, at in zip(values, positions) if held(at)]

    trainable_at = shape.position if shape.trainable is None else shape.trainable_position
    return replace(shape, shapes=kept(shape.shapes, shape.position), trainable=kept(shape.trainable, trainable_at),
                   hidden_matrix=kept(shape.hidden_matrix, trainable_at), num_layers=len(blocks),
                   expert_params=round(shape.expert_params * len(blocks) / shape.num_layers),
                   tp_split=kept(shape.tp_split, shape.position),
                   trainable_tp_split=kept(shape.trainable_tp_split, trainable_at), position=None,
                   trainable_position=None)


def planned_rank(cfg, shape) -> int:
    """The rank whose part (16 B per trained parameter: fp32 weight, gradient, two Adam moments; 4 B
    per frozen one) and activations in flight add up to the most: the one the planner plans."""
    from trainloop.parallel.memory import activation_bytes

    half = cfg.precision.name in ("bf16", "fp16", "fp8")

    def total(rank: int) -> int:
        part = rank_part(cfg, shape, rank)
        blocks, outputs = in_flight(cfg, rank, shape.num_layers)
        held = activation_bytes(shape, cfg.data.batch_size, cfg.data.seq_len, half, autocast=half,
                                checkpointing=cfg.model.gradient_checkpointing, attention=cfg.model.attn_implementation,
                                blocks=blocks, outputs=outputs)
        return 16 * part.num_trainable + 4 * (part.num_params - part.num_trainable) + sum(held)

    return max(range(cfg.parallel.pp_size), key=total)


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
    and what attention reads (trainloop.model.attention): padded rows' mask where a batch carries an
    attention_mask (grpo's left-padded prompts), else, where some row restarts the position ids, the
    documents (one a row where a batch carries none)."""
    import torch

    from trainloop.model.attention import documents_of, with_document_mask

    positions = [b["position_ids"] if "position_ids" in b else
                 torch.arange(b["input_ids"].shape[1], device=b["input_ids"].device).expand_as(b["input_ids"])
                 for b in group]
    inputs = {"position_ids": torch.cat(positions)}
    padded = any("attention_mask" in b for b in group)
    if padded:
        inputs["attention_mask"] = torch.cat([b.get("attention_mask", torch.ones_like(b["input_ids"])) for b in group])
    elif any("position_ids" in b for b in group):
        inputs["documents"] = torch.cat([
            b["documents"] if "documents" in b else documents_of(b["position_ids"]) if "position_ids" in b else
            torch.zeros(b["input_ids"].shape, dtype=torch.int32) for b in group])
    return with_document_mask(model, inputs) if padded or "documents" in inputs else inputs


def same_width(forwards: list[dict]) -> list[dict]:
    """The micro-batches' forward inputs at one width, the schedule's (it splits one tensor into equal
    micro-batches): a narrower one's rows get masked padding before them (grpo's completions end where they
    end), which their own tokens never attend to; its output is read without it (Pipeline._loss)."""
    import torch
    import torch.nn.functional as F

    widths = {f["input_ids"].shape[1] for f in forwards}
    if len(widths) == 1:
        return forwards
    width = -(-max(widths) // WIDTH_MULTIPLE) * WIDTH_MULTIPLE  # fewer widths, fewer schedules (Pipeline._schedule)
    widened = []
    for f in forwards:
        ids, pad = f["input_ids"], width - f["input_ids"].shape[1]
        positions = f.get("position_ids", torch.arange(ids.shape[1], device=ids.device).expand_as(ids))
        widened.append({"input_ids": F.pad(ids, (pad, 0)), "position_ids": F.pad(positions, (pad, 0)),
                        "attention_mask": F.pad(f.get("attention_mask", torch.ones_like(ids)), (pad, 0))})
    return widened


DTYPES = ("float32", "bfloat16", "float16", "float64")


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
