"""trainloop: Hydra configs composed into one hand-written Accelerate training loop."""

from trainloop.observe.notices import quiet_library_notices

__version__ = "0.1.0"

quiet_library_notices()  # before any command can import transformers, which imports torchao
