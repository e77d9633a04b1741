"""trainloop: Hydra configs composed into one hand-written Accelerate training loop."""

__version__ = "0.1.0"
