"""The config: its schema (a dataclass per section) and its composition by Hydra, then its checks."""
