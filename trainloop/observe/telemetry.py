"""Telemetry: every logging.telemetry_every steps, one line in metrics.jsonl about the machine.

Always this process's RSS and the fraction of step time spent waiting for data (a high one
says data.num_workers or data.pin_memory is the bottleneck); on a GPU also its utilization,
memory allocated/reserved by torch, temperature, power against the limit, and throttling,
read through NVML (nvidia-ml-py) or nvidia-smi. A throttling or hot GPU is warned about once
per process. Sampling never stops training: what cannot be read is left out.
"""

from __future__ import annotations

import logging

from trainloop.observe import hardware

log = logging.getLogger("trainloop")


class Telemetry:
    def __init__(self, every: int | None, device):
        import psutil

        self.every = every
        self.process = psutil.Process()
        self.device = device if device.type == "cuda" else None
        self.gpu = None
        self.warned: set[str] = set()
        if every and self.device is not None:
            import torch

            index = self.device.index if self.device.index is not None else torch.cuda.current_device()
            self.gpu = hardware.GpuMonitor(index)

    def due(self, step: int) -> bool:
        return bool(self.every) and step % self.every == 0

    def sample(self, data_wait_frac: float) -> dict:
        record = {"rss_bytes": self.process.memory_info().rss, "data_wait_frac": data_wait_frac}
        if self.device is not None:
            import torch

            record.update(gpu_mem_allocated_bytes=torch.cuda.memory_allocated(self.device),
                          gpu_mem_reserved_bytes=torch.cuda.memory_reserved(self.device),
                          gpu_mem_peak_allocated_bytes=torch.cuda.max_memory_allocated(self.device))
        reading = self._read_gpu()
        if reading is not None:
            record.update(gpu_util_pct=reading.utilization_pct, gpu_temp_c=reading.temperature_c,
                          gpu_power_w=reading.power_w, gpu_power_limit_w=reading.power_limit_w,
                          gpu_sm_clock_mhz=reading.sm_clock_mhz,
                          gpu_throttle=[name for name, _ in hardware.harmful_throttle(reading.throttle_mask)])
            self.warn_once(reading)
        return record

    def _read_gpu(self) -> hardware.GpuReading | None:
        if self.gpu is None:
            return None
        try:
            return self.gpu.read()
        except Exception as err:  # a driver hiccup must not end the run
            if "read" not in self.warned:
                self.warned.add("read")
                log.warning("telemetry: could not read the GPU (%s); GPU fields are left out", err)
            return None

    def warn_once(self, reading: hardware.GpuReading) -> None:
        for warning in hardware.gpu_warnings(reading):
            kind = "hot" if " C, above " in warning else "power" if "power" in warning else "throttle"
            if kind not in self.warned:
                self.warned.add(kind)
                log.warning("%s (warned once)", warning)

    def record(self, metrics, step: int, data_wait_frac: float) -> None:
        metrics.telemetry(step, **self.sample(data_wait_frac))
