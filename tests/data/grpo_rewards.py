"""Reward functions of the toy task that tests/test_grpo.py trains on, loaded by file path
(objective.rewards=[tests/data/grpo_rewards.py:letters]), as a user's own file would be."""

import os
import signal

CALLS = {"letters_then_sigterm": 0, "fails": 0}


def letters(prompts, completions, **columns):
    """The share of the completion's characters that are lowercase letters (0.0 for an empty one)."""
    return [sum("a" <= ch <= "z" for ch in c) / len(c) if c else 0.0 for c in completions]


def letters_then_sigterm(prompts, completions, **columns):
    """letters; and at its call numbered $GRPO_SIGTERM_AT_CALL (when set), a SIGTERM to this process,
    mid-step, as a scheduler's preemption would send it at any moment."""
    CALLS["letters_then_sigterm"] += 1
    if str(CALLS["letters_then_sigterm"]) == os.environ.get("GRPO_SIGTERM_AT_CALL"):
        os.kill(os.getpid(), signal.SIGTERM)
    return letters(prompts, completions)


def fails(prompts, completions, **columns):
    """A reward function with a bug: from its third call (step 3), it raises on a row whose completion holds a 'q'."""
    CALLS["fails"] += 1
    return [1.0 / (0 if "q" in c and CALLS["fails"] >= 3 else 1) for c in completions]


def too_few(prompts, completions, **columns):
    return [1.0] * (len(completions) - 1)


def nan_first(prompts, completions, **columns):
    """A broken verifier: NaN for the first completion of each call."""
    return [float("nan")] + [0.5] * (len(completions) - 1)


def none(prompts, completions, **columns):
    """A function that applies to no completion (a column it reads that no row holds)."""
    return [None] * len(completions)


def infinite_last(prompts, completions, **columns):
    return [0.5] * (len(completions) - 1) + [float("inf")]


class Echo:
    """An environment for text prompts (objective.environment=tests/data/grpo_rewards.py:Echo): reset appends
    ' Go:' to the prompt; get_reward is 1.0 where the instance was reset since its last reward (0.0 where two
    rollouts shared it)."""

    def reset(self, prompt, **row) -> str:
        self.prompt = prompt
        return " Go:"

    def get_reward(self) -> float:
        prompt, self.prompt = getattr(self, "prompt", None), None
        return float(prompt is not None)
