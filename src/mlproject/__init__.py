"""mlproject: a Lightning + Hydra template for distributed training."""
