"""Builders shared by tests: tiny checkpoints, tokenizers, loopback servers."""
