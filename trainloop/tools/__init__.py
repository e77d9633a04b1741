"""The user-facing tools around a run: doctor, plan, report, reference, verify_resume, sweep,
hardware. Nothing on the training path (trainloop/) calls into them, except telemetry, which
reads the GPUs through hardware. Each keeps its `python -m trainloop.NAME` entry point."""
