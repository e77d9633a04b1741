"""What other libraries log as trainloop imports them that says nothing about a run, dropped where
it is logged: a filter on the one logger that writes it, matching the one message, so a user sees
trainloop's lines and real warnings only.

transformers imports torchao with every model class whenever it is installed, fp8 or not. torchao
then loads its C++ kernels (CUDA ones, and one built for another Python: `cpython-310` under 3.11),
probes for Triton, and registers its enums with a call torch has deprecated. peft imports
bitsandbytes, which on some CPUs fetches a kernel from the Hugging Face Hub.

Installed by trainloop/__init__.py: every command imports the package before anything that can
import transformers. This module imports nothing heavy; torch only once such a record arrives.
"""

from __future__ import annotations

import logging
import os
import re
import sys


def cuda_build() -> bool:
    import torch

    return torch.version.cuda is not None


def built_for_another_python(message: str) -> bool:
    """A binary named for a CPython other than this one (`_C_mxfp8.cpython-310-...so`) never loads."""
    tag = re.search(r"\.cpython-(\d+)", message)
    return tag is not None and tag[1] != f"{sys.version_info.major}{sys.version_info.minor}"


def says_nothing(record: logging.LogRecord) -> bool:
    """Whether `record` is one of the notices above, where it tells a user nothing."""
    message = record.getMessage()
    if record.name == "torchao":  # its kernels: a CPU build loads none, no build loads another Python's
        return (message.startswith("Failed to load ") and "/torchao/_C" in message
                and (not cuda_build() or built_for_another_python(message)))
    if record.name == "torchao.kernel.intmm":  # Triton kernels run on GPUs only
        return "Detected no triton" in message and not cuda_build()
    if record.name == "torch.utils._pytree":  # torchao's own deprecated call, nothing a user can change
        registered = record.args[0] if isinstance(record.args, tuple) and record.args else None
        return "is an Enum subclass" in message and getattr(registered, "__module__", "").startswith("torchao")
    if record.name == "bitsandbytes.backends.cpu.ops":  # a Hub kernel: an offline run cannot fetch it
        return "from kernels-community" in message and os.environ.get("HF_HUB_OFFLINE") == "1"
    return False


class LibraryNotices(logging.Filter):
    SOURCES = ("torchao", "torchao.kernel.intmm", "torch.utils._pytree", "bitsandbytes.backends.cpu.ops")

    def filter(self, record: logging.LogRecord) -> bool:
        return not says_nothing(record)


NOTICES = LibraryNotices()


def quiet_library_notices() -> None:
    """Install the filter on each logger that writes one of the notices (once)."""
    for name in LibraryNotices.SOURCES:
        logger = logging.getLogger(name)
        if NOTICES not in logger.filters:
            logger.addFilter(NOTICES)
