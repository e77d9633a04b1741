"""`python -m trainloop.verify_resume [options] [overrides]`: does resuming change the run?

Trains N steps straight, then N/2 steps + stop + resume + N/2 steps, on the user's own config
(the same overrides), each as a fresh launch of `python -m trainloop` (or torchrun with --nproc),
and compares the per-step losses and the final weights: bitwise, and by the largest relative
difference. Exit 0 when they agree within --rtol, 1 when not, 2 for a bad config. The checkpoint
the resume loads is checked first (sizes, formats, checksums), as `--check PATH` checks any.

Relative difference: |a - b| / |a| per loss; max|a - b| / max|a| per weight tensor.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

# Set by this command; the same keys among the user's overrides are replaced.
FORCED = ("trainer.max_steps", "trainer.log_every", "trainer.eval_every", "trainer.stop_at_step",
          "checkpoint.resume", "checkpoint.every_steps", "checkpoint.save_final_model",
          "logging.progress_bar", "hydra.run.dir")


@dataclass
class Comparison:
    steps: int
    losses_bitwise: bool
    losses_max_rel: float
    first_differing_step: int | None
    weights_bitwise: bool
    weights_max_rel: float
    tensors: int
    notes: list[str] = field(default_factory=list)

    @property
    def max_rel(self) -> float:
        return max(self.losses_max_rel, self.weights_max_rel)

    def report(self, rtol: float) -> str:
        def verdict(bitwise: bool, rel: float) -> str:
            return "bitwise identical" if bitwise else f"differ, max relative difference {rel:.3g}"

        lines = [f"losses  ({self.steps} steps): {verdict(self.losses_bitwise, self.losses_max_rel)}"
                 + (f", first at step {self.first_differing_step}" if self.first_differing_step else ""),
                 f"weights ({self.tensors} tensors): {verdict(self.weights_bitwise, self.weights_max_rel)}",
                 *self.notes]
        ok = self.agrees(rtol)
        lines.append(f"resume {'OK' if ok else 'CHANGES THE RUN'}: max relative difference "
                     f"{self.max_rel:.3g} {'<=' if ok else '>'} --rtol {rtol:g}")
        return "\n".join(lines)

    def agrees(self, rtol: float) -> bool:
        return not self.notes and self.max_rel <= rtol


def _relative(a: float, b: float) -> float:
    if a == b:
        return 0.0
    return abs(a - b) / max(abs(a), 1e-30)


def step_losses(run_dir: Path) -> dict[int, float]:
    """The last logged training loss of each step (a resumed run appends to metrics.jsonl)."""
    losses = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "loss" in record:
            losses[record["step"]] = record["loss"]
        if "eval_loss" in record:
            losses[f"eval@{record['step']}"] = record["eval_loss"]
    return losses


def final_weights(run_dir: Path) -> dict:
    from safetensors.torch import load_file

    weights = {}
    for file in sorted((run_dir / "final").glob("*.safetensors")):  # one file, or shards
        weights.update(load_file(file))
    return weights


def compare(straight: Path, resumed: Path, steps: int) -> Comparison:
    import torch

    a, b = step_losses(straight), step_losses(resumed)
    notes = [f"step {k}: logged by only one of the runs" for k in sorted(set(a) ^ set(b), key=str)]
    common = [k for k in a if k in b]
    rel = {k: _relative(a[k], b[k]) for k in common}
    differing = [k for k in common if a[k] != b[k] and isinstance(k, int)]

    wa, wb = final_weights(straight), final_weights(resumed)
    notes += [f"weight {k}: in only one of the models" for k in sorted(set(wa) ^ set(wb))]
    weights_rel, bitwise = 0.0, True
    for key in sorted(set(wa) & set(wb)):
        x, y = wa[key].double(), wb[key].double()
        if x.shape != y.shape:
            notes.append(f"weight {key}: shapes {tuple(x.shape)} and {tuple(y.shape)}")
            continue
        bitwise &= torch.equal(wa[key], wb[key])
        scale = x.abs().max().clamp_min(1e-30)
        weights_rel = max(weights_rel, ((x - y).abs().max() / scale).item())
    return Comparison(
        steps=steps, losses_bitwise=all(a[k] == b[k] for k in common),
        losses_max_rel=max(rel.values(), default=0.0),
        first_differing_step=min(differing, default=None),
        weights_bitwise=bitwise, weights_max_rel=weights_rel, tensors=len(set(wa) & set(wb)), notes=notes,
    )


def launch(run: Callable[[list[str], Path], int], overrides: list[str], log_file: Path) -> None:
    """One run of trainloop through `run` (its output in log_file); raises SystemExit with the tail if it fails."""
    t0 = time.perf_counter()
    code = run(overrides, log_file)
    print(f"  -m trainloop {' '.join(shlex.quote(a) for a in overrides)}  -> exit {code} "
          f"({time.perf_counter() - t0:.0f} s, log {log_file})", flush=True)
    if code != 0:
        tail = log_file.read_text()[-3000:]
        print(f"verify_resume: a run failed (exit {code}); the end of its log:\n{tail}", file=sys.stderr)
        raise SystemExit(2 if code == 2 else 1)


def subprocess_runs(launcher: list[str]) -> Callable[[list[str], Path], int]:
    """Each run as `LAUNCHER -m trainloop OVERRIDES` in a process of its own; returns its exit code."""
    def run(overrides: list[str], log_file: Path) -> int:
        with open(log_file, "w") as out:
            return subprocess.call([*launcher, "-m", "trainloop", *overrides], stdout=out, stderr=subprocess.STDOUT)
    return run


def key_of(override: str) -> str:
    return override.lstrip("+~").partition("=")[0]


def parse(argv: list[str]):
    parser = argparse.ArgumentParser(
        prog="python -m trainloop.verify_resume",
        description="Train N steps straight and N/2 + resume + N/2 with your overrides; "
                    "compare losses and final weights.",
        epilog="Anything else is a trainloop override, e.g. +preset=smoke data.num_workers=2")
    parser.add_argument("--steps", type=int, default=20, help="N, optimizer steps in all (default 20)")
    parser.add_argument("--nproc", type=int, default=1,
                        help="processes; more than 1 launches each run with torchrun --standalone")
    parser.add_argument("--launcher", help="your own launch prefix, before `-m trainloop`, e.g. "
                                           "'accelerate launch --multi_gpu --num_processes 2'")
    parser.add_argument("--dir", type=Path, help="where the two runs go (default: a temporary folder, "
                                                 "removed when they agree)")
    parser.add_argument("--check", type=Path, metavar="PATH",
                        help="only check the checkpoints under PATH (a run dir, or one checkpoint) for damage: "
                             "sizes, formats and checksums; exit 1 naming a damaged file")
    parser.add_argument("--rtol", type=float, default=1e-6,
                        help="largest relative difference that still passes (default 1e-6; 0: bitwise)")
    args, overrides = parser.parse_known_args(argv)
    unknown = [o for o in overrides if o.startswith("-")]
    if unknown:
        parser.error(f"unknown option(s): {' '.join(unknown)}")
    if args.steps < 2:
        parser.error("--steps must be 2 or more")
    return args, overrides


def main(argv: list[str] | None = None, run: Callable[[list[str], Path], int] | None = None) -> int:
    """The command; `run` (overrides, log file -> exit code) runs each of its trainloop runs, by
    default as a launch of its own (tests/helpers.warm_runs: on warm ranks)."""
    args, user = parse(sys.argv[1:] if argv is None else argv)
    if args.check:
        return check_checkpoints(args.check)
    from trainloop.config.compose import ConfigError

    n, half = args.steps, args.steps // 2
    dropped = [o for o in user if key_of(o) in FORCED]
    overrides = [o for o in user if key_of(o) not in FORCED] + [
        f"trainer.max_steps={n}", "trainer.log_every=1", f"trainer.eval_every={n}",
        "checkpoint.every_steps=null", "checkpoint.save_final_model=true", "logging.progress_bar=false"]
    try:
        check_config(overrides)
    except ConfigError as err:
        print(f"verify_resume: error: {err}", file=sys.stderr)
        return 2
    if dropped:
        print(f"verify_resume: replacing {' '.join(dropped)} (set by this command)")

    if args.launcher:
        launcher = shlex.split(args.launcher)
    elif args.nproc > 1:
        launcher = [str(Path(sys.executable).parent / "torchrun"), "--standalone", f"--nproc_per_node={args.nproc}"]
    else:
        launcher = [sys.executable]
    run = run or subprocess_runs(launcher)
    root = args.dir or Path(tempfile.mkdtemp(prefix="verify_resume_"))
    straight, resumed = (root / "straight").resolve(), (root / "resumed").resolve()
    for d in (straight, resumed):
        if d.exists() and any(d.iterdir()):
            print(f"verify_resume: error: {d} is not empty; give a new --dir", file=sys.stderr)
            return 2
    root.mkdir(parents=True, exist_ok=True)
    print(f"verify_resume: {n} steps straight vs {half} + resume + {n - half}, in {root}", flush=True)
    launch(run, [*overrides, "checkpoint.resume=null", f"hydra.run.dir={straight}"], root / "straight.log")
    launch(run, [*overrides, "checkpoint.resume=null", f"trainer.stop_at_step={half}",
                 f"hydra.run.dir={resumed}"], root / "first_half.log")
    if check_checkpoints(resumed / "checkpoints"):
        return 1
    launch(run, [*overrides, "checkpoint.resume=auto", f"hydra.run.dir={resumed}"], root / "second_half.log")

    result = compare(straight, resumed, n)
    print(result.report(args.rtol))
    if not result.agrees(args.rtol):
        return 1
    if args.dir is None:  # a folder of our own, and nothing in it to look into
        shutil.rmtree(root)
    return 0


def check_checkpoints(path: Path) -> int:
    """Every complete checkpoint under `path`, a line each: 0 when all are whole, 1 when one is damaged."""
    from trainloop.checkpoint.integrity import COMPLETE, why_unloadable

    found = sorted({marker.parent for marker in Path(path).rglob(COMPLETE)})
    if not found:
        print(f"verify_resume: error: no complete checkpoint under {path}", file=sys.stderr)
        return 2
    problems = [why_unloadable(checkpoint) for checkpoint in found]
    for checkpoint, problem in zip(found, problems):
        print(f"checkpoint {checkpoint}: " + (f"DAMAGED: {problem}" if problem else "intact"))
    return 1 if any(problems) else 0


def check_config(overrides: list[str]) -> None:
    """Compose the config the runs will see and check it, so a bad override fails here, once."""
    from trainloop.config.compose import compose_config

    compose_config(overrides)


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main())
