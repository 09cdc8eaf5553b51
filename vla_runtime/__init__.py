"""vla_runtime: a self-contained PyTorch runtime for the pi0.5 Vision-Language-Action policy."""
