"""logging.profile_steps: a torch.profiler trace of exactly the chosen optimizer steps."""

import json

import pytest

from helpers import compose, train
from trainloop.config.compose import ConfigError, validate

MATMULS = {"aten::mm", "aten::addmm", "aten::matmul", "aten::linear"}


def test_trace_holds_the_window_and_the_models_matmuls(tmp_path):
    run_dir = train(tmp_path / "run", "trainer.max_steps=8", "logging.profile_steps=[5,8]")
    traces = list((run_dir / "profile").glob("*.pt.trace.json"))
    assert [t.name for t in traces] == ["rank0_steps5-8.pt.trace.json"]
    events = json.loads(traces[0].read_text())["traceEvents"]
    names = [e.get("name", "") for e in events if e.get("ph") == "X"]
    assert MATMULS & set(names), "no matmul op in the trace"
    # one ProfilerStep marker per recorded optimizer step: 5, 6, 7, 8 and no other
    assert sum(n.startswith("ProfilerStep#") for n in names) == 4
    shapes = [e for e in events if e.get("name") == "aten::mm" and e.get("args", {}).get("Input Dims")]
    assert shapes, "record_shapes: aten::mm events carry their input dims"


@pytest.mark.parametrize("window, says", [
    ("[0,3]", "1 <= START <= END"),
    ("[4,2]", "1 <= START <= END"),
    ("[3]", "two optimizer steps"),
    ("[2,99]", "END <= trainer.max_steps"),
])
def test_bad_window_is_refused(window, says):
    cfg = compose("+preset=smoke", "trainer.max_steps=8", f"logging.profile_steps={window}")
    with pytest.raises(ConfigError, match="logging.profile_steps") as err:
        validate(cfg)
    assert says in str(err.value)
