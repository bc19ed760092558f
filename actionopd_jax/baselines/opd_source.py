"""The trainer's group source for token-level OPD (`collect.kind=opd`, `train.loss=opd`).

It reuses the collector's parts -- task stream, environment factory, prompt builder (context
budget), candidate decoder, the rollout path `collect.sampler` picks (the engine's worker, or
the static sampler's: every ready state of every trajectory in one device call),
behaviour-snapshot placement -- and adds only the OPD rollout (N independent trajectories per
task start, one sample per state) and teacher scoring.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import jax
import numpy as np

from actionopd_jax.baselines.opd import (EndpointScorer, LocalTeacherScorer, Scorer, StudentTrajectory,
                                         groups_from_trajectories, run_student_trajectory)
from actionopd_jax.config import Config
from actionopd_jax.config.errors import ConfigError
from actionopd_jax.train.sources import SourceContext
from actionopd_jax.types import StateGroup

log = logging.getLogger(__name__)


def check_opd_temperature(cfg: Config) -> None:
    """OPD's token reward log pi_teacher(y) - log pi_student(y) takes both at one temperature:
    the rollout's (collect.temperature; the student's log-probs are its sampler's). A local
    teacher is scored at it; an endpoint's echo scoring returns its log-probs at T=1, which one
    token's log-prob cannot be rescaled from, so there the rollout must be at T=1 too."""
    if cfg.teacher.kind == "openai" and cfg.collect.temperature != 1.0:
        raise ConfigError(
            f"OPD with teacher.kind=openai compares log-probs at T=1 (echo scoring returns the server's T=1 "
            f"log-probs), but the student samples at collect.temperature={cfg.collect.temperature:g}: set "
            "collect.temperature=1.0, or score a local teacher (teacher.kind=local), which is scored at the "
            "rollout temperature")


def scorer_from_config(cfg: Config, ctx: SourceContext) -> Scorer:
    """teacher.kind=local: teacher.model is an HF directory of a Qwen3 sharing the student's
    token space (loaded onto the run's mesh), scored at the rollout temperature;
    teacher.kind=openai: teacher.base_url serves echo scoring (vLLM, or `actionopd serve`), at
    T=1 (check_opd_temperature)."""
    t = cfg.teacher
    check_opd_temperature(cfg)
    if t.kind == "local":
        if ctx.process_count > 1:
            # each process scores its own rows (different counts): a teacher sharded over the
            # global mesh would need lockstep calls; serve it and score over HTTP instead
            raise ConfigError("OPD with teacher.kind=local runs on one process only; with several hosts serve "
                                "the teacher (vLLM or `actionopd serve`) and set teacher.kind=openai")
        if not t.model or not (Path(t.model) / "config.json").is_file():
            raise ConfigError("OPD with teacher.kind=local needs teacher.model = an HF checkpoint directory "
                                f"(config.json + safetensors); got {t.model!r}")
        from actionopd_jax.model.weights import load_hf

        tcfg, model = load_hf(t.model, mesh=ctx.mesh)
        if tcfg.vocab_size != ctx.model_config.vocab_size:
            raise ConfigError(f"OPD needs a shared token space: teacher vocab {tcfg.vocab_size} != student vocab "
                                f"{ctx.model_config.vocab_size}")
        return LocalTeacherScorer(model, mesh=ctx.mesh, temperature=cfg.collect.temperature)
    if t.kind == "openai":
        if not t.base_url or not t.model:
            raise ConfigError("OPD with teacher.kind=openai needs teacher.base_url and teacher.model "
                                "(a server answering /v1/completions echo scoring, e.g. vLLM)")
        return EndpointScorer(t.base_url, t.model, api_key_env=t.api_key_env or None, concurrency=t.concurrency,
                              timeout_s=t.timeout_s)
    raise ConfigError(f"OPD needs teacher log-probabilities: teacher.kind must be local or openai, got {t.kind!r}")


class OPDGroupSource:
    def __init__(self, cfg: Config, ctx: SourceContext, *, scorer: Scorer | None = None, stream: Any = None,
                 env_factory: Any = None, tokenizer: Any = None, buckets: Any = None):
        from actionopd_jax.chat.prompt import CandidateDecoder, PromptBuilder
        from actionopd_jax.collect.source import (build_engine, collector_config_from, tokenizer_from,
                                                  train_task_stream)
        from actionopd_jax.config.rollout import rollout_sampler
        from actionopd_jax.envs.registry import env_factory_from
        from actionopd_jax.envs.task_sets import stream_tasks
        from actionopd_jax.sampling import Sampler
        from actionopd_jax.train.setup import rollout_devices

        self.cfg = collector_config_from(cfg)
        self.rollout_devices = rollout_devices(cfg)   # the sampler's own (mesh.rollout_devices), else ()
        self.ctx = ctx
        self.trajectories_per_start = cfg.collect.num_candidates
        if tokenizer is None:
            tokenizer = tokenizer_from(ctx, needed_by="collect.kind=opd")
        self.tokenizer = tokenizer
        self.stream = stream if stream is not None else train_task_stream(cfg)
        tasks = stream_tasks(self.stream)
        if tasks is not None and ctx.process_index == 0:  # what `eval` warns about later
            from actionopd_jax.envs.splits import record_train_tasks

            record_train_tasks(ctx.run_dir, tasks)
        self._own_envs = None if env_factory else env_factory_from(cfg.env)   # close() ends the pools built here
        self.env_factory = env_factory or self._own_envs
        self.scorer = scorer if scorer is not None else scorer_from_config(cfg, ctx)
        eos = int(tokenizer.convert_tokens_to_ids("<|im_end|>"))
        # the student's rollout path as ActionOPD's collector picks it (collect.sampler, config/rollout.py)
        platform = ctx.mesh.devices.flat[0].platform if ctx.mesh is not None else jax.default_backend()
        self.sampler_kind = rollout_sampler(cfg.collect.sampler, platform)
        if self.sampler_kind == "engine":
            self.sampler = build_engine(cfg, ctx.model_config, eos, mesh=ctx.mesh)
        else:
            self.sampler = Sampler(None, ctx.model_config, eos_ids=[eos], buckets=buckets)
        self.prompts = PromptBuilder(tokenizer, max_prompt_tokens=self.cfg.max_prompt_tokens,
                                     enable_thinking=self.cfg.enable_thinking)
        self.decoder = CandidateDecoder(tokenizer, eos_ids=[eos], truncated_is_invalid=self.cfg.truncated_is_invalid)
        self.last_trajectories: list[StudentTrajectory] = []
        self._last: dict[str, float] = {}

    def _worker(self):
        """The async front of the sampler: the engine's worker, or the static sampler's (every
        ready state of every trajectory in one device call)."""
        from actionopd_jax.collect.engine_worker import EngineSampling, EngineWorker
        from actionopd_jax.collect.sampler_worker import SamplerWorker, SamplingSettings, sampler_fn

        c = self.cfg
        settings = SamplingSettings(n=1, max_new_tokens=c.max_new_tokens, temperature=c.temperature, top_p=c.top_p,
                                    top_k=c.top_k)
        if self.sampler_kind == "engine":
            return EngineWorker(EngineSampling(self.sampler, settings))
        return SamplerWorker(sampler_fn(self.sampler, settings), max_states_per_call=c.max_states_per_call,
                             max_queued=max(c.max_trajectories_in_flight, 1), coalesce_s=c.sampler_coalesce_s,
                             max_wait_s=c.sampler_max_wait_s)

    async def _rollouts(self, starts, step: int) -> list[StudentTrajectory]:
        c = self.cfg
        jobs = [(s, task, j) for s, task in starts for j in range(self.trajectories_per_start)]
        async with self._worker() as worker:
            sem = asyncio.Semaphore(c.max_trajectories_in_flight)

            async def one(s, task, j):
                async with sem:
                    return await run_student_trajectory(
                        task, s, j, step=step, seed=c.seed, worker=worker, prompts=self.prompts,
                        decoder=self.decoder, env_factory=self.env_factory, limit=c.decision_limit(task.env),
                        env_timeout_s=c.env_timeout_s)

            return list(await asyncio.gather(*(one(*job) for job in jobs)))

    def collect(self, step: int, policy: Any) -> list[StateGroup]:
        from actionopd_jax.collect import local_task_starts
        from actionopd_jax.sampling.rollout import load_behaviour

        tasks = self.stream.next_step()
        load_behaviour(self.sampler, policy, self.ctx.mesh, self.rollout_devices)  # one snapshot for the step
        starts = [(i, tasks[i]) for i in local_task_starts(len(tasks), self.ctx.process_index, self.ctx.process_count)]
        trajectories = asyncio.run(self._rollouts(starts, step))
        trajectories.sort(key=lambda t: (t.task_start, t.index))
        states = [s for t in trajectories for s in t.states]
        teacher = self.scorer.score([s.prompt_ids for s in states], [s.token_ids for s in states]) if states else []
        groups = groups_from_trajectories(trajectories, teacher)
        self.last_trajectories = trajectories
        self._last = self._metrics(trajectories, groups)
        return groups

    @staticmethod
    def _metrics(trajectories, groups) -> dict[str, float]:
        cands = [g.candidates[0] for g in groups]
        tokens = sum(c.token_ids.size for c in cands)
        rewards = [t.score.get("reward") for t in trajectories if isinstance(t.score.get("reward"), (int, float))]
        out = {"trajectories": float(len(trajectories)), "states": float(len(groups)), "tokens": float(tokens),
               "episode_reward_mean": float(np.nanmean(rewards)) if rewards else 0.0}
        if tokens:
            student = float(sum(c.logprobs.sum() for c in cands))
            teacher = float(sum(c.teacher_logprobs.sum() for c in cands))
            out.update(student_logp_mean=student / tokens, teacher_logp_mean=teacher / tokens,
                       reverse_kl_estimate=(student - teacher) / tokens)
        return out

    def close(self) -> None:
        from actionopd_jax.envs.registry import close_env_factory

        close_env_factory(self._own_envs)
        self._own_envs = None

    def state_dict(self) -> dict[str, Any]:
        return self.stream.get_state()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.stream.set_state(state)

    def metrics(self) -> dict[str, float]:
        return dict(self._last)


def build_opd_source(cfg: Config, ctx: SourceContext) -> OPDGroupSource:
    return OPDGroupSource(cfg, ctx)
