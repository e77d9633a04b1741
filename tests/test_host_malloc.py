"""`python -m trainloop` runs with jemalloc's malloc where it is installed, as PyTorch's CPU launcher preloads it:
glibc's heap keeps freed tensors resident in holes, and a run's peak wandered by tens of MB from one run to the
next (BENCHMARKS.md)."""

from __future__ import annotations

import pytest

from helpers import clean_env, launch
from trainloop.__main__ import with_jemalloc
from trainloop.memory.proc import jemalloc_library

JEMALLOC = jemalloc_library()
RUN = ["/venv/bin/python", "-m", "trainloop", "+preset=smoke"]


def installed() -> str:  # with_jemalloc's `find` where jemalloc is installed
    return "libjemalloc.so.2"


def test_the_run_starts_again_with_jemalloc_before_what_is_preloaded_and_only_as_python_m_trainloop():
    assert with_jemalloc(RUN, {}, installed) == "libjemalloc.so.2"
    assert with_jemalloc(["python", "-u", "-m", "trainloop"], {"LD_PRELOAD": "libx.so"},  # torchrun's command
                         installed) == "libjemalloc.so.2:libx.so"
    assert with_jemalloc(["python", "-mtrainloop"], {}, installed) == "libjemalloc.so.2"
    assert with_jemalloc(["python", "-X", "importtime", "-W", "ignore", "-m", "trainloop"], {},
                         installed) == "libjemalloc.so.2"
    for argv, environ, find in [
        (RUN, {}, lambda: None),  # not installed
        (RUN, {"TRAINLOOP_MALLOC": "glibc"}, installed),
        (RUN, {"LD_PRELOAD": "/usr/lib/libjemalloc.so.2"}, installed),  # this exec's own, or the user's
        (RUN, {"LD_PRELOAD": "/usr/lib/libtcmalloc.so.4"}, installed),  # the user's own allocator
        (["python", "tests/warm_ranks.py", "-m", "trainloop"], {}, installed),  # a test's warm rank
        (["python", "-m", "trainloop.plan"], {}, installed),
        (["python", "-c", "import trainloop", "-m", "trainloop"], {}, installed),
        (["python", "-m", "pytest", "-m", "trainloop"], {}, installed),
    ]:
        assert with_jemalloc(argv, environ, find) is None, (argv, environ)
    with pytest.raises(SystemExit) as refused:
        with_jemalloc(RUN, {"TRAINLOOP_MALLOC": "tcmalloc"}, installed)
    assert refused.value.code == 2


@pytest.mark.skipif(JEMALLOC is None, reason="jemalloc is not installed (scripts/setup.sh installs libjemalloc2)")
def test_a_run_says_which_malloc_it_took_and_glibc_is_kept_on_request(tmp_path):
    for environ, said in [({}, "host malloc: jemalloc (TRAINLOOP_MALLOC=glibc keeps glibc's)"),
                          ({"TRAINLOOP_MALLOC": "glibc"}, "host malloc: glibc\n")]:
        run = tmp_path / (environ.get("TRAINLOOP_MALLOC") or "default")
        done = launch(["python", "-m", "trainloop", "+preset=smoke", "trainer.max_steps=1", "logging.trackers=[]",
                       "checkpoint.save_final_model=false", f"hydra.run.dir={run}"], env=clean_env(**environ))
        assert said in (run / "train.log").read_text(), done.stderr[-3000:]
    # glibc's mallopt would not reach jemalloc's heap: the measurement that relies on it says it did not take
    check = launch(["python", "-c", "from trainloop.tools.measure import track_live_memory as t; print(t(True))"],
                   env=clean_env(LD_PRELOAD=JEMALLOC))
    assert check.stdout.strip() == "False", check.stderr[-2000:]
