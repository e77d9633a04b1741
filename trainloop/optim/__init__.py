"""Optimizers and the learning-rate schedule."""
