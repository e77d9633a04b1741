"""Memory: activation offload and the batch-size search, and what they read of the process's memory."""
