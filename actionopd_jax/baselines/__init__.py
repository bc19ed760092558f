"""Baselines and variants trained through the same trainer as ActionOPD (paper 3.3-3.6, B.4-B.5):
offline KD on successful teacher trajectories (kd.py), token-level OPD with sampled-token
reverse KL (opd.py), and Self-ActionOPD with a current-weights teacher given privileged
context (self_opd.py). The ablations (validity reward, binary reward, random commit) are
collector switches: `collect.reward` / `collect.commit` in the run config."""
