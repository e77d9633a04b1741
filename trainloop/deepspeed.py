"""`python -m trainloop.deepspeed`: build DeepSpeed's ops ahead of the first run (the entry point of
trainloop/parallel/deepspeed_config.py's build_ops)."""

from trainloop.parallel.deepspeed_config import build_ops

if __name__ == "__main__":
    print("built or found:", ", ".join(build_ops()))
