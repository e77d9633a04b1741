"""Checkpoints: what a resume must agree with, file integrity, the durable commit, and the saver."""
