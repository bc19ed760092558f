"""`actionopd eval`: evaluate a checkpoint, an HF directory, an OpenAI-compatible endpoint, or
the privileged reference policy on BFCL multi-turn, tau2, EnvScaler directories and an AWM
pool's held-out tasks (verifier / check success); resumable; JSON + markdown + PNG."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import Any, Callable

from actionopd_jax.config.eval_section import EvalConfig
from actionopd_jax.config.rollout import SAMPLER_KINDS
from actionopd_jax.eval.agents import Agent, BackendAgent, EndpointAgent, ReferenceAgent
from actionopd_jax.eval.metrics import summarize
from actionopd_jax.eval import spend as eval_spend
from actionopd_jax.eval.report import markdown_table, write_report
from actionopd_jax.eval.runner import load_finished, run_eval
from actionopd_jax.eval.settings import ROLES, THINKING, EvalSettings, check_same_settings, resolve
from actionopd_jax.eval.tasks import select_tasks
from actionopd_jax.types import Task


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="actionopd eval", description=__doc__,
                                epilog="Defaults are the paper's (table 8's evaluation rows, B.3); --config RECIPE takes "
                                       "them from the recipe's eval: section; each flag overrides one setting. "
                                       "--check lists the settings and the tasks, and evaluates nothing.")
    who = p.add_mutually_exclusive_group()
    who.add_argument("--checkpoint", help="a training run directory, its checkpoints/ folder or one step folder "
                                          "(Orbax), or an exported HF directory")
    who.add_argument("--hf", help="HF directory (config.json + safetensors) of a student")
    who.add_argument("--endpoint", help="base URL of an OpenAI-compatible endpoint (e.g. a hosted teacher)")
    who.add_argument("--reference", action="store_true", help="the privileged reference policy (harness check)")
    p.add_argument("--config", help="a recipe: its eval: section gives the benchmarks and the settings (table 8)")
    p.add_argument("--check", action="store_true", help="print the settings and the task counts, then stop")
    p.add_argument("--model", help="model name at --endpoint")
    p.add_argument("--api-key-env", help="environment variable holding the endpoint's API key")
    p.add_argument("--settings", choices=ROLES,
                   help="which row of table 8 the evaluated model gets: student (default for --checkpoint / --hf) or "
                        "teacher (default for --endpoint: a directly evaluated teacher)")
    p.add_argument("--tokenizer", help="tokenizer directory (default: next to the weights, or the run's)")
    p.add_argument("--step", type=int, help="with --checkpoint RUN: the step to evaluate (default: latest finished)")
    p.add_argument("--allow-unverified", action="store_true",
                   help="with --checkpoint: evaluate a step that has no checksum manifest (refused otherwise; the "
                        "scores record verified: false)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), help="parameter and compute dtype (default: as trained)")
    p.add_argument("--mesh", help="shard the student over local devices, e.g. tensor=-1 (default: one device)")
    p.add_argument("--bench", action="append",
                   help="bfcl[:base,miss_func,miss_param,long_context], tau2_<domain>[:train|test|base] (default "
                        "test), envscaler:DIR[:id1,id2] or awm[:heldout|admitted|all]; repeatable (default: the "
                        "recipe's eval.benchmarks)")
    p.add_argument("--limit", type=int, help="first N tasks of each benchmark")
    g = p.add_argument_group("the evaluated model (default: table 8's row for its role)")
    g.add_argument("--temperature", type=float, help="0 = greedy (students: 0; Qwen3.7-Flash: 0.6)")
    g.add_argument("--top-p", type=float)
    g.add_argument("--top-k", type=int)
    g.add_argument("--thinking", choices=tuple(THINKING), help="the thinking switch (table 8: on); none: not sent")
    g.add_argument("--reasoning-effort", help="sent as reasoning_effort (DeepSeek-V4-Flash: max)")
    g.add_argument("--provider", help="--endpoint's server kind (providers.py): how top_k and thinking are spelled")
    g.add_argument("--max-new-tokens", type=int, help="per reply (students: 4,096; evaluated teachers: 32,768)")
    g = p.add_argument_group("trials and limits (paper B.3)")
    g.add_argument("--trials", type=int, help="trials per tau2 / EnvScaler / AWM task (default 4: pass^1..pass^4)")
    g.add_argument("--bfcl-trials", type=int, help="trials per BFCL task (default 1)")
    g.add_argument("--bfcl-max-steps", type=int, help="BFCL steps per turn (default 20, BFCL's own)")
    g.add_argument("--tau2-prompts", choices=("tau2", "actionopd"),
                   help="tau2's agent and user prompts: tau2's own harness prompts (default, eval.tau2_prompts) or "
                        "actionopd's (those training uses)")
    g = p.add_argument_group("the tau2 user simulator (default: table 8's evaluation user: thinking, T=1, 8k)")
    g.add_argument("--user-sim-url", help="OpenAI-compatible endpoint of the tau2 user simulator")
    g.add_argument("--user-sim-model", help="user simulator model name (paper: Qwen3.5-9B)")
    g.add_argument("--user-sim-api-key-env", help="environment variable with the user simulator's API key")
    g.add_argument("--user-sim-provider", help="the user endpoint's server kind (providers.py)")
    g.add_argument("--user-sim-temperature", type=float)
    g.add_argument("--user-sim-top-p", type=float)
    g.add_argument("--user-sim-top-k", type=int)
    g.add_argument("--user-sim-thinking", choices=tuple(THINKING))
    g.add_argument("--user-sim-max-tokens", type=int)
    p.add_argument("--sampler", choices=SAMPLER_KINDS, default="auto",
                   help="in-process student: the continuous-batching engine (paged cache; an episode's earlier "
                        "turns stay cached for its next turn), or 'static' batched calls (the engine's oracle); "
                        "auto: the engine, static on NVIDIA GPUs (measured slower there: config/rollout.py)")
    p.add_argument("--engine-max-len", type=int,
                   help="with --sampler engine: prompt + reply tokens one request may hold (sizes the page pool); "
                        "default: the model's own context (its config's max_position_embeddings, Qwen3: 40,960); "
                        "give a lower value only to narrow it")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--manifest", default="", help="awm: the admission manifest (`actionopd envs audit`) with the split")
    p.add_argument("--awm-dir", default="", help="awm: the pool directory (default: the manifest's)")
    p.add_argument("--judge-url", help="awm: OpenAI-compatible endpoint of the SQL verifiers' judge")
    p.add_argument("--judge-model", help="awm: the judge's model name")
    p.add_argument("--judge-api-key-env", help="awm: environment variable with the judge's API key")
    p.add_argument("--out", help="output directory (episodes.jsonl makes the run resumable)")
    p.add_argument("--no-progress", action="store_true")
    eval_spend.add_arguments(p)
    return p


def make_agent(args: argparse.Namespace, settings: EvalSettings, loaded: dict | None = None) -> Agent:
    m = settings.model
    if args.reference:
        return ReferenceAgent()
    if args.endpoint:
        if not args.model:
            raise SystemExit("actionopd eval: --endpoint needs --model")
        return EndpointAgent(args.endpoint, args.model, api_key_env=args.api_key_env, temperature=m.temperature,
                             top_p=m.top_p, top_k=m.top_k, thinking=m.enable_thinking,
                             reasoning_effort=m.reasoning_effort or None, provider=m.provider or "openai",
                             max_tokens=m.max_tokens)
    # no max_tokens in the request: the backend gives each reply min(m.max_tokens, the context
    # its prompt leaves) (its default_max_tokens is m.max_tokens), so a reply budget the model
    # cannot hold is fitted to it instead of refusing every request (issue 43 item 9)
    return BackendAgent(model_backend(args, settings, loaded), temperature=m.temperature or 0.0,
                        top_p=m.top_p, top_k=m.top_k, max_tokens=None)


def reply_fit(agent: Agent, settings: EvalSettings) -> str:
    """The scores' note on how an in-process model's replies were fitted to its context ("" for
    an endpoint, whose server keeps its own limits)."""
    context = getattr(getattr(agent, "_backend", None), "max_context", None)
    if not isinstance(agent, BackendAgent) or context is None:
        return ""
    asked = settings.model.max_tokens
    if asked >= context:
        return (f"the reply budget of {asked:,} new tokens does not fit the model's {context:,}-token context: every "
                f"reply got the context its prompt leaves ({context:,} - prompt tokens)")
    return (f"replies get {asked:,} new tokens, or the context the prompt leaves in the model's {context:,} tokens "
            "where that is less")


def model_backend(args: argparse.Namespace, settings: EvalSettings | None = None, loaded: dict | None = None):
    """The in-process model backend for --hf / --checkpoint (same code path as `actionopd serve`)."""
    import jax

    from actionopd_jax.config.rollout import rollout_sampler
    from actionopd_jax.model import make_mesh
    from actionopd_jax.sampling import Sampler
    from actionopd_jax.sampling.cli import model_with_tokenizer
    from actionopd_jax.sampling.loading import end_token_ids, model_name_of
    from actionopd_jax.serve.cli import parse_mesh
    from actionopd_jax.serve.model_backend import ModelBackend

    mesh = make_mesh(parse_mesh(args.mesh)) if args.mesh else None
    cfg, model, tokenizer = model_with_tokenizer(hf=args.hf, checkpoint=args.checkpoint, tokenizer=args.tokenizer,
                                                 mesh=mesh, dtype=args.dtype, step=args.step, record=loaded,
                                                 allow_unverified=args.allow_unverified)
    max_context = None
    platform = mesh.devices.flat[0].platform if mesh is not None else jax.default_backend()
    if rollout_sampler(getattr(args, "sampler", "auto"), platform) == "engine":
        from actionopd_jax.engine import Engine, EngineConfig

        # the model's own context unless narrowed: a fixed 8,192 held no tau2 prompt plus a
        # 4,096-token reply (issue 43 item 2)
        max_context = min(args.engine_max_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        shapes = EngineConfig(slots=max(args.concurrency, 1), max_len=max_context, chunk=min(512, max_context))
        # the engine has Sampler.sample's contract (same keys, same samples); the backend's
        # batches then share slots, and an episode's history stays in the prefix cache
        sampler = Engine(model, cfg, eos_ids=end_token_ids(tokenizer), mesh=mesh, config=shapes)
    else:
        sampler = Sampler(model, cfg, eos_ids=end_token_ids(tokenizer), mesh=mesh)
    m = settings.model if settings is not None else None
    # the student's chat template gets the thinking switch as trained (table 8: on)
    return ModelBackend(sampler, tokenizer, model_name=model_name_of(args.hf or args.checkpoint),
                        default_max_tokens=m.max_tokens if m else (args.max_new_tokens or 4096), max_context=max_context,
                        enable_thinking=bool(m.enable_thinking) if m else True)


def env_factory(args: argparse.Namespace, settings: EvalSettings):
    from actionopd_jax.envs.registry import make_environment

    user_sim = None
    awm = None

    def simulator():
        nonlocal user_sim
        if user_sim is None:
            u = settings.user
            if not (u.base_url and u.model):
                raise SystemExit("actionopd eval: tau2 and conversational EnvScaler tasks need a user simulator: "
                                 "--user-sim-url and --user-sim-model (or eval.user in the --config recipe)")
            from actionopd_jax.envs.user_sim import UserSimConfig, UserSimulator

            user_sim = UserSimulator(UserSimConfig(
                base_url=u.base_url, model=u.model, api_key_env=u.api_key_env or None, provider=u.provider or "openai",
                temperature=u.temperature, top_p=u.top_p, top_k=u.top_k or None, thinking=u.enable_thinking,
                max_tokens=u.max_tokens))
        return user_sim

    def make(task: Task):
        nonlocal awm
        if task.env == "awm":
            if awm is None:
                awm = awm_factory(args)
            return awm(task)
        if task.env.startswith("tau2_"):
            return make_environment(task.env, user_sim=simulator(), prompts=settings.tau2_prompts)
        if task.env == "envscaler" and task.payload.get("conversational"):
            return make_environment(task.env, user_sim=simulator())
        if task.env == "bfcl":
            return make_environment("bfcl", max_steps_per_turn=settings.bfcl_max_steps_per_turn)
        return make_environment(task.env)

    def close() -> None:
        # the AWM servers end with the evaluation, not with the process: an in-process caller of
        # main() (a notebook, a test worker) would otherwise keep the pool alive until it exits
        if awm is not None:
            awm.close()

    make.close = close
    return make


def awm_factory(args: argparse.Namespace):
    """The AWM pool's episodes (envs/awm/factory.py), judged by --judge-url when given."""
    from actionopd_jax.config import EnvConfig
    from actionopd_jax.envs.awm.factory import awm_env_factory, awm_eval_tasks

    _, awm_dir = awm_eval_tasks("all" if not args.manifest else "admitted", awm_dir=args.awm_dir,
                                manifest=args.manifest)
    judge = None
    if args.judge_url or args.judge_model:
        if not (args.judge_url and args.judge_model):
            raise SystemExit("actionopd eval: the AWM judge needs both --judge-url and --judge-model")
        judge = {"base_url": args.judge_url, "model": args.judge_model, "api_key_env": args.judge_api_key_env,
                 "temperature": 0.0, "max_tokens": 512, "request_timeout_s": 120}
    return awm_env_factory(EnvConfig(name="awm", awm_dir=awm_dir, manifest=args.manifest),
                           concurrency=args.concurrency, judge=judge)


def resolve_settings(args: argparse.Namespace, load_section: Callable[[str], EvalConfig] | None = None) -> EvalSettings:
    """The recipe's eval: section (or the paper's defaults) with the given flags over it.
    `load_section(path)` reads a recipe's eval: section; the `actionopd eval` entry point
    (commands/eval.py) passes the config front end's, which sits above this layer."""
    if args.config:
        if load_section is None:
            raise ValueError("--config needs the config loader: run `actionopd eval` (commands/eval.py)")
        section, source = load_section(args.config), args.config
    else:
        section, source = EvalConfig(), "paper defaults: table 8 and B.3; no --config"
    return resolve(args, section, source)


def select_all(args: argparse.Namespace, settings: EvalSettings) -> list[Task]:
    return [t for spec in settings.benchmarks
            for t in select_tasks(spec, limit=args.limit, awm_dir=args.awm_dir, manifest=args.manifest)]


def check(args: argparse.Namespace, settings: EvalSettings) -> list[str]:
    """`--check`: the settings, each benchmark's task and episode counts, and each endpoint the
    run calls with its key's state (no model loaded, no endpoint called)."""
    from actionopd_jax.eval.keys_check import endpoint_lines

    lines = settings.lines() + ["benchmarks"]
    every: list[Task] = []
    for spec in settings.benchmarks:
        tasks = select_tasks(spec, limit=args.limit, awm_dir=args.awm_dir, manifest=args.manifest)
        every += tasks
        trials = settings.trials_for(tasks[0]) if tasks else 0
        lines.append(f"  {spec:<22} {len(tasks):>4} tasks x {trials} trial(s) = {len(tasks) * trials:,} episodes")
    endpoints, problems, unset = endpoint_lines(args, settings, every)
    # an unset key is named, as train --check names it (a planning host need not hold secrets); the
    # run refuses without it. An endpoint the run needs and lacks fails the check (MISSING)
    lines += eval_spend.check_lines(args)   # the prices and the cap (a bad one is a ValueError: exit 2)
    return (lines + endpoints + [f"secrets    {k} is not set in this environment: the run refuses without it"
                                 for k in unset] + [f"MISSING: {p}" for p in problems])


def check_context(args: argparse.Namespace, settings: EvalSettings) -> int:
    """`--check`'s prompt room (eval/context_check.py): 2 when a benchmark holds a prompt the
    model cannot fit at all, else 0."""
    from actionopd_jax.eval.context_check import context_lines

    sets = [(spec, select_tasks(spec, limit=args.limit, awm_dir=args.awm_dir, manifest=args.manifest))
            for spec in settings.benchmarks]
    lines, problems = context_lines(args, settings.model.max_tokens, sets)
    print("\n".join(lines))
    for problem in problems:
        print(f"actionopd eval: {problem}", file=sys.stderr)
    return 2 if problems else 0


def evaluate(args: argparse.Namespace, settings: EvalSettings) -> dict[str, Any]:
    tasks = select_all(args, settings)
    from actionopd_jax.eval.keys_check import endpoint_lines

    _, problems, unset = endpoint_lines(args, settings, tasks)
    if problems or unset:   # refused before anything runs: every episode needing it would be unavailable
        raise ValueError("; ".join(problems + [f"{k} is not set: export it (secrets come from the environment only)"
                                               for k in unset])
                         + " (`actionopd eval ... --check` lists every endpoint and key)")
    from actionopd_jax.envs.splits import eval_overlap_warning

    warning = eval_overlap_warning(args.checkpoint or args.hf, tasks)  # from the run's train_tasks.json
    if warning:
        print(warning, flush=True)
    out = Path(args.out)
    note = check_same_settings(out, settings, has_episodes=bool(load_finished(out / "episodes.jsonl")))
    if note:
        print(note, flush=True)
    loaded: dict = {}  # what --checkpoint / --hf loaded: every score records it
    ledger = eval_spend.ledger_of(args, settings.model.max_tokens)   # every paid call metered, --budget-usd held (eval/spend.py)
    agent = make_agent(args, settings, loaded)
    from actionopd_jax.paid_calls import finishing_in_flight
    from actionopd_jax.train.budget import phase_ledger
    from actionopd_jax.train.sources import StoppedEarly

    envs = env_factory(args, settings)
    try:
        with phase_ledger(None, out, "the paid models", ledger=ledger):
            records, errors = asyncio.run(finishing_in_flight(run_eval(
                agent, tasks, envs, out / "episodes.jsonl", trials=settings.trials_for,
                concurrency=args.concurrency, progress=not args.no_progress,
                trajectories_jsonl=out / "trajectories.jsonl", evaluated=loaded or None)))
    except StoppedEarly as e:   # --budget-usd: finished episodes are in episodes.jsonl, the rest rerun on resume
        table = eval_spend.write_spend(ledger, out)
        raise StoppedEarly(f"{e}{chr(10) * 2 + table if table else ''}", e.code) from None
    finally:
        envs.close()
    spend_table = eval_spend.write_spend(ledger, out)
    wanted = {(t.task_id, t.env): settings.trials_for(t) for t in tasks}
    records = [r for r in records if r["trial"] < wanted.get((r["task_id"], r["env"]), 0)]
    rows = summarize(records, ks=range(1, max(wanted.values(), default=1) + 1))
    fit = reply_fit(agent, settings)
    paths = write_report(out, rows, agent=agent.name, errors=errors, evaluated=loaded or None,
                         settings={**settings.record(), **({"reply_fit": fit} if fit else {})},
                         settings_lines=settings.lines() + ([f"  replies  {fit}"] if fit else []),
                         spend=eval_spend.summary(ledger), spend_table=spend_table)
    if spend_table:
        paths["spend"] = out / "spend.md"
    paths["trajectories"] = out / "trajectories.jsonl"
    paths["settings"] = out / "settings.json"
    return {"rows": rows, "errors": errors, "paths": paths, "unplayed": unplayed(records), "spend": spend_table}


def unplayed(records: list[dict[str, Any]]) -> str:
    """A warning when more than half of the episodes ended before the agent's first action for
    want of context (the prompt over the model's budget): their zero scores measure the
    configuration, not the model. Empty when that is not so."""
    early = [r for r in records if r.get("actions", 0) == 0 and r.get("end_reason") == "context_budget"]
    if not records or len(early) * 2 <= len(records):
        return ""
    return (f"WARNING: {len(early)} of {len(records)} episodes ended before the agent's first action because the "
            "prompt is over the model's context: these scores say nothing about the model. Use a model whose "
            "context holds the benchmark's prompts (and no lower --engine-max-len); `--check` measures them")


def main(argv: list[str], *, load_section: Callable[[str], EvalConfig] | None = None) -> int:
    from actionopd_jax.train.sources import StoppedEarly

    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        settings = resolve_settings(args, load_section)
        if args.check:
            lines = check(args, settings)
            print("\n".join(lines))
            context = check_context(args, settings)
            return 2 if any(line.startswith("MISSING: ") for line in lines) else context
        if not (args.checkpoint or args.hf or args.endpoint or args.reference):
            parser.error("one of --checkpoint, --hf, --endpoint or --reference is required (or --check)")
        if not args.out:
            parser.error("--out is required (the directory that holds the scores; rerun to resume)")
        from actionopd_jax.compile_cache import enable_compile_cache
        enable_compile_cache()  # persistent XLA compile cache (JAX_COMPILATION_CACHE_DIR or the default)
        result = evaluate(args, settings)
    except (FileNotFoundError, ValueError, argparse.ArgumentTypeError) as e:   # ConfigError is a ValueError
        print(f"actionopd eval: {e}", file=sys.stderr)
        return 2
    except StoppedEarly as e:   # --budget-usd reached (exit 3): finished episodes kept, no traceback
        print(f"actionopd eval: {e}", file=sys.stderr)
        return e.code
    print(markdown_table(result["rows"]))
    if result["spend"]:
        print(f"\nwhat the paid models cost (resumes included):\n{result['spend']}")
    print(f"wrote {', '.join(str(p) for p in result['paths'].values())}")
    if result["unplayed"]:
        print(result["unplayed"], file=sys.stderr)
        return 1
    if result["errors"]:
        from actionopd_jax.eval.runner import unavailable_summary

        # endpoint failures name the endpoint and the count; such episodes are no score, in no metric
        lost = unavailable_summary(result["errors"])
        print(f"actionopd eval: {len(result['errors'])} episode(s) did not finish{': ' + lost if lost else ''} "
              f"(last: {result['errors'][-1]}); they are in no score: rerun the same command to resume them",
              file=sys.stderr)
        return 1
    return 0
