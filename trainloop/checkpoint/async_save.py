"""checkpoint.async_save (FSDP2): a save's shards are written in the background while training goes
on. One save is in flight at a time; the main process commits its folder at the first optimizer step
after every rank's shards are written, and a save, the end of training and a preemption wait for it.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from trainloop.checkpoint import integrity

log = logging.getLogger("trainloop")


class AsyncSaves:
    def __init__(self, accelerator, timeout_s: float):
        self.accelerator = accelerator
        self.timeout_s = timeout_s  # of the process group the saves talk over
        self.in_flight = None  # the save being written (trainloop.parallel.dcp.InFlight)
        self.unsettled: tuple[Path, Path] | None = None  # (tmp, final) of the last one, until all ranks agree it
        self.steps_done = 0  # the optimizer steps training has taken, as the loop last said
        self._group = None  # made at the first save
        self.committed: list[dict] = []  # the saves committed since the loop last took them

    def start(self, tmp: Path, final: Path, model, adapter_only: bool, state: dict, fingerprint: dict) -> None:
        from trainloop.parallel import dcp

        dcp.save_rank_states(self.accelerator, tmp)  # small: written now
        integrity.record_rank_files(tmp, self.accelerator.process_index)
        if self._group is None:
            self._group = dcp.checkpoint_group(self.timeout_s)
        self.unsettled = (tmp, final)
        self.in_flight = dcp.start_async(tmp, final, model, self.accelerator._optimizers[0], adapter_only,
                                         state, fingerprint, self._group, lambda: self.steps_done, integrity.record)

    def written(self) -> bool:
        """Whether the save in flight has written every shard of this rank (rank 0's: and committed)."""
        return self.in_flight is not None and self.in_flight.future.done()

    def finish(self, commit) -> BaseException | None:
        """This rank's part of the save in flight: wait until its shards are written; the main
        process then commits the folder (`commit(tmp, final, state, fingerprint)`) and records it.
        The failure, if any, is returned."""
        save, self.in_flight = self.in_flight, None
        if save is None:
            return None
        acc = self.accelerator
        waited = time.monotonic()
        try:
            save.future.result()
            waited = time.monotonic() - waited
            if acc.is_main_process:
                commit(save.tmp, save.final, save.state, save.fingerprint)
        except Exception as err:  # this rank's, or another's: DCP reports a failed write to every rank
            return err
        if not acc.is_main_process:
            return None
        # the callback that records these may still be running in the writing thread
        written_by = save.written_by_step[0] if save.written_by_step else self.steps_done
        write_s = (save.written_at[0] if save.written_at else time.monotonic()) - save.started
        # blocked_s < write_s: the save handed training back before its shards were written
        self.committed.append({
            "step": self.steps_done, "event": "checkpoint", "checkpoint": save.final.name, "saved_step": save.step,
            "written_by_step": written_by, "committed_at_step": self.steps_done, "write_s": round(write_s, 3),
            "blocked_s": round(save.blocked_s, 3), "waited_s": round(waited, 3)})
        log.info("committed checkpoint %s: saved after step %d (training held for %.2f s), written in %.2f s "
                 "in the background (training had taken %d steps by then); training waited %.2f s more for it",
                 save.final.name, save.step, save.blocked_s, write_s, written_by, waited)
        return None
