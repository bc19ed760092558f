"""Checkpoints and run loading, below every user of a trained run (train, sampling, eval,
serve): `Checkpointer` writes and restores a run's Orbax steps (checkpointer.py); run.py finds
a run's checkpoint, restores it onto the current devices and gives its recorded tokenizer."""

from actionopd_jax.checkpoint.checkpointer import Checkpointer, CheckpointError, Restored
from actionopd_jax.checkpoint.run import (RunCheckpoint, abstract_params, copy_tokenizer, load_model, locate,
                                          model_config_of, record_tokenizer, recorded_tokenizer)

__all__ = ["Checkpointer", "CheckpointError", "Restored", "RunCheckpoint", "abstract_params", "copy_tokenizer",
           "load_model", "locate", "model_config_of", "record_tokenizer", "recorded_tokenizer"]
