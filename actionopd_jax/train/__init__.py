"""Trainer: losses, the sharded train step, the collect -> update loop, checkpoints, CLI."""
