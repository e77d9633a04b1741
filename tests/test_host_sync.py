"""The step reads nothing on the host between two log lines (issue 35, item 1).

A host read waits for the device: on a GPU the host then cannot queue the next step while the
device works. The same ops run on CPU, so a run here counts them per step of the loop with a
TorchDispatchMode (aten._local_scalar_dense: .item(), float(), bool(), `if tensor:`; and copies
from a device to the host) and a TorchFunctionMode (.tolist() and .numpy(), which reach no aten op
on CPU). The guard's staged flags are the one host buffer read between log lines: they were copied
toward the host (pinned, non-blocking) a step before and are read one step late, when the device
is past them (trainloop/guard.py).
"""

from __future__ import annotations

import traceback
from collections import Counter

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from helpers import compose, read_metrics, safetensors_of, short_texts, train
from trainloop import guard as guard_module, loop

MASK_INFERENCE = "transformers/masking_utils.py"
LOADER_COLLATE = ("trainloop/data/loaders.py", "collate")
DOCUMENT_SPANS = ("trainloop/model/attention.py", "spans")
MASKS = " in transformers' mask inference"
READ_OPS = {"aten._local_scalar_dense.default", "aten.is_nonzero.default", "aten.equal.default"}
READ_METHODS = {"tolist", "numpy", "item", "__bool__", "__float__", "__int__", "__index__"}


class HostReads(TorchDispatchMode):
    """Counts host reads by the loop's iteration they happen in (set by the patched train_step)."""

    def __init__(self):
        super().__init__()
        self.iteration = 0
        self.ops: Counter = Counter()  # trainloop's own ops (trainloop.model.attention) run
        self.reads: Counter = Counter()
        self.what: dict[int, list[str]] = {}

    def note(self, what: str) -> None:
        """A read, said with where it comes from: transformers' mask inference, or elsewhere. The data
        loader's collate reads the batch it makes in host memory (on a GPU, before its copy to the
        device), and the document attention's spans read the documents the loader made there, which
        the loop leaves there (tests/test_documents.py): no wait for the device, so not counted."""
        frames = traceback.extract_stack()
        if any(f.filename.endswith(where) and f.name == name for f in frames
               for where, name in (LOADER_COLLATE, DOCUMENT_SPANS)):
            return
        if any(f.filename.endswith(MASK_INFERENCE) for f in frames):
            what += MASKS
        self.reads[self.iteration] += 1
        self.what.setdefault(self.iteration, []).append(what)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func)
        if name.startswith("trainloop."):  # what runs inside is not seen here: test_the_document_attention_...
            self.ops[name] += 1
        if name in READ_OPS:
            self.note(name)
        elif name in ("aten._to_copy.default", "aten.copy_.default"):
            source = args[1] if name == "aten.copy_.default" else args[0]
            target = args[0].device if name == "aten.copy_.default" else kwargs.get("device", source.device)
            if source.device.type != "cpu" and torch.device(target).type == "cpu":
                self.note(f"{name} from {source.device}")
        return func(*args, **kwargs)


class MethodReads(TorchFunctionMode):
    """Counts .tolist(), .numpy() and the like, but of the guards' staged flags (host memory)."""

    def __init__(self, counter: HostReads, guards: list):
        super().__init__()
        self.counter, self.guards = counter, guards

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in READ_METHODS and args and not any(args[0] is g.staged for g in self.guards):
            self.counter.note(f"Tensor.{name}")
        return func(*args, **(kwargs or {}))


def run_guards(monkeypatch) -> list:
    """The StepGuards the runs of this test build, in order (the run builds its own)."""
    guards, real_init = [], guard_module.StepGuard.__init__

    def init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        guards.append(self)

    monkeypatch.setattr(guard_module.StepGuard, "__init__", init)
    return guards


def counted_run(tmp_path, monkeypatch, *overrides: str) -> tuple[HostReads, list, list]:
    """A run in this process whose host reads are counted per iteration of the loop: iteration n
    runs from step n's train_step to step n + 1's (its log line, evaluation and save included). One
    block and one evaluation batch: every op runs through both modes, and a read in a block's forward
    or backward is seen in the one as well as in two."""
    counter, guards, real_step = HostReads(), run_guards(monkeypatch), loop.train_step

    def step(*args, **kwargs):
        counter.iteration += 1
        return real_step(*args, **kwargs)

    monkeypatch.setattr(loop, "train_step", step)
    with counter, MethodReads(counter, guards):
        run = train(tmp_path / "run", "trainer.max_steps=8", "trainer.log_every=4", "trainer.eval_every=8",
                    "trainer.gradient_accumulation_steps=2", "checkpoint.save_final_model=false", "model.num_layers=1",
                    "trainer.eval_batches=1", *overrides)
    return counter, read_metrics(run), guards


FUSED = ("optimizer=adamw", "optimizer.impl=fused")
QUIET = [1, 2, 3, 5, 6, 7]  # the iterations that neither log, evaluate nor save


@pytest.mark.parametrize("packing", ["documents", "stream"])
def test_the_steps_between_two_log_lines_read_nothing_on_the_host(tmp_path, monkeypatch, packing):
    """optimizer=adamw (fused: torch's kernel takes the guard's found_inf), accumulation 2, the guard
    on. transformers would read the position ids once per forward, looking for packed rows; the
    training attention (trainloop/model/attention.py) leaves it no mask to build. Packed documents:
    short texts, several in every block, through the document attention's ops (what they run inside
    is counted by the test below)."""
    data = ["data=files", f"data.path={short_texts(tmp_path / 'texts.jsonl')}"] if packing == "documents" else []
    counter, records, guards = counted_run(tmp_path, monkeypatch, *FUSED, f"data.packing={packing}", *data)
    assert (counter.ops["trainloop.document_attention.default"] > 0) == (packing == "documents")
    assert guards[0].late, "fused AdamW skips a non-finite update on the device: the guard reads one step late"
    assert [r["step"] for r in records if "loss" in r] == [4, 8]
    assert {n: counter.what.get(n, []) for n in QUIET} == {n: [] for n in QUIET}
    assert len(counter.what[4]) > 0  # a log line reads: the count sees reads


def test_the_document_attention_reads_only_the_documents_in_host_memory():
    """Inside its ops (which a dispatch mode sees as one call each), the document attention reads the host
    tensor of documents the loader made, which the loop leaves there (tests/test_documents.py), and nothing
    else: its forward and backward run here as plain Python under the count."""
    from trainloop.model.attention import _documents_backward, _documents_forward, documents_of

    counter = HostReads()
    documents = documents_of(torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2]]))
    query, key, value, grad = (torch.randn(1, 2, 8, 4) for _ in range(4))
    with counter, MethodReads(counter, []):
        out, logsumexp = _documents_forward._init_fn(query, key, value, documents, 0.5)
        _documents_backward._init_fn(grad, query, key, value, out, logsumexp, documents, 0.5)
    assert counter.what == {}
    with counter, MethodReads(counter, []):
        documents.tolist()  # the count sees a read of them outside the spans
    assert counter.what == {0: ["Tensor.tolist"]}


def test_transformers_own_masks_read_the_position_ids_once_a_forward(tmp_path, monkeypatch):
    """model.attn_implementation=eager keeps transformers' masks: its packed-rows search reads on the
    host once per forward (seen as __bool__ and its _local_scalar_dense), two micro-batches a step;
    trainloop itself reads nothing there either. The count sees what is there to see."""
    counter, _, _ = counted_run(tmp_path, monkeypatch, *FUSED, "model.attn_implementation=eager")
    assert {n: [w for w in counter.what.get(n, []) if MASKS not in w] for n in QUIET} == {n: [] for n in QUIET}
    assert all(len(counter.what[n]) == 2 * 2 for n in QUIET), counter.what


def test_an_optimizer_that_cannot_skip_on_the_device_reads_the_verdict_every_step(tmp_path, monkeypatch):
    """A for-loop AdamW needs the verdict on the host before its update: one read a step."""
    counter, records, guards = counted_run(tmp_path, monkeypatch, "optimizer=adamw", "optimizer.impl=for_loop")
    assert not guards[0].late
    for n in QUIET:
        assert [w for w in counter.what[n] if MASKS not in w], n  # the verdict, read at once


# optimizer (overrides) -> whether it skips a non-finite update on the device (so the guard reads one step late)
SKIPS_ON_DEVICE = {"adamw impl=fused": True, "adamw impl=foreach": False, "adamw impl=for_loop": False,
                   "sgd": False, "adafactor": False, "muon": False}


@pytest.mark.parametrize("option", sorted(SKIPS_ON_DEVICE))
def test_which_optimizers_skip_on_the_device(option):
    """torch's fused kernels take found_inf (`_step_supports_amp_scaling`); the others need the verdict first.
    optimizer.impl=auto is fused, on CPU as on CUDA (trainloop/optim/optimizers.py); bitsandbytes' 8-bit ones are not."""
    from trainloop.guard import skips_on_device
    from trainloop.optim.optimizers import build_optimizer

    name, *impl = option.split()
    cfg = compose(f"optimizer={name}", *(f"optimizer.{i}" for i in impl)).optimizer
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    assert skips_on_device(build_optimizer(cfg, model, on_cuda=False)) is SKIPS_ON_DEVICE[option]


@pytest.mark.slow
def test_a_non_finite_step_read_a_step_late_is_skipped_as_one_read_at_once(tmp_path):
    """lr=1e6: every step after the first is non-finite. Read one step late (log every 4 steps) or at
    once (every step), the same steps are skipped, the schedule holds, and the weights end the same."""
    runs = {}
    for log_every in (1, 4):
        run = train(tmp_path / f"every_{log_every}", *FUSED, "optimizer.lr=1e6", "trainer.on_nonfinite=skip",
                    "trainer.max_steps=8", f"trainer.log_every={log_every}", "trainer.eval_every=8",
                    "checkpoint.save_final_model=true")
        runs[log_every] = ({r["step"]: r for r in read_metrics(run) if "loss" in r}, safetensors_of(run / "final"))
    (late, late_weights), (eager, eager_weights) = runs[4], runs[1]
    assert late[8]["nonfinite_steps"] == eager[8]["nonfinite_steps"] == 7
    assert late[4]["nonfinite_steps"] == eager[4]["nonfinite_steps"] == 3
    assert late[4]["lr"] == eager[4]["lr"] == eager[2]["lr"]  # the schedule holds on a skipped update
    assert late_weights.keys() == eager_weights.keys()
    assert all(torch.equal(late_weights[k], eager_weights[k]) for k in late_weights)


def test_a_non_finite_step_read_a_step_late_stops_the_next_and_names_it(tmp_path):
    from trainloop.errors import NonFiniteError

    with pytest.raises(NonFiniteError, match=r"non-finite .* at optimizer step 2 "):
        train(tmp_path / "run", *FUSED, "optimizer.lr=1e6", "trainer.on_nonfinite=stop", "trainer.max_steps=8",
              "trainer.log_every=4", "trainer.eval_every=8")


def test_a_stop_requested_between_log_lines_stops_every_rank_one_step_later(tmp_path, monkeypatch):
    """The preemption flag rides on the guard's flags: read one step late, the run stops after the next step."""
    from trainloop.errors import Preempted

    guards, real_step = run_guards(monkeypatch), loop.train_step

    def step(strategy, objective, model, optimizer, group, *, state, **kwargs):
        if state.step == 2:  # a signal arrives while step 3 is computed
            guards[0].preemption.requested = "SIGTERM"
        return real_step(strategy, objective, model, optimizer, group, state=state, **kwargs)

    monkeypatch.setattr(loop, "train_step", step)
    with pytest.raises(Preempted, match="after step 4"):
        train(tmp_path / "run", *FUSED, "trainer.max_steps=8", "trainer.log_every=8", "trainer.eval_every=8")
    assert guards[0].late
    records = read_metrics(tmp_path / "run")
    assert [r["step"] for r in records if "loss" in r] == [4]  # the window so far, logged at the stop
    assert (tmp_path / "run" / "checkpoints" / "step_0000004").is_dir()
