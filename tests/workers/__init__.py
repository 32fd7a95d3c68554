"""Scripts the tests run as processes: torchrun workers (dist_*), drivers, a third-party training script."""
