"""Tools of tests/test_grpo_tools.py, loaded by file path (objective.tools=[tests/data/grpo_tools.py:lookup]),
as a user's own file would be."""

import time

VALUES = {"alpha": "417", "beta": "92"}


def lookup(key: str) -> str:
    """The value stored under a key.

    Args:
        key: the name to look up
    """
    return VALUES.get(key, "unknown")


def broken(key: str) -> str:
    """A tool with a bug: it raises on every call.

    Args:
        key: the name to look up
    """
    raise KeyError(f"no table for {key}")


def hangs(key: str) -> str:
    """A tool that does not answer in time.

    Args:
        key: the name to look up
    """
    time.sleep(30)
    return "too late"


def undocumented(key):
    return key
