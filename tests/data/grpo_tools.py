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


class Vault:
    """An environment (objective.environment=tests/data/grpo_tools.py:Vault): each rollout's vault holds
    its row's `secret`, which only the `vault` tool reveals; get_reward pays for opening it once."""

    def reset(self, secret, **row) -> str:
        self.secret, self.opened = str(secret), 0
        return " (the vault is locked)"

    def vault(self) -> str:
        """The number in the vault."""
        self.opened += 1
        return self.secret

    def get_reward(self) -> float:
        return float(self.opened == 1)


class NoReset:
    def vault(self) -> str:
        """The number in the vault."""
        return "1"


class Undocumented:
    def reset(self, **row):
        pass

    def peek(self, key):
        return key


class Clash:
    """Its method has the name of the lookup tool."""

    def reset(self, **row):
        pass

    def lookup(self, key: str) -> str:
        """The value stored under a key.

        Args:
            key: the name to look up
        """
        return key


class Unmakeable:
    def __init__(self):
        raise RuntimeError("no database")


class Quiet:
    """An environment without a reward: the reward functions must give one."""

    def reset(self, **row):
        pass


def reports(key: str) -> dict:
    """A tool whose answer is an error of its own (it has not failed).

    Args:
        key: the name to look up
    """
    return {"error": "not stored"}
