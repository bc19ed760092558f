"""The run configuration.

    schema.py     `Config` (data only; a leaf) and the resume comparison (experiment_changes)
    learner.py, sources.py, env_section.py, eval_section.py, run_section.py
                  the frozen sections by topic (leaves)
    build.py      the typed tree builder: unknown keys, types (a leaf)
    errors.py     `ConfigError` (a leaf any layer may raise)
    experiment.py the `experiment:` section of the main job (a leaf)
    files.py      a YAML file with its `base:` chain
    checks.py     the cross-field checks, with the choice lists of the modules that own them
    load.py       load_config / from_dict / replace_keys / overrides / experiment_changes

This package re-exports the data names only (schema + errors), so that importing
`actionopd_jax.config` stays light and one-way; the front end is imported from
`actionopd_jax.config.load` (it sits above the modules whose choices it checks).
"""

from actionopd_jax.config.errors import ConfigError
from actionopd_jax.config.experiment import ExperimentConfig, StudentShape
from actionopd_jax.config.schema import (CheckpointConfig, CollectConfig, Config, DistributedConfig, EnvConfig,
                                         EvalConfig, KDConfig, MatcherConfig, MeshConfig, ModelConfig, RunConfig,
                                         SyntheticConfig, TeacherConfig, TrainConfig)

__all__ = [
    "CheckpointConfig", "CollectConfig", "Config", "ConfigError", "DistributedConfig", "EnvConfig", "EvalConfig",
    "ExperimentConfig", "KDConfig", "MatcherConfig", "MeshConfig", "ModelConfig", "RunConfig", "StudentShape",
    "SyntheticConfig", "TeacherConfig", "TrainConfig",
]
