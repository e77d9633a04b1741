"""What a run reports: metrics.jsonl and the progress bar, on the main process only."""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path

import psutil

log = logging.getLogger("trainloop")


def library_progress_bars(enabled: bool, loads_rows: bool) -> None:
    """logging.progress_bar=false: no bars from transformers (writing the final model's shards)
    or, with `loads_rows`, datasets (map, filter) either, only log lines. Set by every run: sweeps
    and tests run several. data=prepared reads its shards without datasets, so it is not imported
    for that (0.6 s of start-up)."""
    from transformers.utils import logging as transformers_logging

    (transformers_logging.enable_progress_bar if enabled else transformers_logging.disable_progress_bar)()
    if loads_rows:
        import datasets

        (datasets.enable_progress_bars if enabled else datasets.disable_progress_bars)()


def shows_bar(setting: bool | None) -> bool:
    """logging.progress_bar: None draws the bar only where stderr is a terminal; redirected to a file
    (nohup, SLURM), its frames would fill the file with carriage returns."""
    return sys.stderr.isatty() if setting is None else bool(setting)


BESIDE_BAR = {"beside_bar": True}  # the `extra` of a line the bar already shows: train.log gets it, the console not


class _NotOnConsole(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not getattr(record, "beside_bar", False)


NOT_ON_CONSOLE = _NotOnConsole()


def console_handlers() -> list[logging.Handler]:
    """The root logger's handlers that write to stdout or stderr (Hydra's console handler, not its file's)."""
    streams = (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__)
    return [h for h in logging.getLogger().handlers
            if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler)
            and any(h.stream is stream for stream in streams)]


class Metrics:
    """Appends one JSON object per line to RUN_DIR/metrics.jsonl and drives the progress bar. Every
    log step, eval, sample and harness line is logged (train.log, Hydra's file handler) with or
    without the bar; with the bar, the console shows the step lines in the bar, not as lines."""

    def __init__(self, run_dir: Path, enabled: bool, total_steps: int, start_step: int,
                 progress_bar: bool, world_size: int, flops_per_token: float | None = None,
                 peak_tflops: float | None = None, trackers=None, headline: tuple[str, ...] = ()):
        self.enabled = enabled
        self.headline = headline  # the objective's main values (Objective.headline), on screen beside the loss
        self.trackers = trackers  # trainloop.observe.trackers.Trackers: every record goes there too
        self.run_dir = Path(run_dir)
        self.flops_per_token = flops_per_token  # trainloop.model.flops: counted once at start
        self.peak_tflops = peak_tflops
        self.world_size = world_size
        self.file = open(run_dir / "metrics.jsonl", "a") if enabled else None
        self.bar, self.quieted = None, []
        if enabled and progress_bar:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total_steps, initial=start_step, desc="train", unit="step",
                            dynamic_ncols=True, file=sys.stderr, mininterval=1.0)
            self.quieted = console_handlers()
            for handler in self.quieted:
                handler.addFilter(NOT_ON_CONSOLE)
        self.start = psutil.Process().create_time()  # `time` counts from process start: start-up shows

    def write(self, record: dict) -> None:
        """The one place records pass: a line in metrics.jsonl, and the same values to the trackers."""
        if not self.enabled:
            return
        line = {**record, "world_size": self.world_size, "time": round(time.time() - self.start, 3)}
        self.file.write(json.dumps(line) + "\n")
        self.file.flush()
        if self.trackers is not None:  # world_size and time describe the line; trackers stamp their own time
            self.trackers.log(record)

    def train(self, step: int, **values) -> None:
        if self.flops_per_token is not None:  # from the window's tokens/s: no sync of its own
            tflops = values["tokens_per_s"] / self.world_size * self.flops_per_token / 1e12
            values.update(tflops=tflops, mfu=tflops / self.peak_tflops if self.peak_tflops else None)
        self.write({"step": step, **values})
        # a window without a value (grpo's reward on a step that trained on earlier completions) shows none
        headline = {key: f"{values[key]:.4g}" for key in self.headline if values.get(key) is not None}
        if self.bar is not None:
            mfu = {"mfu": f"{values['mfu']:.1%}"} if values.get("mfu") is not None else {}
            # a dict, not keywords, which tqdm would sort: the objective's values after the common ones
            self.bar.set_postfix({"loss": f"{values['loss']:.4f}", "lr": f"{values['lr']:.2e}",
                                  "tok_s": f"{values['tokens_per_s']:,.0f}", **mfu, **headline}, refresh=False)
        if self.enabled:
            log.info("step %d  loss %.4f  lr %.2e  %.0f tok/s%s", step, values["loss"], values["lr"],
                     values["tokens_per_s"], "".join(f"  {key} {value}" for key, value in headline.items()),
                     extra=BESIDE_BAR if self.bar is not None else None)

    def say(self, text: str) -> None:
        """A line for the user, in the log, and above the progress bar where there is one; main process only."""
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(text)
        log.info(text, extra=BESIDE_BAR if self.bar is not None else None)

    def eval(self, step: int, eval_loss: float, eval_ppl: float | None = None, **more: float) -> None:
        """The objective's evaluation (trainloop.objectives): its loss, perplexity (a token objective's)
        and any other values."""
        ppl = {} if eval_ppl is None else {"eval_ppl": eval_ppl}
        self.write({"step": step, "eval_loss": eval_loss, **ppl, **more})
        self.say(f"step {step}: eval_loss {eval_loss:.4f}" + "".join(f"  {key} {value:.2f}" for key, value in ppl.items())
                 + "".join(f"  {key} {value:.4g}" for key, value in more.items()))

    def samples(self, step: int, samples: list[dict]) -> None:
        """eval.prompts and what the model wrote after each (trainloop.observe.samples), or an objective's
        examples with their rewards (objective=grpo: None where a function did not apply): event=samples."""
        self.write({"step": step, "event": "samples", "samples": samples})
        for number, sample in enumerate(samples, 1):
            rewards = ", ".join(f"{name} {'None' if value is None else f'{value:.4g}'}"
                                for name, value in sample.get("rewards", {}).items())
            if sample.get("conversation"):  # a transcript, a turn a line (objective=grpo on chat prompts, tools)
                turns = "".join(f"\n  {line}" for line in f"{sample['prompt']}\n{sample['text']}".splitlines())
                self.say(f"step {step}: sample {number}{turns}" + (f"\n  rewards: {rewards}" if rewards else ""))
            else:
                self.say(f"step {step}: {sample['prompt']!r} -> {sample['text']!r}"
                         + (f"  rewards: {rewards}" if rewards else ""))

    def harness(self, step: int, scores: dict[str, float]) -> None:
        """lm-evaluation-harness's scores of the model (trainloop.observe.harness): event=harness, a key
        TASK/METRIC each; on screen without the standard errors."""
        self.write({"step": step, "event": "harness", **scores})
        self.say(f"step {step}: harness " + "  ".join(f"{key} {value:.4g}" for key, value in scores.items()
                                                        if not key.endswith("_stderr")))

    def telemetry(self, step: int, **values) -> None:
        """A sample of the machine (trainloop.observe.telemetry): its own line, event=telemetry."""
        self.write({"step": step, "event": "telemetry", **values})

    def advance(self, steps: int = 1) -> None:
        if self.bar is not None:
            self.bar.update(steps)

    def close(self) -> None:
        """The bar ends and metrics.jsonl is closed; again is a no-op."""
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        for handler in self.quieted:
            handler.removeFilter(NOT_ON_CONSOLE)
        self.quieted = []
        if self.file is not None:
            self.file.close()
            self.file = None
