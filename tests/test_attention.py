"""causal_lm's training attention builds no mask in transformers: sdpa's is_causal for streamed rows,
each document causal for packed ones, with no (sequence x sequence) mask (trainloop/model/attention.py);
and the loss compiles with a whole compiled model (trainloop/model/compile.py). Issues 35 (items 1 and 4)
and 61."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from helpers import compose, reset_accelerate, train
from trainloop.data.tokenizer import IGNORE
from trainloop.model.attention import _varlen_attn, padded_causal


def tiny(arch: str, attn: str):
    from transformers import AutoModelForCausalLM

    from trainloop.model.attention import register
    from trainloop.model.builder import build_model_config

    register()
    torch.manual_seed(0)
    config = build_model_config(compose("+preset=smoke", f"model.arch={arch}").model, vocab_size=320)
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn).eval()


@pytest.mark.parametrize("arch", ["llama", "gpt2", "mixtral"])
def test_each_is_transformers_sdpa_on_the_rows_it_is_given_and_generation_is_sdpas_own(arch):
    from trainloop.model.attention import SDPA_CAUSAL, SDPA_DOCUMENTS, generating, with_document_mask

    sdpa, causal, documents = tiny(arch, "sdpa"), tiny(arch, SDPA_CAUSAL), tiny(arch, SDPA_DOCUMENTS)
    ids = torch.randint(3, 320, (2, 24))
    # row 0: documents of 5, 12 and 7 tokens; row 1: one of 24 (positions as trainloop packs them)
    positions = torch.stack([torch.cat([torch.arange(5), torch.arange(12), torch.arange(7)]), torch.arange(24)])
    with torch.no_grad():
        whole = sdpa(input_ids=ids).logits
        torch.testing.assert_close(causal(input_ids=ids).logits, whole, rtol=1e-5, atol=1e-5)
        packed = sdpa(input_ids=ids, position_ids=positions).logits  # transformers' packed-rows mask
        inputs = with_document_mask(documents, {"input_ids": ids, "position_ids": positions})
        assert inputs["documents"].tolist() == [[0] * 5 + [1] * 12 + [2] * 7, [0] * 24]  # made once, on the host
        torch.testing.assert_close(documents(**inputs).logits, packed, rtol=1e-5, atol=1e-5)
        # a batch without position ids (no row restarts them: trainloop.data.loaders.collate) is causal
        torch.testing.assert_close(documents(input_ids=ids).logits, whole, rtol=1e-5, atol=1e-5)
        assert not torch.allclose(packed[0, 5:], whole[0, 5:], atol=1e-3)  # the documents' mask took effect
        # left-padded prompts and a cache: under `generating` the masks are sdpa's own
        mask = torch.ones_like(ids)
        mask[0, :9] = 0
        kwargs = {"input_ids": ids, "attention_mask": mask, "max_new_tokens": 4, "do_sample": False, "pad_token_id": 0}
        want = sdpa.generate(**kwargs)
        for model, name in ((causal, SDPA_CAUSAL), (documents, SDPA_DOCUMENTS)):
            with generating(model):
                assert model.config._attn_implementation == "sdpa"
                assert torch.equal(model.generate(**kwargs), want)
            assert model.config._attn_implementation == name
            # outside it, a cached generation is refused at its first cached step (a generation
            # without a cache cannot be told from training: trainloop generates under `generating`)
            with pytest.raises(RuntimeError, match="generation runs under trainloop.model.attention.generating"):
                model.generate(**kwargs, use_cache=True)


def test_a_document_starts_where_positions_do_not_count_on_and_spans_never_cross_rows():
    from trainloop.model.attention import documents_of, spans

    documents = documents_of(torch.tensor([[0, 1, 2, 0, 1, 0], [3, 4, 5, 6, 0, 1]]))
    assert documents.dtype == torch.int32 and documents.tolist() == [[0, 0, 0, 1, 1, 2], [0, 0, 0, 0, 1, 1]]
    assert spans(documents) == [(0, 0, 3), (0, 3, 5), (0, 5, 6), (1, 0, 4), (1, 4, 6)]
    assert spans(torch.zeros(2, 3, dtype=torch.int32)) == [(0, 0, 3), (1, 0, 3)]  # the same number, two rows



def test_a_varlen_kernel_gets_each_documents_offset_in_the_batch_laid_end_to_end():
    """cumulative_lengths: the cu_seqlens varlen flash attention takes, from the host documents (no device
    read), with the batch's total last and the longest document; the kernel a query takes on the CPU."""
    from trainloop.model.attention import attention_kernel, cumulative_lengths, documents_of

    documents = documents_of(torch.tensor([[0, 1, 2, 0, 1, 0], [3, 4, 5, 6, 0, 1]]))
    offsets, longest = cumulative_lengths(documents)
    assert offsets.dtype == torch.int32 and offsets.tolist() == [0, 3, 5, 6, 10, 12] and longest == 4
    offsets, longest = cumulative_lengths(torch.zeros(2, 3, dtype=torch.int32))  # one document a row
    assert offsets.tolist() == [0, 3, 6] and longest == 3
    query = torch.zeros(1, 2, 6, 8)
    assert attention_kernel(query) == "cpu" and attention_kernel(query, dropout=0.1) == "loop"
    assert attention_kernel(query.to("meta")) == "loop"  # a device with no varlen kernel


@pytest.mark.skipif(_varlen_attn is None, reason="this torch's varlen attention takes no causal window")
def test_the_varlen_call_is_one_torchs_own_op_accepts_forward_and_backward():
    """The call the GPU path makes, on the meta device, where torch's varlen op runs its own shape functions
    (no kernel): grouped heads, the causal window, the scale; the output laid out (batch, seq, heads, dim)
    as transformers takes it, and gradients of the inputs' shapes."""
    from trainloop.model.attention import _documents_varlen, documents_of

    documents = documents_of(torch.tensor([[0, 1, 2, 0, 1, 0], [3, 4, 5, 6, 0, 1]]))
    query = torch.empty(2, 4, 6, 64, dtype=torch.bfloat16, device="meta", requires_grad=True)
    key, value = (torch.empty(2, 2, 6, 64, dtype=torch.bfloat16, device="meta", requires_grad=True) for _ in range(2))
    out = _documents_varlen(query, key, value, documents, 0.125)
    assert out.shape == (2, 6, 4, 64) and out.dtype == torch.bfloat16
    grads = torch.autograd.grad(out.sum(), (query, key, value))
    assert [g.shape for g in grads] == [query.shape, key.shape, value.shape]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="varlen flash attention is CUDA's (scripts/gpu_check.sh)")
def test_on_a_gpu_documents_attend_in_one_varlen_kernel_as_the_dense_mask_does(caplog):
    """bf16 on a CUDA GPU: one varlen flash kernel over the batch's documents (where this torch has it),
    forward and gradients as sdpa with the dense mask gives them, and as the per-document loop fp32 takes;
    logged once. Grouped heads, documents of 5, 9 and 2 tokens, one of 16, and 16 of one token each."""
    import logging

    from trainloop.model.attention import _announce, attention_kernel, document_attention, documents_of

    _announce.cache_clear()  # logged once a process: this test's own first
    torch.manual_seed(0)
    positions = torch.stack([torch.cat([torch.arange(5), torch.arange(9), torch.arange(2)]), torch.arange(16),
                             torch.zeros(16, dtype=torch.long)])
    documents = documents_of(positions)
    grad = torch.randn(3, 16, 4, 64, device="cuda")
    varlen = _varlen_attn is not None and torch.cuda.get_device_capability() >= (8, 0)  # flash attention's GPUs
    for dtype, kernel in ((torch.bfloat16, "varlen" if varlen else "loop"), (torch.float32, "loop")):
        query = torch.randn(3, 4, 16, 64, device="cuda", dtype=dtype, requires_grad=True)
        key, value = (torch.randn(3, 2, 16, 64, device="cuda", dtype=dtype, requires_grad=True) for _ in range(2))
        assert attention_kernel(query) == kernel
        tolerance = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}

        def run(attend):
            out = attend(query, key, value, documents)
            return (out, *torch.autograd.grad(out, (query, key, value), grad.to(dtype)))

        with caplog.at_level(logging.INFO, logger="trainloop"):
            got = run(lambda q, k, v, d: document_attention(q, k, v, d, 64 ** -0.5))
            run(lambda q, k, v, d: document_attention(q, k, v, d, 64 ** -0.5))
        for tensor, expected in zip(got, run(dense_reference)):
            torch.testing.assert_close(tensor, expected, **tolerance)
    said = [r.getMessage() for r in caplog.records if "attention over packed documents" in r.getMessage()]
    assert len(said) == (2 if varlen else 1) and any("varlen" in line for line in said) == varlen, said  # once each


def test_padded_rows_attend_as_documents_and_their_tokens_as_the_dense_mask_gives_them():
    """A left-padded prompt with a right-padded completion (grpo's rollouts, distill's on-policy rows) is
    three documents: padding, tokens, padding. Every kept token's output equals sdpa's under padded_causal's
    dense mask; a row whose kept tokens are not one run is not documents (the dense mask stays)."""
    from trainloop.model.attention import SDPA_CAUSAL, documents_of_mask, with_document_mask

    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1, 1, 0], [1] * 8, [0] * 8])
    assert documents_of_mask(mask).tolist() == [[0, 0, 1, 1, 1, 1, 2, 2], [0] * 7 + [1], [0] * 8, [0] * 8]
    assert documents_of_mask(torch.tensor([[1, 1, 0, 1]])) is None
    model = tiny("llama", SDPA_CAUSAL)
    ids = torch.randint(3, 320, mask.shape)
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    inputs = with_document_mask(model, {"input_ids": ids, "attention_mask": mask, "position_ids": positions})
    assert "attention_mask" not in inputs and inputs["documents"].tolist() == documents_of_mask(mask).tolist()
    dense = {"input_ids": ids, "position_ids": positions, "document_mask": padded_causal(mask)}
    with torch.no_grad():
        kept = mask.bool()
        torch.testing.assert_close(model(**inputs).logits[kept], model(**dense).logits[kept], rtol=1e-5, atol=1e-5)
    gapped = torch.tensor([[1, 1, 0, 1, 1, 1, 1, 1]])
    assert "document_mask" in with_document_mask(model, {"input_ids": ids[:1], "attention_mask": gapped})


def dense_reference(query, key, value, documents):
    """What the documents' kernel must equal: sdpa with the whole (seq x seq) block-causal mask."""
    same = documents[:, :, None] == documents[:, None, :]
    mask = (same & torch.ones_like(same).tril())[:, None]
    grouped = query.shape[1] // key.shape[1]
    return F.scaled_dot_product_attention(query, key.repeat_interleave(grouped, 1), value.repeat_interleave(grouped, 1),
                                          attn_mask=mask).transpose(1, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_document_attention_equals_the_dense_masks_forward_and_backward_and_compiles_to_one_node(dtype):
    """Grouped heads (4 query, 2 key/value), three rows: documents of 5, 9 and 2 tokens, one of 16, and 16
    of one token each. Forward and gradients equal sdpa with the dense mask; compiled whole (fullgraph),
    the op is one node that takes the documents as a tensor: new documents, no recompile."""
    from trainloop.model.attention import _documents_loop, document_attention, documents_of

    torch.manual_seed(0)
    positions = torch.stack([torch.cat([torch.arange(5), torch.arange(9), torch.arange(2)]), torch.arange(16),
                             torch.zeros(16, dtype=torch.long)])
    documents = documents_of(positions)
    query = torch.randn(3, 4, 16, 8, dtype=dtype, requires_grad=True)
    key, value = (torch.randn(3, 2, 16, 8, dtype=dtype, requires_grad=True) for _ in range(2))
    tolerance = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    grad = torch.randn(3, 16, 4, 8, dtype=dtype)

    def run(attend, docs):
        out = attend(query, key, value, docs)
        return (out, *torch.autograd.grad(out, (query, key, value), grad))

    want = run(dense_reference, documents)
    for got, expected in zip(run(lambda q, k, v, d: document_attention(q, k, v, d, 8 ** -0.5), documents), want):
        torch.testing.assert_close(got, expected, **tolerance)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(lambda q, k, v, d: document_attention(q, k, v, d, 8 ** -0.5), backend="aot_eager",
                             fullgraph=True)
    for got, expected in zip(run(compiled, documents), want):
        torch.testing.assert_close(got, expected, **tolerance)
    other = documents_of(positions.roll(3, dims=1))  # other documents, the same shapes
    for got, expected in zip(run(compiled, other), run(dense_reference, other)):
        torch.testing.assert_close(got, expected, **tolerance)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    # the loop a device without the CPU kernel takes (sdpa a document, under autograd), run here on the CPU
    for got, expected in zip(run(lambda q, k, v, d: _documents_loop(q, k, v, d, 8 ** -0.5).transpose(1, 2), documents),
                             want):
        torch.testing.assert_close(got, expected, **tolerance)


def test_under_autocast_document_attention_computes_in_its_dtype_as_sdpa_does():
    """precision=bf16 on fp32 weights: rotary embeddings leave the query and key in fp32 and the value in
    bf16; sdpa is one of autocast's bf16 ops, and the document attention casts as autocast does."""
    from trainloop.model.attention import document_attention, documents_of

    torch.manual_seed(0)
    documents = documents_of(torch.cat([torch.arange(7), torch.arange(9)]).unsqueeze(0))
    query, key = torch.randn(1, 2, 16, 8), torch.randn(1, 2, 16, 8)
    value = torch.randn(1, 2, 16, 8, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = document_attention(query, key, value, documents, 8 ** -0.5)
        want = dense_reference(query, key, value, documents)
    assert got.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


def test_a_batch_carries_position_ids_only_where_a_row_restarts_them():
    from trainloop.data.loaders import collate

    one = {"input_ids": torch.arange(6), "labels": torch.arange(6), "position_ids": torch.arange(6)}
    packed = {**one, "position_ids": torch.tensor([0, 1, 2, 0, 1, 2])}
    assert "position_ids" not in collate([one, one])  # every row one sequence: the model counts them
    assert torch.equal(collate([one, packed])["position_ids"][1], packed["position_ids"])
    assert set(collate([one, one])) == {"input_ids", "labels"}


def test_which_runs_take_which():
    from trainloop.model.attention import SDPA_CAUSAL, SDPA_DOCUMENTS, training_attention
    from trainloop.model.builder import build_model_config
    from trainloop.objectives import items, row

    def takes(*overrides):
        cfg = compose("+preset=smoke", *overrides)
        return training_attention(cfg, build_model_config(cfg.model, vocab_size=320), items(row(cfg)) is None)

    assert takes("data.packing=stream") == SDPA_CAUSAL
    assert takes("data.packing=documents") == SDPA_DOCUMENTS
    assert takes("data.packing=none") is None  # padded rows come with their attention mask
    assert takes("data.packing=stream", "model.attn_implementation=eager") is None
    assert takes("objective=dpo", "data=preference") is None


def test_the_objectives_that_train_on_token_blocks_take_it():
    """The objectives that train on the data's token blocks (their rows say no pairs, prompts or unpaired
    completions) are the ones whose packed documents the training attention is told of."""
    from trainloop.objectives import OBJECTIVES, items

    assert {name for name, row in OBJECTIVES.items() if items(row) is None} == {"causal_lm", "distill"}


@pytest.mark.parametrize("packing", ["stream", "documents"])
def test_a_run_takes_it_and_exports_a_model_transformers_loads_as_sdpa(tmp_path, caplog, packing):
    from transformers import AutoModelForCausalLM

    caplog.set_level("INFO", logger="trainloop")
    run = train(tmp_path / "run", f"data.packing={packing}", "trainer.max_steps=2", "checkpoint.save_final_model=true",
                "eval.prompts=[hello]", "eval.max_new_tokens=3")  # samples generate at the eval
    assert "attention: sdpa with " in caplog.text and f"(data.packing={packing})" in caplog.text
    assert "sdpa_" not in json.dumps(json.loads((run / "final" / "config.json").read_text()))
    assert AutoModelForCausalLM.from_pretrained(run / "final").config._attn_implementation == "sdpa"


def test_the_summed_loss_shifts_the_labels_and_compiles_with_a_whole_compiled_model():
    from trainloop.model.compile import compile_loss
    from trainloop.objectives.chunked_loss import summed_nll

    torch.manual_seed(0)
    logits = torch.randn(3, 16, 50, dtype=torch.bfloat16)
    labels = torch.randint(0, 50, (3, 16))
    labels[1, :5] = IGNORE
    sliced = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=IGNORE,
                             reduction="sum")  # position t predicts labels[:, t + 1]
    torch.testing.assert_close(summed_nll(logits, labels), sliced, rtol=1e-6, atol=0)
    whole = compose("compile=inductor", "compile.backend=aot_eager").compile
    compiled = compile_loss(whole, summed_nll)
    assert compiled is not summed_nll
    torch.testing.assert_close(compiled(logits, labels), sliced, rtol=1e-6, atol=0)
    assert compile_loss(compose("compile=inductor", "compile.regional=true").compile, summed_nll) is summed_nll
    assert compile_loss(compose().compile, summed_nll) is summed_nll


def test_a_prepared_model_leaves_its_logits_in_autocasts_dtype_and_the_loss_is_unchanged():
    """accelerate casts a prepared model's outputs to fp32 under autocast: one more copy of the
    logits, which a compiled loss could not fuse away. The strategy drops that cast, keeping the
    autocast; the loss upcasts what it reads, to the same sum."""
    from accelerate.utils.operations import convert_to_fp32

    from trainloop.model.builder import build_model, build_model_config
    from trainloop.objectives.chunked_loss import next_token_nll
    from trainloop.optim.optimizers import build_optimizer
    from trainloop.parallel import build_strategy
    from trainloop.parallel.accelerator import build_accelerator

    cfg = compose("+preset=smoke", "precision=bf16")
    reset_accelerate()
    strategy = build_strategy(cfg, build_accelerator(cfg))
    torch.manual_seed(0)
    model = build_model(cfg.model, build_model_config(cfg.model, 320))
    model, _ = strategy.prepare(model, build_optimizer(cfg.optimizer, model, on_cuda=False))
    frozen = strategy.prepare_frozen(build_model(cfg.model, build_model_config(cfg.model, 320)))
    ids = torch.randint(0, 320, (2, 24))
    for prepared in (model, frozen):
        output = prepared(input_ids=ids)
        assert output.logits.dtype == torch.bfloat16  # autocast still on: the weights are fp32
        assert next(prepared.parameters()).dtype == torch.float32
    summed, output = next_token_nll(model, {"input_ids": ids}, ids, chunk=0)
    cast = convert_to_fp32(output.logits)  # what accelerate's wrapper returned
    assert summed.dtype == torch.float32
    # the same reduction over the same layout (every position, the last one's target ignored), so the sums
    # are bitwise equal on any CPU: a sum over another layout ([:, :-1]) differs in the last bits with the
    # vector width (equal on one machine, 3e-5 of 267.6 on another)
    targets = F.pad(ids[:, 1:], (0, 1), value=-100)
    torch.testing.assert_close(summed, F.cross_entropy(cast.flatten(0, 1), targets.flatten(), ignore_index=-100,
                                                       reduction="sum"), rtol=0, atol=0)
    reset_accelerate()
