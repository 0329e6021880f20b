"""What tests share: running entry points as processes, test-only callbacks, the GPU marker."""
