"""The trainer as a library: losses, the sharded train step, the collect -> update loop over a
group source its caller hands in, start-up checks, reporting. It imports nothing above it
(no collect, baselines, experiment or commands); `actionopd train` is actionopd_jax/commands/train.py."""
