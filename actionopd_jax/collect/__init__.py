"""The async state-group collector (paper section 2.3, algorithm 1): many trajectories on
one asyncio loop, every ready state batched into one device call, teacher and judge calls
overlapped with generation.

The names below load on first use (PEP 562), so importing one submodule (a constant of
`engine_worker`, say) does not import the collector with its environments and task pipeline:
the trainer and the device check run where those packages are not installed."""

from importlib import import_module

_EXPORTS = {
    "CollectResult": "actionopd_jax.collect.collector", "Collector": "actionopd_jax.collect.collector",
    "default_env_factory": "actionopd_jax.collect.collector",
    "local_task_starts": "actionopd_jax.collect.collector",
    "VARIANTS": "actionopd_jax.collect.config", "CollectorConfig": "actionopd_jax.collect.config",
    "NO_COMMIT": "actionopd_jax.collect.group", "GroupOutcome": "actionopd_jax.collect.group",
    "build_group": "actionopd_jax.collect.group", "commit_index": "actionopd_jax.collect.group",
    "StepMetrics": "actionopd_jax.collect.metrics", "TrajectoryRecord": "actionopd_jax.collect.metrics",
    "CandidateDecoder": "actionopd_jax.chat.prompt", "Prompt": "actionopd_jax.chat.prompt",
    "PromptBuilder": "actionopd_jax.chat.prompt",
    "SamplerError": "actionopd_jax.collect.sampler_worker", "SamplerWorker": "actionopd_jax.collect.sampler_worker",
    "SamplingSettings": "actionopd_jax.collect.sampler_worker", "sampler_fn": "actionopd_jax.collect.sampler_worker",
    "ActionOPDGroupSource": "actionopd_jax.collect.source", "build_group_source": "actionopd_jax.collect.source",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(list(globals()) + __all__)
