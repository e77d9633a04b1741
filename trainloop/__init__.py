"""trainloop: Hydra configs composed into one hand-written Accelerate training loop."""

from trainloop.observe.notices import quiet_library_notices

__version__ = "0.1.0"

quiet_library_notices()  # before any command can import transformers, which imports torchao


def train(overrides=(), **objects):
    """A run from Python: trainloop.api.train (imported on first use, so `python -m trainloop --help` stays fast)."""
    from trainloop.api import train as run_in_process

    return run_in_process(overrides, **objects)
