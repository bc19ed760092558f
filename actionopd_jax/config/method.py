"""Which objective goes with which group source: the one pairing rule of the run config.

A leaf (layer 0) so code below the config front end that switches a run to another method
(the KD baseline's `kd_config`) re-checks the pairing without importing `config.load`;
`config.checks.validate` runs it on every loaded config.
"""

from __future__ import annotations

from actionopd_jax.config.errors import ConfigError
from actionopd_jax.config.schema import Config


def check_method(cfg: Config) -> None:
    """Which objective goes with which group source (the baselines of paper B.4/B.5)."""
    kind, loss = cfg.collect.kind, cfg.train.loss
    needs = {"kd": "kd", "opd": "opd"}
    if kind in needs and loss != needs[kind]:
        raise ConfigError(f"collect.kind={kind} produces {kind.upper()} data; set train.loss={needs[kind]} "
                          f"(got train.loss={loss})")
    if kind == "actionopd" and loss != "actionopd":
        raise ConfigError(f"collect.kind=actionopd trains the ActionOPD surrogate; set train.loss=actionopd "
                          f"(got {loss}), or collect.kind={loss} for the {loss.upper()} baseline")
    if cfg.teacher.kind == "reference" and kind != "actionopd":
        raise ConfigError("teacher.kind=reference (the embedded privileged reference teacher) serves "
                          f"collect.kind=actionopd (got collect.kind={kind})")
    if cfg.teacher.kind == "self" and kind != "actionopd":
        raise ConfigError("teacher.kind=self is Self-ActionOPD: it needs collect.kind=actionopd "
                          f"(got collect.kind={kind})")
    if cfg.teacher.kind == "self" and cfg.env.name == "tau2" and not cfg.teacher.privileged_summaries:
        raise ConfigError("Self-ActionOPD on tau2 gives its teacher prepared summaries of each user's private "
                          "goals, not the simulator's raw instructions: set teacher.privileged_summaries to a "
                          "summaries file (docs/formats.md, 'Privileged summaries')")
    if cfg.kd.trials < 1 or cfg.kd.examples_per_step < 0:
        raise ConfigError("kd.trials must be >= 1 (fresh teacher episodes per task start) and "
                          "kd.examples_per_step >= 0")
