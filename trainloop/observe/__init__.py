"""What a run shows: metrics, trackers, telemetry, the profiler, samples, FLOPs and the hardware."""
