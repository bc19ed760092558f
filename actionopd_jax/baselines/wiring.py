"""From the run config to the trainer's group source, for `actionopd train` (the trainer never
picks one: `build_source` is handed to `Trainer`), and that source's start-up checks
(`check_collection`, what `actionopd train --check` runs for it). The kinds:

    collect.kind=synthetic                 the deterministic stand-in (train/sources.py)
    collect.kind=actionopd                 the state-group collector (collect/source.py)

    collect.kind=kd  train.loss=kd         KD: fresh teacher.* episodes every step (paper B.4), or
                                           kd.trajectories=FILE (recorded demonstrations, collected once)
    collect.kind=opd train.loss=opd        token-level OPD (teacher.kind=local: teacher.model is an HF dir;
                                           teacher.kind=openai: teacher.base_url scores through /v1/completions)
    collect.kind=actionopd teacher.kind=self   Self-ActionOPD (current student weights + privileged context)
    collect.kind=actionopd teacher.kind=reference   the embedded PRIVILEGED reference teacher (tiny runs
                                           offline: our loopback server answering with the tasks' solutions)
    collect.reward=validity|binary, collect.commit=random   the ablations (plain ActionOPD source)
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

from actionopd_jax.config import Config
from actionopd_jax.config.errors import ConfigError
from actionopd_jax.providers import UnsendableSetting
from actionopd_jax.train.sources import GroupSource, SourceContext, synthetic_source
from actionopd_jax.types import Task

log = logging.getLogger(__name__)


# collect.kind: the group sources `build_source` builds
SOURCE_KINDS: tuple[str, ...] = ("synthetic", "actionopd", "kd", "opd")


def tasks_from_env(cfg: Config, *, limit: int = 0) -> list[Task]:
    """Every training task of the configured environment / domains / split / env.task_ids (first
    `limit` of each, 0: all); evaluation tasks are refused as for the collector (envs/splits.py)."""
    from actionopd_jax.envs.task_sets import training_task_sets

    out: list[Task] = []
    for _, tasks in training_task_sets(cfg.env, needed_by="this baseline"):
        out.extend(tasks[:limit] if limit else tasks)
    return out


def endpoint_agent(cfg: Config):
    """The teacher of `teacher.*` as an eval agent (an OpenAI-compatible endpoint)."""
    from actionopd_jax.eval.agents import EndpointAgent

    t = cfg.teacher
    if t.kind != "openai" or not t.base_url or not t.model:
        raise ConfigError("KD without kd.trajectories runs the teacher first: set teacher.kind=openai, "
                            "teacher.base_url and teacher.model (or point kd.trajectories at recorded episodes)")
    try:
        # a teacher: its empty or unparsable replies are asked again, teacher.retries times, as
        # the collector's teacher client does (issue 34: they ended warm-start episodes). The
        # body is spelled for teacher.provider as the collector's is (a DeepSeek or OpenAI
        # endpoint gets no vLLM chat_template_kwargs; a setting it cannot take is refused here).
        agent = EndpointAgent(t.base_url, t.model, api_key_env=t.api_key_env or None, temperature=t.temperature,
                              max_tokens=t.max_tokens, timeout_s=t.timeout_s, retries=t.retries, retry_invalid=True,
                              provider=t.provider or "openai", top_p=t.top_p, top_k=t.top_k or None,
                              thinking=t.enable_thinking, reasoning_effort=t.reasoning_effort or None,
                              role="teacher")   # its outages name the teacher endpoint
        # KD's episodes are training targets: one action per decision (paper section 2), so a
        # reply with several calls is invalid (and asked again) rather than run
        agent.parallel_calls = False
        return agent
    except UnsendableSetting as e:
        raise ConfigError(f"teacher.*: {e}") from None
    except ValueError as e:   # the key's variable is not set: say what to do, not where it failed
        raise ConfigError(f"{e}: export it before `actionopd train` (teacher.api_key_env names it; secrets come "
                          "from the environment only)") from None


def build_kd_source(cfg: Config, ctx: SourceContext, *, tokenizer: Any = None, make_agent: Any = None):
    """KD's source: with kd.trajectories, the recorded demonstrations (collected once,
    `kd.KDGroupSource`); without, paper B.4's schedule (`kd_fresh.FreshKDSource`: kd.trials fresh
    teacher episodes per task start every step, the successful ones trained on). `make_agent`
    builds the teacher agent (default: the teacher.* endpoint)."""
    from actionopd_jax.baselines.kd import KDGroupSource, kd_examples, load_trajectories

    if tokenizer is None:
        from actionopd_jax.collect.source import tokenizer_from

        tokenizer = tokenizer_from(ctx, needed_by="this baseline")
    k = cfg.kd
    if not k.trajectories:
        from actionopd_jax.baselines.kd_fresh import FreshKDSource
        from actionopd_jax.collect.source import train_task_stream
        from actionopd_jax.envs.registry import env_factory_from
        from actionopd_jax.teacher.specs import judge_spec

        if make_agent is None:
            endpoint_agent(cfg)  # refuses a missing endpoint before anything runs
            make_agent = lambda: endpoint_agent(cfg)  # noqa: E731 - one client per step's event loop
        make_env = env_factory_from(cfg.env, judge=judge_spec(cfg.matcher))  # the judge grades AWM's verifiers
        return FreshKDSource(make_agent, train_task_stream(cfg), make_env, tokenizer,
                             out_dir=Path(ctx.run_dir) / "kd", trials=k.trials, min_reward=k.min_reward,
                             max_prompt_tokens=cfg.collect.max_prompt_tokens,
                             enable_thinking=cfg.collect.enable_thinking, concurrency=cfg.teacher.concurrency,
                             process_index=ctx.process_index, process_count=ctx.process_count,
                             max_outage_steps=cfg.collect.max_outage_steps, owns_env=True)
    records = load_trajectories(k.trajectories, min_reward=k.min_reward)
    examples = kd_examples(records, tokenizer, max_prompt_tokens=cfg.collect.max_prompt_tokens,
                           enable_thinking=cfg.collect.enable_thinking)
    log.info("KD: %d successful recorded trajectories -> %d examples", len(records), len(examples))
    return KDGroupSource(examples, examples_per_step=k.examples_per_step or cfg.train.minibatch_rows,
                         seed=cfg.run.seed, process_index=ctx.process_index, process_count=ctx.process_count)


def build_baseline_source(cfg: Config, ctx: SourceContext):
    kind = cfg.collect.kind
    if kind == "kd":
        return build_kd_source(cfg, ctx)
    if kind == "opd":
        from actionopd_jax.baselines.opd_source import build_opd_source

        return build_opd_source(cfg, ctx)
    if kind == "actionopd" and cfg.teacher.kind == "self":
        from actionopd_jax.baselines.self_opd import build_self_source

        return build_self_source(cfg, ctx)
    raise ConfigError(f"no baseline source for collect.kind={kind} with teacher.kind={cfg.teacher.kind}")


def build_source(cfg: Config, ctx: SourceContext) -> GroupSource:
    """The group source named by `collect.kind`, in the trainer's context (pass it to the
    trainer as `functools.partial(build_source, cfg)`)."""
    kind = cfg.collect.kind
    if kind == "synthetic":
        return synthetic_source(cfg, ctx)
    if kind in ("kd", "opd") or (kind == "actionopd" and cfg.teacher.kind == "self"):
        # the baselines of paper B.4/B.5 (offline KD, token-level OPD, Self-ActionOPD)
        return build_baseline_source(cfg, ctx)
    if kind == "actionopd" and cfg.teacher.kind == "reference":
        return reference_teacher_source(cfg, ctx)
    if kind == "actionopd":
        source = collector_source_class(cfg)(cfg, ctx)
        if not isinstance(source, GroupSource):
            raise TypeError(f"build_group_source returned {type(source).__name__}, which lacks "
                            "collect/state_dict/load_state_dict")
        return source
    raise ConfigError(f"collect.kind={kind!r} has no source")


def collector_source_class(cfg: Config) -> type:
    """The collector's group source: the asynchronous one when collect.max_staleness >= 1
    (issue 44, collect/async_source.py), else the synchronous one, today's code path."""
    if cfg.collect.max_staleness >= 1:
        from actionopd_jax.collect.async_source import AsyncActionOPDGroupSource

        return AsyncActionOPDGroupSource
    from actionopd_jax.collect.source import ActionOPDGroupSource

    return ActionOPDGroupSource


def reference_tasks(cfg: Config) -> tuple[Any, list[Task]]:
    """(the run's task stream, its tasks), each of which has a reference solution; for
    teacher.kind=reference."""
    from actionopd_jax.collect.source import train_task_stream
    from actionopd_jax.envs.reference import reference_policy
    from actionopd_jax.envs.task_sets import stream_tasks

    stream = train_task_stream(cfg)
    tasks = stream_tasks(stream) or []
    for task in tasks:
        try:
            reference_policy(task)
        except (ValueError, KeyError) as e:
            raise ConfigError(f"teacher.kind=reference needs a solution for every training task: {e}") from None
    return stream, tasks


def reference_teacher_source(cfg: Config, ctx: SourceContext) -> GroupSource:
    """The collector's source with the embedded PRIVILEGED reference teacher: our OpenAI-compatible
    server on 127.0.0.1 answering with the training tasks' reference solutions (envs/reference.py),
    reached through the real teacher client. It reads the solution, so it lets a tiny run go
    offline but never stands in for a real teacher's numbers (the log says so)."""
    import atexit
    import dataclasses

    from actionopd_jax.serve.openai_http import OpenAIServer
    from actionopd_jax.serve.reference_backend import MODEL_NAME, ReferenceBackend

    stream, tasks = reference_tasks(cfg)
    server = OpenAIServer(ReferenceBackend(tasks, model_name=MODEL_NAME), host="127.0.0.1", port=0)
    url = server.start()
    atexit.register(server.stop)
    log.warning("PRIVILEGED REFERENCE TEACHER: embedded server at %s answering with the solutions of %d training "
                "tasks (it reads them; not a real teacher)", url, len(tasks))
    teacher = dataclasses.replace(cfg.teacher, kind="openai", provider="actionopd", base_url=url, model=MODEL_NAME,
                                  api_key_env="", enable_thinking=False)
    source = collector_source_class(cfg)(dataclasses.replace(cfg, teacher=teacher), ctx, stream=stream)
    source.reference_server = server
    return source
def check_self_teacher(cfg: Config) -> None:
    """Self-ActionOPD's privileged input: the summaries file reads, and every training task that
    needs a prepared summary (tau2) has a REVIEWED one (a draft of `actionopd tau2 summaries`
    waits for a human: its line says "reviewed": false)."""
    from actionopd_jax.baselines.privileged import missing_summaries
    from actionopd_jax.baselines.summary_file import SummaryFile, read_summary_file

    path = cfg.teacher.privileged_summaries
    file = SummaryFile()
    if path:
        try:
            file = read_summary_file(path)
        except (OSError, ValueError) as e:
            raise ConfigError(f"teacher.privileged_summaries: {e}") from None
    missing = missing_summaries(tasks_from_env(cfg), file.reviewed)
    if not missing:
        return
    unmarked = [t for t in missing if t in file.unmarked]
    drafts = [t for t in missing if t in file.unreviewed and t not in file.unmarked]
    failed = [t for t in missing if t in file.failed]
    if unmarked:
        raise ConfigError(f"Self-ActionOPD: {len(unmarked)} training task(s) have a summary line in {path} that does "
                          f"not say \"reviewed\": true (first: {unmarked[:3]}); only a reviewed summary reaches the "
                          "teacher: read each such line, correct it if it is wrong or leaks the solution, and add "
                          "\"reviewed\": true (docs/formats.md, 'Privileged summaries'), or narrow env.task_ids")
    if drafts:
        raise ConfigError(f"Self-ActionOPD: {len(drafts)} training task(s) have only an unreviewed drafted summary in "
                          f"{path} (first: {drafts[:3]}); read each such line, correct it if it is wrong or leaks "
                          "the solution, and set \"reviewed\": true (docs/formats.md, 'Privileged summaries'), or "
                          "narrow env.task_ids")
    hint = (f"; {len(failed)} of them failed to draft (error lines): rerun `actionopd tau2 summaries "
            "--retry-errors` or write them by hand" if failed else "")
    raise ConfigError(f"Self-ActionOPD: {len(missing)} training task(s) have no prepared privileged summary "
                      f"(first: {missing[:3]}); add them to {path or 'a summaries file'} "
                      f"(teacher.privileged_summaries, format docs/formats.md; `actionopd tau2 summaries` drafts "
                      f"them) or narrow env.task_ids{hint}")


def check_collection(cfg: Config) -> None:
    """The offline part of what `build_source` reads from the config when the run builds it
    (collect/source.py, this module): its settings, the teacher and matcher specs, the task
    sets (loaded, so missing data or a refused split shows here) and the user simulator.
    Not the tokenizer or checkpoint files, which a planning host may not hold."""
    kind, teacher = cfg.collect.kind, cfg.teacher.kind
    if kind == "synthetic":
        return
    from actionopd_jax.collect import source
    from actionopd_jax.envs.registry import close_env_factory, env_factory_from
    from actionopd_jax.teacher.specs import judge_spec, teacher_spec

    if kind == "kd":
        from actionopd_jax.baselines import kd

        if cfg.kd.trajectories:
            kd.load_trajectories(cfg.kd.trajectories, min_reward=cfg.kd.min_reward)
        else:  # the teacher runs every step, on the run's task stream
            # its settings, not its secret: a planning host need not hold the key (`--check` names
            # a missing one, commands/train.py; the run refuses without it)
            endpoint_agent(dataclasses.replace(cfg, teacher=dataclasses.replace(cfg.teacher, api_key_env="")))
            source.train_task_stream(cfg)
            close_env_factory(env_factory_from(cfg.env))   # built to check it, and closed: nothing started
        return
    try:
        source.collector_config_from(cfg)
    except ValueError as e:
        raise e if isinstance(e, ConfigError) else ConfigError(f"collect: {e}") from None
    if kind == "opd":
        from actionopd_jax.baselines.opd_source import check_opd_temperature

        check_opd_temperature(cfg)
    if kind == "actionopd" and teacher not in ("self", "reference"):
        teacher_spec(cfg.teacher)
    if kind == "actionopd" and teacher != "self":
        judge_spec(cfg.matcher)
    from actionopd_jax.envs.mixture import POOLS, missing_pool_files

    if cfg.env.name in POOLS and missing_pool_files(cfg.env):
        return  # a planning host without the pool data: `--check` prints which paths it lacks
    if teacher == "reference":
        reference_tasks(cfg)
    if kind == "actionopd" and teacher == "self":
        check_self_teacher(cfg)
    source.train_task_stream(cfg)
    close_env_factory(env_factory_from(cfg.env, concurrency=cfg.collect.concurrency))
