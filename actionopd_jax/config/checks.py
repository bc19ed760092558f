"""Cross-field checks of a loaded `Config` (choices, positive sizes, which objective goes with
which group source). Run by `config.load.from_dict`, so every way of building a config passes
through them; start-up checks that need the devices live in `train/preflight.py`.

Each choice list is read from the module that acts on the setting, so a new value is added in
one place; a list stays here (with its owner named) only where the owner has no constant yet.
"""

from __future__ import annotations

import typing

from actionopd_jax.aot.targets import TARGETS
from actionopd_jax.baselines.wiring import SOURCE_KINDS
from actionopd_jax.config.rollout import SAMPLER_KINDS
from actionopd_jax.collect.group import CommitMode
from actionopd_jax.config.errors import ConfigError, problems_of, raise_all as _raise_all
from actionopd_jax.config.experiment import TEACHER_MODES, ExperimentConfig
from actionopd_jax.config.method import check_method
from actionopd_jax.config.schema import Config, EnvConfig
from actionopd_jax.envs.envscaler.mode import parse_rule
from actionopd_jax.envs.mixture import parse_mixture
from actionopd_jax.matching.judge import PROMPT_MARGIN_TOKENS
from actionopd_jax.providers import PROVIDERS, refusal, unsendable
from actionopd_jax.model.attention import IMPLEMENTATIONS
from actionopd_jax.model.attention.dispatch import PAGED_IMPLEMENTATIONS
from actionopd_jax.model.runtime import DTYPES, REMAT as REMAT_MODES
from actionopd_jax.rewards import RewardMode
from actionopd_jax.sampling.budget import parse_token_budget
from actionopd_jax.teacher.specs import MATCHER_KINDS, TEACHER_KINDS
from actionopd_jax.train.distributed import MODES as DISTRIBUTED_MODES
from actionopd_jax.train.step import LOSS_KINDS

# choices checked after loading (key -> allowed values)
CHOICES: dict[str, tuple[str, ...]] = {
    "model.dtype": DTYPES,
    "model.param_dtype": DTYPES,
    "model.remat": REMAT_MODES,
    "model.attention": IMPLEMENTATIONS,
    "train.loss": LOSS_KINDS,
    "train.old_logprobs": ("recompute", "sampler"),  # owner: train/loop.py (no constant yet)
    "collect.kind": SOURCE_KINDS,
    "collect.reward": typing.get_args(RewardMode),
    "collect.commit": typing.get_args(CommitMode),
    "collect.sampler": SAMPLER_KINDS,
    "collect.engine_attention": tuple(a for a in PAGED_IMPLEMENTATIONS if a != "ragged_tpu"),
    "teacher.kind": TEACHER_KINDS,
    "matcher.kind": MATCHER_KINDS,
    "matcher.execution": ("auto", "off"),  # owner: matching/execution.py (issue 45)
    "run.distributed.mode": DISTRIBUTED_MODES,
}


def _value(cfg: Config, dotted: str):
    node = cfg
    for part in dotted.split("."):
        node = getattr(node, part)
    return node


def validate(cfg: Config) -> None:
    """Cross-field checks; raises one ConfigError naming every key that is wrong (issue 34: a
    config with three mistakes took three failed starts to find them)."""
    errors: list[str] = []

    def need(ok: bool, message: str) -> None:
        if not ok:
            errors.append(message)

    for key, allowed in CHOICES.items():
        value = _value(cfg, key)
        need(value in allowed, f"{key}={value!r}; expected one of {allowed}")
    need(cfg.model.scan_unroll >= 0, f"model.scan_unroll must be >= 0 (0: unroll every layer), got {cfg.model.scan_unroll}")
    need(not cfg.mesh.target or cfg.mesh.target in TARGETS,
         f"mesh.target={cfg.mesh.target!r}; known targets: {', '.join(TARGETS)}")
    t = cfg.train
    positive = {"train.minibatch_rows": t.minibatch_rows, "train.microbatch_rows": t.microbatch_rows,
                "train.max_seq_len": t.max_seq_len, "train.bucket_multiple": t.bucket_multiple,
                "train.ppo_epochs": t.ppo_epochs, "collect.num_candidates": cfg.collect.num_candidates,
                "collect.teacher_samples": cfg.collect.teacher_samples, "checkpoint.keep": cfg.checkpoint.keep,
                "collect.engine_segment": cfg.collect.engine_segment,
                "collect.engine_page_size": cfg.collect.engine_page_size}
    for key, v in positive.items():
        need(v > 0, f"{key} must be positive, got {v}")
    if t.minibatch_rows > 0 and t.microbatch_rows > 0:
        need(t.minibatch_rows % t.microbatch_rows == 0, f"train.minibatch_rows={t.minibatch_rows} must be a multiple "
                                                       f"of train.microbatch_rows={t.microbatch_rows}")
    try:
        parse_token_budget(cfg.collect.sampler_token_budget)
    except ValueError as e:
        errors.append(str(e))
    per_micro = cfg.collect.num_candidates * t.microbatch_rows
    if t.shared_prompt and per_micro > 0:
        need(t.minibatch_rows % per_micro == 0, f"train.shared_prompt: a microbatch holds microbatch_rows x N = "
                                               f"{per_micro} candidates; train.minibatch_rows={t.minibatch_rows} "
                                               "must be a multiple of it")
    need(t.lr > 0, f"train.lr must be > 0, got {t.lr}")
    need(0 < t.clip_eps < 1, f"train.clip_eps must be in (0, 1), got {t.clip_eps}")
    need(t.dual_clip > 1, f"train.dual_clip must be > 1 (paper: 3), got {t.dual_clip}")
    need(t.logits_chunk >= 0, f"train.logits_chunk must be >= 0, got {t.logits_chunk}")
    need(t.vocab_chunk >= 0, f"train.vocab_chunk must be >= 0 (0: plain LM head), got {t.vocab_chunk}")
    need(cfg.collect.temperature > 0, "collect.temperature must be > 0: the loss scores tokens under "
                                      "softmax(logits / T); greedy rollouts cannot be trained on")
    for axis in ("data", "fsdp", "tensor"):
        v = getattr(cfg.mesh, axis)
        need(not (v == 0 or v < -1), f"mesh.{axis} must be a positive size or -1, got {v}")
    need([cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor].count(-1) <= 1,
         "at most one of mesh.data / mesh.fsdp / mesh.tensor may be -1")
    need(cfg.mesh.rollout_devices >= 0, f"mesh.rollout_devices must be >= 0 (0: the sampler shares the training "
                                        f"devices), got {cfg.mesh.rollout_devices}")
    _validate_staleness(cfg, need)
    s = cfg.collect.synthetic
    need(0 < s.prompt_tokens_min <= s.prompt_tokens_max and 0 < s.response_tokens_min <= s.response_tokens_max,
         "collect.synthetic: need 0 < *_tokens_min <= *_tokens_max")
    need(cfg.checkpoint.every_steps >= 0, f"checkpoint.every_steps must be >= 0, got {cfg.checkpoint.every_steps}")
    for key in ("budget_usd", "budget_teacher_tokens", "budget_matcher_tokens", "budget_user_tokens"):
        need(getattr(cfg.run, key) >= 0, f"run.{key} must be >= 0 (0: no cap), got {getattr(cfg.run, key)}")
    need(not cfg.run.budget_usd or bool(cfg.teacher.price or cfg.matcher.price or cfg.env.user_price),
         f"run.budget_usd={cfg.run.budget_usd:g} needs a price to count spend against it: teacher.price, "
         "matcher.price or env.user_price (USD per million [input, cached input, output] tokens)")
    for key, price in (("teacher.price", cfg.teacher.price), ("matcher.price", cfg.matcher.price),
                       ("env.user_price", cfg.env.user_price)):
        need(len(price) in (0, 3) and all(float(x) >= 0 for x in price),
             f"{key}={list(price)}: expected [] or three USD prices per million tokens >= 0: [input, cached input, "
             "output]")
    for check in (check_method, _validate_endpoints, _validate_eval, lambda c: _validate_pools(c.env),
                  lambda c: _validate_experiment(c.experiment)):
        try:
            check(cfg)
        except ConfigError as e:
            errors.extend(problems_of(e))
        except (KeyError, TypeError, ValueError, AttributeError):
            if not errors:   # a check tripping over a value already reported wrong says nothing new
                raise
    _raise_all(errors)


def _validate_staleness(cfg: Config, need) -> None:
    """collect.max_staleness (issue 44): the asynchronous schedule exists for the collector only,
    and its correction needs the trainer's recomputed log-probs as the proximal policy."""
    c = cfg.collect
    eta = c.max_staleness
    need(eta >= 0, f"collect.max_staleness must be >= 0 (0: the synchronous loop), got {eta}")
    if eta < 1:
        return
    need(c.kind == "actionopd", f"collect.max_staleness={eta} needs collect.kind=actionopd (got {c.kind!r}): only "
                                "the state-group collector runs episodes across updates; set it to 0")
    need(cfg.train.old_logprobs == "recompute",
         f"collect.max_staleness={eta} needs train.old_logprobs=recompute: a stale group's correction weighs the "
         "sampler's recorded log-probs against the trainer's recomputation under the weights being updated")
    need(cfg.teacher.kind != "self", f"collect.max_staleness={eta}: Self-ActionOPD (teacher.kind=self) collects "
                                     "synchronously only; set collect.max_staleness=0")


def _endpoint_roles(cfg: Config) -> list[tuple[str, str, str, int, bool | None]]:
    """(section prefix, provider key, provider, top_k, thinking) of each endpoint the run samples:
    ActionOPD's teacher (kind openai) and judge (rules+llm, once it names a model or URL), and
    the user simulator (once it names one). OPD's teacher only scores; KD's teacher is run by
    its own agent (baselines/wiring.endpoint_agent)."""
    t, m, e = cfg.teacher, cfg.matcher, cfg.env
    roles = []
    if t.kind == "openai" and cfg.collect.kind == "actionopd":
        roles.append(("teacher.", "teacher.provider", t.provider or "openai", t.top_k, t.enable_thinking))
    if m.kind == "rules+llm" and (m.model or m.base_url):
        roles.append(("matcher.", "matcher.provider", m.provider or "openai", m.top_k, m.enable_thinking))
    if e.user_model or e.user_base_url:
        roles.append(("env.user_", "env.user_provider", e.user_provider or "openai", e.user_top_k,
                      e.user_enable_thinking))
    # `actionopd eval --config`: the tau2 evaluation user once named, a directly evaluated
    # teacher once its provider is (an unnamed provider is checked when `eval --endpoint` runs)
    u, et = cfg.eval.user, cfg.eval.teacher
    if u.model or u.base_url:
        roles.append(("eval.user.", "eval.user.provider", u.provider or "openai", u.top_k, u.enable_thinking))
    if et.provider:
        roles.append(("eval.teacher.", "eval.teacher.provider", et.provider, et.top_k, et.enable_thinking))
    return roles


def _validate_eval(cfg: Config) -> None:
    """The `eval:` section (config/eval_section.py): benchmark specs parse, counts and limits
    are positive, sampling values are in range; every problem is reported at once."""
    from actionopd_jax.eval.tasks import spec_problem

    ev = cfg.eval
    problems = [f"eval.benchmarks: {p}" for p in map(spec_problem, ev.benchmarks) if p]
    if ev.tau2_prompts not in ("tau2", "actionopd"):  # envs/tau2_prompts.PROMPTS
        problems.append(f"eval.tau2_prompts must be 'tau2' (tau2's own harness prompts) or 'actionopd' (ours), "
                        f"got {ev.tau2_prompts!r}")
    for key, v in (("eval.trials", ev.trials), ("eval.bfcl_trials", ev.bfcl_trials),
                   ("eval.bfcl_max_steps_per_turn", ev.bfcl_max_steps_per_turn),
                   ("eval.student.max_tokens", ev.student.max_tokens), ("eval.teacher.max_tokens", ev.teacher.max_tokens),
                   ("eval.user.max_tokens", ev.user.max_tokens)):
        if v < 1:
            problems.append(f"{key} must be >= 1, got {v}")
    for role in ("student", "teacher", "user"):
        r = getattr(ev, role)
        if r.temperature is not None and r.temperature < 0:
            problems.append(f"eval.{role}.temperature must be >= 0 (0: greedy), got {r.temperature}")
        if r.top_p is not None and not 0 < r.top_p <= 1:
            problems.append(f"eval.{role}.top_p must be in (0, 1] or null, got {r.top_p}")
        if r.top_k is not None and r.top_k < 0:
            problems.append(f"eval.{role}.top_k must be >= 0 or null, got {r.top_k}")
    _raise_all(problems)


def _validate_endpoints(cfg: Config) -> None:
    """Every sampling setting of an endpoint reaches it, or the run is refused (paper table 8):
    a provider without a field for top_k or the thinking switch does not get them silently
    dropped; the refusal names the providers that can send them."""
    refused = []
    for prefix, provider_key, provider, top_k, thinking in _endpoint_roles(cfg):
        if provider not in PROVIDERS:
            refused.append(f"{provider_key}={provider!r}; expected one of {sorted(PROVIDERS)}")
            continue
        for setting in unsendable(provider, top_k=top_k, thinking=thinking):
            key, value, off = ((f"{prefix}top_k", top_k, f"{prefix}top_k: 0") if setting == "top_k" else
                               (f"{prefix}enable_thinking", thinking, f"{prefix}enable_thinking: null"))
            refused.append(refusal(provider, setting, value, key=key, off=off, provider_key=provider_key))
    _raise_all(refused)
    m = cfg.matcher
    if m.context_chars < 0 or m.format_retries < 0:
        raise ConfigError(f"matcher.context_chars and matcher.format_retries must be >= 0, got "
                          f"{m.context_chars} and {m.format_retries}")
    if m.kind == "rules+llm" and not m.context_chars and m.context_window <= m.max_tokens + PROMPT_MARGIN_TOKENS:
        raise ConfigError(f"matcher.context_window={m.context_window} leaves no room for the judge's prompt next to "
                          f"matcher.max_tokens={m.max_tokens}: set it to the judge model's window (tokens), "
                          "or give matcher.context_chars")
    t = cfg.teacher
    if t.kind == "vertex" and t.reasoning_effort:
        raise ConfigError("teacher.reasoning_effort cannot be sent to Vertex AI (it has no such field); "
                          "use teacher.enable_thinking, or teacher.kind=openai with a provider that takes it")
    if t.kind in ("local", "self") and t.enable_thinking is None:
        raise ConfigError(f"teacher.kind={t.kind} renders its own prompts: teacher.enable_thinking must be "
                          "true or false, not null")


def _validate_pools(env: EnvConfig) -> None:
    """env.mixture entries parse, and every pool drawn from has its directory set."""
    try:
        entries = parse_mixture(env.mixture)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    pools = [p for p, _ in entries] or ([env.name] if env.name in ("awm", "envscaler") else [])
    if entries and env.name not in ("awm", "envscaler"):
        raise ConfigError(f"env.mixture is set but env.name={env.name!r}; use env.name awm or envscaler with a mixture")
    for pool in pools:
        if not getattr(env, f"{pool}_dir"):
            raise ConfigError(f"env.name / env.mixture use the {pool} pool: set env.{pool}_dir to its directory")
    if env.envscaler_conversational:
        try:  # its ids are checked against the directory where the pool loads (envs/mixture.py)
            parse_rule(env.envscaler_conversational)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if "envscaler" not in pools:
            raise ConfigError(f"env.envscaler_conversational={list(env.envscaler_conversational)} is set but the run "
                              "draws no EnvScaler pool (env.name / env.mixture); remove it, or add envscaler to "
                              "env.mixture")


def _validate_experiment(exp: ExperimentConfig) -> None:
    """Field checks of the `experiment:` section (config/experiment.py)."""
    if exp.teacher not in TEACHER_MODES:
        raise ConfigError(f"experiment.teacher={exp.teacher!r}; expected one of {TEACHER_MODES}")
    if not 0.0 < exp.heldout_fraction < 1.0:
        raise ConfigError(f"experiment.heldout_fraction must be in (0, 1), got {exp.heldout_fraction}")
    if not exp.bfcl_classes:
        raise ConfigError("experiment.bfcl_classes must name at least one BFCL class (e.g. [TradingBot])")
    for key in ("max_train_tasks", "max_heldout_tasks", "pretrain_epochs", "kd_epochs", "max_prompt_tokens"):
        if getattr(exp, key) < 0:
            raise ConfigError(f"experiment.{key} must be >= 0, got {getattr(exp, key)}")
    for key in ("kd_examples_per_step", "eval_max_new_tokens", "eval_concurrency", "tokenizer_vocab"):
        if getattr(exp, key) < 1:
            raise ConfigError(f"experiment.{key} must be >= 1, got {getattr(exp, key)}")
    if exp.kd_lr <= 0 or exp.opd_lr < 0:
        raise ConfigError(f"experiment.kd_lr must be > 0 and experiment.opd_lr >= 0 (0: train.lr), "
                          f"got {exp.kd_lr} and {exp.opd_lr}")
    if list(exp.prompt_buckets) != sorted(set(exp.prompt_buckets)) or not exp.prompt_buckets \
            or exp.prompt_buckets[0] < 1:
        raise ConfigError("experiment.prompt_buckets must be strictly increasing positive lengths, "
                          f"got {exp.prompt_buckets}")
    r = exp.reference
    if not (0.0 <= r.alternative <= 1.0 and 0.0 <= r.wrong <= 1.0 and r.alternative + r.wrong <= 1.0) or r.seed < 0:
        raise ConfigError(f"experiment.reference: alternative={r.alternative} and wrong={r.wrong} must be probabilities "
                          f"with a sum <= 1, and seed={r.seed} >= 0 (all 0: a deterministic reference teacher)")
    if not 0.0 <= r.latency_s <= 600.0:
        raise ConfigError(f"experiment.reference.latency_s={r.latency_s} must be 0-600 seconds (the delay of each "
                          "answer, standing in for a paid API's latency; 0: answer at once)")
    s = exp.student
    if min(s.hidden_size, s.intermediate_size, s.num_hidden_layers, s.num_attention_heads,
           s.num_key_value_heads, s.head_dim, s.max_position_embeddings) < 1:
        raise ConfigError("experiment.student: every size must be >= 1")
    if s.num_attention_heads % s.num_key_value_heads:
        raise ConfigError(f"experiment.student.num_attention_heads={s.num_attention_heads} must be a multiple of "
                          f"num_key_value_heads={s.num_key_value_heads}")
