"""Run configuration schema: nested frozen dataclasses whose defaults are the tiny CPU job.

This module is the data only: `Config`, assembled from the sections, which live by topic in
learner.py (model, mesh, train), sources.py (collect, kd, teacher, matcher), env_section.py,
eval_section.py, experiment.py and run_section.py (checkpoint, run); build.py's
`build_section` turns a plain tree into them (unknown keys and type errors name the key and
suggest the closest valid one). Building a checked config from the defaults, a YAML file and
`a.b=c` overrides is config/load.py; the cross-field checks are config/checks.py.
`Config.to_dict()` is what gets written to a run directory and into every checkpoint;
`experiment_changes` compares two of those trees (resume), so the trainer reads it from here
without importing the front end.

Paper settings (ActionOPD, sec. 3 and appendix B): N=4 candidates, K=3 teacher samples,
lambda=0.5, PPO clip 0.2, dual clip 3, one PPO epoch over minibatches, student sampling
T=0.6 / p=0.95 / k=20 with 4k-token responses (configs/paper/*.yaml). The optimizer (AdamW,
lr 1e-6 constant, no warmup) is ours: the paper's table 7 is not in the text we have.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import yaml

from actionopd_jax.config.build import build_section, retired_key, suggest
from actionopd_jax.config.env_section import EnvConfig
from actionopd_jax.config.eval_section import EvalConfig
from actionopd_jax.config.experiment import ExperimentConfig
from actionopd_jax.config.learner import MeshConfig, ModelConfig, TrainConfig
from actionopd_jax.config.run_section import CheckpointConfig, DistributedConfig, RunConfig
from actionopd_jax.config.sources import CollectConfig, KDConfig, MatcherConfig, SyntheticConfig, TeacherConfig

# the sections and the builder live in their topic's module; these names stay importable from here
__all__ = [
    "RESUME_SAFE_PREFIXES", "CheckpointConfig", "CollectConfig", "Config", "DistributedConfig", "EnvConfig",
    "EvalConfig", "ExperimentConfig", "KDConfig", "MatcherConfig", "MeshConfig", "ModelConfig", "RunConfig",
    "SyntheticConfig", "TeacherConfig", "TrainConfig", "build_section", "experiment_changes", "flatten",
    "retired_key", "suggest",
]


@dataclass(frozen=True)
class Config:
    """The whole run config. Build a checked one with config.load (load_config, from_dict);
    a copy with dotted keys changed, checked again: config.load.replace_keys(cfg, **changes)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    collect: CollectConfig = field(default_factory=CollectConfig)
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    matcher: MatcherConfig = field(default_factory=MatcherConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    kd: KDConfig = field(default_factory=KDConfig)
    experiment: ExperimentConfig = field(default_factory=ExperimentConfig)  # the main job (actionopd_jax/experiment)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    run: RunConfig = field(default_factory=RunConfig)

    def to_dict(self) -> dict[str, Any]:
        return _to_plain(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


def _to_plain(obj):
    if dataclasses.is_dataclass(obj):
        return {f.name: _to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, tuple):
        return list(obj)
    return obj

def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


# Keys that may differ between a checkpoint and the config that resumes it: they change how
# the run executes (layout, paths, logging, endpoints), not what experiment it is.
RESUME_SAFE_PREFIXES: tuple[str, ...] = (
    "mesh.", "checkpoint.", "eval.", "run.name", "run.root", "run.dir", "run.log_every",
    "run.tensorboard", "run.wandb_project", "run.progress", "run.compile_cache_dir", "run.distributed.",
    "train.steps", "train.microbatch_rows", "train.logits_chunk", "train.vocab_chunk", "model.remat", "model.scan_unroll", "model.attention", "model.hf_path",
    "model.tokenizer", "collect.concurrency", "teacher.base_url", "teacher.api_key_env",
    "teacher.cache_dir", "teacher.timeout_s", "teacher.concurrency", "matcher.base_url",
    "matcher.api_key_env", "matcher.cache_dir", "matcher.timeout_s", "matcher.concurrency",
    "env.user_base_url", "env.user_api_key_env",
    # pool paths: a moved directory is the same experiment (the mixture stream's fingerprint
    # covers the admitted tasks themselves, so changed content still refuses to resume)
    "env.awm_dir", "env.envscaler_dir", "env.manifest",
    # what the teacher costs and how much of it a run may spend: the experiment is the same
    "run.budget_", "teacher.price", "matcher.price", "env.user_price", "collect.max_outage_steps",
)


def experiment_changes(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Keys whose change would make a resumed run a different experiment ('key: old -> new')."""
    a, b = flatten(saved), flatten(current)
    # a key the checkpoint predates ran at the value the code then had, which is the default a
    # key is added with (a new setting must not change what an old config meant): absent =
    # default, so adding a key does not make every older checkpoint a different experiment
    defaults = flatten(Config().to_dict())
    out = []
    for key in sorted(set(a) | set(b)):
        old = a[key] if key in a else defaults.get(key)
        if key.startswith(RESUME_SAFE_PREFIXES) or old == b.get(key):
            continue
        out.append(f"{key}: {old!r} -> {b.get(key)!r}")
    return out
