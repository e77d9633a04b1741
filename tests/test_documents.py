"""Packed documents attend with no (sequence x sequence) mask (issue 61): each document causal through
trainloop's document attention (trainloop/model/attention.py), trained and compared with transformers' own
dense block-causal mask (model.attn_implementation=eager reads the packed rows from the position ids and
builds it), for every objective that packs, and under context and pipeline parallelism.

A document that saw another, a mask that missed a row's restart, or the padding context parallelism adds
attended by the last document would move the losses by far more than the 1e-5 they keep here."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from helpers import TEACHER, completions, conversation, read_metrics, run_log, short_texts, train, warm, write_rows

TOLERANCE = 1e-5
DENSE = "model.attn_implementation=eager"  # transformers' eager attention, with its packed-rows mask


def logged(run_dir: Path) -> list[tuple[int, str, float]]:
    keys = ("loss", "grad_norm", "nll", "teacher_nll", "eval_loss")
    return [(r["step"], key, r[key]) for r in read_metrics(run_dir) for key in keys if isinstance(r.get(key), float)]


def assert_same(got: Path, want: Path) -> None:
    a, b = logged(got), logged(want)
    assert [x[:2] for x in a] == [x[:2] for x in b] and len(a) > 4, (a, b)
    for (step, key, x), (_, _, y) in zip(a, b):
        assert x == pytest.approx(y, rel=TOLERANCE, abs=TOLERANCE), (step, key, x, y)
    assert len({x for _, key, x in a if key == "loss"}) > 1  # the model moved


def assert_packs_documents(*overrides: str) -> None:
    """Every training block of the run's data holds more than one document."""
    from trainloop.data.loaders import build_datasets, build_tokenizer

    from helpers import compose

    cfg = compose(*overrides)
    train_set, _ = build_datasets(cfg.data, build_tokenizer(None, None), cfg.trainer.seed)
    assert all(train_set.restarts), sum(train_set.restarts) / len(train_set)


OBJECTIVES = {
    "causal_lm": lambda tmp: ["data=files", f"data.path={short_texts(tmp / 'texts.jsonl')}"],
    "chat": lambda tmp: ["data=chat", f"data.path={write_rows(tmp / 'chat.jsonl', [{'messages': conversation(i)} for i in range(60)])}",
                         "model.num_heads=4", "model.num_kv_heads=2"],
    "distill": lambda tmp: ["objective=distill", f"objective.teacher={TEACHER}", "data=prompt_completion",
                            f"data.path={completions(tmp / 'rows.jsonl')}"],
}


@pytest.mark.parametrize("objective", sorted(OBJECTIVES))
def test_packed_documents_train_as_transformers_dense_mask_does(tmp_path, caplog, objective):
    """One process, 4 steps of rows that hold several documents each: the document attention's losses,
    gradient norms and evaluation (and distill's cross-entropies) equal the dense mask's within 1e-5."""
    caplog.set_level("INFO", logger="trainloop")
    run = [*OBJECTIVES[objective](tmp_path), f"data.seq_len={256 if objective == 'chat' else 128}"]
    assert_packs_documents("+preset=smoke", *run)
    documents = train(tmp_path / "documents", *run)
    assert "attention: sdpa with each packed document causal" in caplog.text
    assert_same(documents, train(tmp_path / "dense", *run, DENSE))


def test_a_compiled_model_takes_the_documents_whole_graph_and_trains_as_eager(tmp_path, caplog):
    """compile.fullgraph=true (a graph break fails the run) with gradient checkpointing: the document
    attention is one node of the model's graph, and the losses equal the eager run's within 1e-5."""
    import torch._dynamo

    caplog.set_level("INFO", logger="trainloop")
    run = ["data=files", f"data.path={short_texts(tmp_path / 'texts.jsonl')}", "data.seq_len=128",
           "model.gradient_checkpointing=true"]
    eager = train(tmp_path / "eager", *run)
    torch._dynamo.reset()
    compiled = train(tmp_path / "compiled", *run, "compile=inductor", "compile.backend=aot_eager",
                     "compile.fullgraph=true", "compile.optimizer=false")
    assert "torch.compile: whole model" in caplog.text
    assert_same(compiled, eager)


RUN = ["+preset=smoke", "model.tie_embeddings=false", "data.seq_len=256", "data.batch_size=2",
       "trainer.gradient_accumulation_steps=2", "trainer.max_steps=4", "trainer.log_every=1", "trainer.eval_every=2",
       "trainer.eval_batches=2", "logging.progress_bar=false"]


@pytest.mark.slow
def test_context_and_pipeline_parallel_documents_train_as_the_dense_mask_does(tmp_path):
    """cp=2 (each rank attends half the heads over the whole sequence, its documents whole) and pp=2 (each
    stage takes the micro-batch's documents) on 2 processes against one process with the dense mask."""
    run = [*RUN, "data=files", f"data.path={short_texts(tmp_path / 'texts.jsonl')}"]
    assert_packs_documents(*run)
    dense = train(tmp_path / "dense", *run, DENSE, small=False)
    for layout in ("parallel.cp_size=2", "parallel.pp_size=2"):
        run_dir = tmp_path / layout.split("=")[0]
        warm(2, [*run, layout, f"hydra.run.dir={run_dir}"], cwd=tmp_path)
        assert {r["world_size"] for r in read_metrics(run_dir) if "world_size" in r} == {2}
        assert "attention: sdpa with each packed document causal" in run_log(run_dir)
        assert_same(run_dir, dense)


def test_one_document_a_row_is_sdpas_causal_kernel_bit_for_bit():
    from trainloop.model.attention import document_attention

    torch.manual_seed(0)
    query, key, value = (torch.randn(2, 4, 32, 8, requires_grad=True) for _ in range(3))
    whole = torch.nn.functional.scaled_dot_product_attention(query, key, value, is_causal=True).transpose(1, 2)
    one = document_attention(query, key, value, torch.zeros(2, 32, dtype=torch.int32), 8 ** -0.5)
    assert torch.equal(one, whole)
    grad = torch.randn_like(whole)
    for a, b in zip(torch.autograd.grad(one, (query, key, value), grad),
                    torch.autograd.grad(whole, (query, key, value), grad)):
        assert torch.equal(a, b)


def test_the_documents_stay_in_host_memory_where_the_attention_reads_them():
    """The loop sends a batch to the device but its documents (trainloop.model.attention.ON_HOST), which the
    attention reads on the host once a layer: no wait for the device. Here the device is `meta`, so what moved
    shows."""
    from trainloop.data.loaders import build_dataloaders
    from trainloop.data.order import GlobalOrder
    from trainloop.data.sets import PackedBlocks
    from trainloop.loop import TrainState, batches_forever

    from helpers import compose

    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 0], list(range(8))] * 2)
    blocks = PackedBlocks(torch.arange(32).view(4, 8), position_ids=positions)
    order = GlobalOrder(4, seed=0, batch_size=2, accumulation=1, world_size=1, rank=0, shuffle=False)
    loader, _ = build_dataloaders(compose("data.batch_size=2").data, blocks, blocks, pin_memory=False, order=order)
    batch = next(batches_forever(SimpleNamespace(device=torch.device("meta"), non_blocking=False), loader,
                                 TrainState()))
    assert {key: t.device.type for key, t in batch.items()} == {
        "input_ids": "meta", "labels": "meta", "position_ids": "meta", "documents": "cpu"}
    assert batch["documents"].tolist() == [[0, 0, 0, 1, 1, 1, 1, 2], [0] * 8]


def test_the_benchmark_measures_both_paths_on_the_same_packed_block(tmp_path, capsys):
    """scripts/bench_attention.py's kernel part, at 512 tokens: both paths run on a block of several documents
    and report tokens/s and peak memory (the figures are BENCHMARKS.md's, from the full run)."""
    import json

    from helpers import script

    out = tmp_path / "bench.json"
    assert script("bench_attention").main(["--parts", "kernel", "--lengths", "512", "--steps", "1",
                                           "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["kernel"]
    assert [r["path"] for r in rows] == ["dense", "documents"]
    assert all(r["tokens"] == 512 and r["documents"] > 1 and r["tokens_per_s"] > 0 and r["peak_bytes"] > 0
               for r in rows), rows
    assert "| 512 |" in capsys.readouterr().out
