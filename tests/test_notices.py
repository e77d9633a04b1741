"""Other libraries' notices that say nothing about a run are dropped where they are logged, and
nothing else is (issue 33, item 9). The command-line run that would print them is in
tests/test_adapter.py (the fine-tune command)."""

from __future__ import annotations

import enum
import logging
import sys

from trainloop.observe.notices import LibraryNotices, built_for_another_python, cuda_build, says_nothing

THIS_PYTHON = f"cpython-{sys.version_info.major}{sys.version_info.minor}"


def record(logger: str, message: str, *args, level: int = logging.WARNING) -> logging.LogRecord:
    return logging.getLogger(logger).makeRecord(logger, level, __file__, 1, message, args, None)


class Mine(enum.Enum):
    A = 1


def test_only_the_notices_that_say_nothing_are_dropped():
    # one of the enums torchao registers at import, as its module names it (importing torchao takes seconds)
    torchaos = enum.Enum("KernelPreference", "AUTO", module="torchao.quantization.quantize_.common.kernel_preference")
    other_python = "/v/lib/python3.11/site-packages/torchao/_C_mxfp8.cpython-310-x86_64-linux-gnu.so"
    if THIS_PYTHON == "cpython-310":
        other_python = other_python.replace("cpython-310", "cpython-311")
    cuda_kernels = "/v/site-packages/torchao/_C_cutlass_90a.abi3.so"
    assert built_for_another_python(other_python) and not built_for_another_python(cuda_kernels)
    assert not built_for_another_python(f"/v/torchao/_C.{THIS_PYTHON}-x86_64-linux-gnu.so")

    assert says_nothing(record("torchao", f"Failed to load {other_python}: Could not load this library"))
    assert says_nothing(record("torchao", f"Failed to load {cuda_kernels}: x")) == (not cuda_build())
    assert says_nothing(record("torchao.kernel.intmm", "Warning: Detected no triton, on systems without "
                                                       "Triton certain kernels will not work")) == (not cuda_build())
    deprecated = "%s is an Enum subclass and is now natively supported by torch.compile as an opaque value type."
    assert says_nothing(record("torch.utils._pytree", deprecated, torchaos))
    kept = [record("torch.utils._pytree", deprecated, Mine),  # the user's own call: theirs to hear
            record("torchao", "Skipping import of cpp extensions due to incompatible torch version"),
            record("torchao", "Failed to load /elsewhere/my_ops.so: x"),
            record("trainloop", "Failed to load /v/site-packages/torchao/_C_mxfp8.cpython-310.so"),
            record("torch.utils._pytree", "something else")]
    assert not any(says_nothing(r) for r in kept)
    assert all(LibraryNotices().filter(r) for r in kept)


def test_the_filter_sits_on_each_source_once_trainloop_is_imported():
    import trainloop  # noqa: F401 - installs it

    for name in LibraryNotices.SOURCES:
        assert sum(isinstance(f, LibraryNotices) for f in logging.getLogger(name).filters) == 1, name


def test_bitsandbytes_hub_kernel_notice_is_dropped_only_offline(monkeypatch):
    notice = record("bitsandbytes.backends.cpu.ops", "Failed to load CPU gemm_4bit_forward from kernels-community: "
                    "%s. Please make sure you already `pip install kernels`", "No module named 'kernels'")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # trainloop's default: the kernel could never be fetched
    assert says_nothing(notice)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")  # online, installing `kernels` would help: keep it
    assert not says_nothing(notice)
