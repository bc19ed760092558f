"""The async state-group collector (paper section 2.3, algorithm 1): many trajectories on
one asyncio loop, every ready state batched into one device call, teacher and judge calls
overlapped with generation."""

from actionopd_jax.collect.collector import CollectResult, Collector, default_env_factory, local_task_starts
from actionopd_jax.collect.config import VARIANTS, CollectorConfig
from actionopd_jax.collect.group import NO_COMMIT, GroupOutcome, build_group, commit_index
from actionopd_jax.collect.metrics import StepMetrics, TrajectoryRecord
from actionopd_jax.chat.prompt import CandidateDecoder, Prompt, PromptBuilder
from actionopd_jax.collect.sampler_worker import SamplerError, SamplerWorker, SamplingSettings, sampler_fn
from actionopd_jax.collect.source import ActionOPDGroupSource, build_group_source

__all__ = [
    "CollectResult", "Collector", "default_env_factory", "local_task_starts", "VARIANTS", "CollectorConfig",
    "NO_COMMIT", "GroupOutcome", "build_group", "commit_index", "StepMetrics", "TrajectoryRecord",
    "CandidateDecoder", "Prompt", "PromptBuilder", "SamplerError", "SamplerWorker", "SamplingSettings", "sampler_fn",
    "ActionOPDGroupSource", "build_group_source",
]
