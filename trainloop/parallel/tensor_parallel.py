"""Tensor parallelism (parallel.tp_size): each transformer block's matrices split over the `tp`
dimension of a 2-D device mesh, before FSDP2 shards them over the other (trainloop/parallel/sharding.py).

Which matrix is split how is the model's own declaration: transformers' `base_model_tp_plan`
(LlamaConfig: q/k/v and gate/up column-wise, o and down row-wise). The split itself is torch's
`parallelize_module` with `ColwiseParallel`/`RowwiseParallel`, as torchtitan's `apply_tp` does:
those compose with FSDP2 (2-D DTensors) and DCP, where transformers' own TP path is tied to
`from_pretrained` (a model built from a config, model=tiny, has none) and builds its own mesh.
accelerate's ParallelismConfig does not serve: 1.15 refuses it on CPU processes ("only compatible
DistributedType.FSDP ... but got DistributedType.MULTI_CPU", seen under torchrun over gloo), and
its TP expects a model transformers already split; the mesh is one init_device_mesh call here. Outputs are local tensors (`use_local_output`): a
column-wise q/k/v projection gives this rank's heads, and HF's attention reshapes with `-1`
heads, so the attention runs on the local heads unchanged; the row-wise projections all-reduce
their output, so what leaves a block (and the embeddings, norms, output head and loss, which stay
whole on every rank of a tp group) is the same on every rank. With parallel.sequence_parallel the
norms and the residual stream between the split matrices hold 1/tp of the sequence instead
(sequence_parallel_styles); without it they run whole on each rank.

A mixture of experts (Mixtral) runs its plan's attention entries only: its routed experts (the
entries transformers marks `moe_tp_experts`, and the packed gate_up/down entries under them) and
its router stay whole on each tp rank, where FSDP2 still shards them over dp_shard. Every tp rank
then routes the same tokens to the same experts and computes them all (no expert parallelism).
"""

from __future__ import annotations

from fnmatch import fnmatch

from trainloop.errors import ConfigError

# transformers' plan style -> what it means here; a plan holding any other style is not run
STYLES = ("colwise", "rowwise")
# model type -> why transformers declares no plan for it, where a split would need more than a plan
# (checked against transformers 5.23's GPT2Attention)
NO_PLAN = {
    "gpt2": "GPT-2's attention computes q, k and v in one fused Conv1D (c_attn, output columns [q | k | v]) and "
            "cuts its output at the full width, so a column-wise split would give a rank all of q and half of k, "
            "and a right split needs c_attn's columns re-laid per rank (other checkpoints and exports); "
            "transformers declares no tensor-parallel plan for it",
}
# the style transformers gives a mixture's routed experts: those, and the plan's entries inside them,
# stay whole on each tp rank (FSDP2 shards them over dp_shard)
EXPERTS = "moe_tp_experts"


def planned_styles(model_config) -> tuple[dict[str, str], list[str]]:
    """The entries of the model's transformers plan (base_model_tp_plan, module patterns of its base
    model) that trainloop runs, and the routed experts' patterns it leaves whole. One answer for
    the split (tensor_parallel_plan) and the planner's memory lines (split_dimension)."""
    declared = dict(getattr(model_config, "base_model_tp_plan", None) or {})
    experts = [pattern for pattern, style in declared.items() if style == EXPERTS]
    run = {pattern: style for pattern, style in declared.items()
           if not any(pattern == e or pattern.startswith(e + ".") for e in experts)}
    return run, experts


def split_dimension(model_config, module: str, kind: str) -> int | None:
    """The dimension tensor parallelism splits of parameter `kind` ("weight", "bias") of base-model
    module `module` (e.g. "layers.0.self_attn.q_proj"): 0 column-wise (the output rows, bias
    too), 1 row-wise (the weight's input columns; its bias is replicated), None whole."""
    for pattern, style in planned_styles(model_config)[0].items():
        if fnmatch(module, pattern):
            return 0 if style == "colwise" else 1 if style == "rowwise" and kind == "weight" else None
    return None


def tensor_parallel_plan(model_config, tp_size: int) -> dict[str, str]:
    """The model's column-/row-wise plan for its base model's modules (wildcards for the layer
    index; a mixture's experts left out: planned_styles), checked against `tp_size`. Raises
    ConfigError naming parallel.tp_size."""
    key = f"parallel.tp_size={tp_size}"
    kind = getattr(model_config, "model_type", type(model_config).__name__)
    plan, experts = planned_styles(model_config)
    if not plan:
        why = NO_PLAN.get(kind, f"transformers declares no tensor-parallel plan for model type {kind}")
        raise ConfigError(f"{key}: {why} (base_model_tp_plan); use parallel.tp_size=1 with fsdp=full_shard")
    other = sorted({style for style in plan.values() if style not in STYLES})
    if other:
        raise ConfigError(f"{key}: the tensor-parallel plan of model type {kind} uses {', '.join(other)}, which "
                          f"trainloop does not run (only {' and '.join(STYLES)}); use parallel.tp_size=1")
    widths = {"attention heads": model_config.num_attention_heads,
              "key/value heads": getattr(model_config, "num_key_value_heads", None) or model_config.num_attention_heads}
    if not experts:  # a mixture's expert MLPs stay whole
        widths["MLP width (intermediate_size)"] = model_config.intermediate_size
    uneven = [f"{what} {n}" for what, n in widths.items() if n % tp_size]
    if uneven:
        raise ConfigError(f"{key} does not divide the model's {', '.join(uneven)}: each rank takes an equal share; "
                          "choose a tp_size that divides them")
    return plan


# a block sequence parallelism splits: Llama's layout (HF's names), norm -> attention -> add -> norm -> MLP -> add
SEQUENCE_PARALLEL_BLOCK = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")


def sequence_parallel_problem(base) -> str | None:
    """Why parallel.sequence_parallel cannot split base model `base` (the styles below name Llama's
    modules), or None."""
    layers = getattr(base, "layers", None)
    children = sorted(name for name, _ in layers[0].named_children()) if layers else []
    if children == sorted(SEQUENCE_PARALLEL_BLOCK) and hasattr(base, "norm"):
        return None
    return (f"parallel.sequence_parallel=true: the blocks of model type {base.config.model_type} hold "
            f"{', '.join(children) or 'no layers'}, not Llama's {', '.join(SEQUENCE_PARALLEL_BLOCK)} that its "
            "sequence-parallel styles name; set parallel.sequence_parallel=false")


def sequence_parallel_styles(mixture: bool) -> dict:
    """Sequence parallelism on the Llama layout (HF's module names), as torchtitan's apply_tp: between
    the split matrices the residual stream and the norms hold 1/tp of the sequence on each rank,
    gathered before q/k/v and gate/up, reduce-scattered after o and down. It starts at the first
    block's input, not at the embeddings: the model builds its causal mask, positions and rotary
    embeddings from the embeddings' (whole) sequence before the first block. DTensors flow between
    the blocks (not local tensors), so a sequence tp does not divide (generation) keeps its shape.
    A mixture's MLP (router and experts whole) takes the whole sequence and returns this rank's shard."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleInput, PrepareModuleInputOutput, SequenceParallel

    seq, whole = Shard(1), Replicate()
    mlp = (PrepareModuleInputOutput(input_layouts=(seq,), desired_input_layouts=(whole,), use_local_input=True,
                                    output_layouts=(whole,), desired_output_layouts=(seq,), use_local_output=False)
           if mixture else PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(whole,)))
    return {
        "layers.0": PrepareModuleInput(input_layouts=(whole,), desired_input_layouts=(seq,)),  # a cut: no communication
        "layers.*.input_layernorm": SequenceParallel(),
        "layers.*.self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": seq},
                                                 desired_input_kwarg_layouts={"hidden_states": whole}),
        "layers.*.post_attention_layernorm": SequenceParallel(),
        "layers.*.mlp": mlp,
        "norm": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(whole,), use_local_output=True),
    }


def lora_sequence_parallel_styles(name: str, style: str) -> dict:
    """Under sequence parallelism, the whole half of a LoRA layer split `style`-wise: beside a column-wise
    base, lora_A reads the gathered input as a plain tensor (as without sequence parallelism); beside
    a row-wise base, whose output is this rank's sequence shard, lora_B maps lora_A's sequence shard
    with its whole weight (per token, as a norm does)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import PrepareModuleInput, SequenceParallel

    if style == "colwise":
        return {f"{name}.lora_A.*": PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),),
                                                        use_local_output=True)}
    return {f"{name}.lora_B.*": SequenceParallel()}


def apply_tensor_parallel(model, tp_mesh, plan: dict[str, str], sequence_parallel: bool = False) -> int:
    """Split `model`'s base model in place as `plan` says over `tp_mesh`; returns the modules split.

    A LoRA layer (peft) in the plan is split like the weight it adapts: column-wise, its frozen
    base and lora_B column-wise (lora_A sees the whole input and stays whole); row-wise, its base
    and lora_A row-wise (both read this rank's slice of the input and all-reduce their output;
    lora_B stays whole). Base and adapter outputs then have the same layout and add up.
    `sequence_parallel`: the norms and the residual stream too (sequence_parallel_styles)."""
    from functools import partial

    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    if sequence_parallel:  # o and down hand the residual stream its sequence shard (a reduce-scatter)
        styles["rowwise"] = partial(RowwiseParallel, output_layouts=Shard(1), use_local_output=False)
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model  # inside peft's wrapper
    base = inner.base_model
    if sequence_parallel and sequence_parallel_problem(base):
        raise ConfigError(sequence_parallel_problem(base))
    lora = {name for name, m in base.named_modules() if hasattr(m, "base_layer") and hasattr(m, "lora_A")}
    parallel = {}
    for pattern, style in plan.items():
        adapted = [name for name in lora if fnmatch(name, pattern)]
        if not adapted:
            parallel[pattern] = styles[style]()
            continue
        for name in adapted:
            parallel[f"{name}.base_layer"] = styles[style]()
            parallel[f"{name}.{'lora_B' if style == 'colwise' else 'lora_A'}.*"] = styles[style]()
            if sequence_parallel:
                parallel.update(lora_sequence_parallel_styles(name, style))
    if sequence_parallel:
        parallel.update(sequence_parallel_styles(mixture=bool(planned_styles(inner.config)[1])))
    # src_data_rank=None: each rank keeps its own slice, no scatter: ranks that built on the meta
    # device hold no weights to send; the main process's whole weights are scattered once FSDP2 has sharded
    frozen = {name for name, param in base.named_parameters() if not param.requires_grad}
    parallelize_module(base, tp_mesh, parallel, src_data_rank=None)
    for name, param in base.named_parameters():  # SequenceParallel's replicated parameters come back trainable
        param.requires_grad_(name not in frozen)
    split = [m for m in base.modules() if any(is_tp(p) for p in m.parameters(recurse=False))]
    if not split:
        raise RuntimeError(f"parallel.tp_size: the plan {plan} matched no module of {type(base).__name__}")
    return len(split)


def sequence_parallel_norms(model) -> int:
    """The norms computing on a sequence shard: their weights replicated over a tp mesh dimension."""
    from torch.distributed.tensor import DTensor

    def replicated(param) -> bool:
        names = (param.device_mesh.mesh_dim_names or ()) if isinstance(param, DTensor) else ()
        return "tp" in names and param.placements[names.index("tp")].is_replicate()

    return sum(1 for m in model.modules() if "Norm" in type(m).__name__
               and any(replicated(p) for p in m.parameters(recurse=False)))


def is_tp(param) -> bool:
    """Split over a tp mesh dimension (a norm's weight under sequence parallelism is replicated there)."""
    from torch.distributed.tensor import DTensor

    mesh = getattr(param, "device_mesh", None) if isinstance(param, DTensor) else None
    names = (mesh.mesh_dim_names or ()) if mesh is not None else ()
    return "tp" in names and param.placements[names.index("tp")].is_shard()
