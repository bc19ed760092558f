"""The main job's teacher: the embedded privileged reference teacher, or a real endpoint.

Reference mode (the default, teacher.kind=none): our OpenAI-compatible server on 127.0.0.1
answers with the environment's reference policy (serve/reference_backend.py). It reads the
ground truth of the tasks it serves -- it is PRIVILEGED, and it is labelled so in the logs,
the report and the notes. It serves the training tasks only (held-out tasks are never
answerable by it), and recognises a task by its first user message, which must therefore be
unique among them (checked). The judge: the reference server itself cannot judge (a reference
policy says what the next action is, not whether two different actions are equivalent), so
matching is rules-only ("match" = same tool and canonically equal arguments, or a
normalised-equal message) unless the config names a judge of its own: matcher.kind=rules+llm
with matcher.base_url and matcher.model is honoured, that LLM judging beside the reference
teacher (issue 46 item 8: it used to be replaced by rules-only while `--check` said OK).
rules+llm naming no judge (the schema's default) is rules-only, and the plan, the log and the
report say why.

Endpoint mode (teacher.kind=openai): teacher.base_url / teacher.model, the API key read from
the environment variable named by teacher.api_key_env (never from the config, never logged).
Missing variables are reported before anything starts, naming the variable.

Either way the job then talks to the teacher only through the real HTTP client path
(`teacher.openai_provider.OpenAITeacher` behind the persistent cache, and the eval harness's
`EndpointAgent` for KD trajectories).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

from actionopd_jax.config import Config, ConfigError
from actionopd_jax.types import Task

log = logging.getLogger(__name__)

REFERENCE_LABEL = "privileged reference teacher"


def teacher_mode(cfg: Config) -> str:
    """"reference" (embedded privileged server) or "endpoint" (teacher.* section)."""
    mode = cfg.experiment.teacher
    if mode == "auto":
        return "reference" if cfg.teacher.kind == "none" else "endpoint"
    return mode


def judge_named(cfg: Config) -> bool:
    """Whether the config names an LLM judge of its own (matcher.kind=rules+llm with a URL or a
    model): the reference mode then judges with it instead of rules only."""
    m = cfg.matcher
    return m.kind == "rules+llm" and bool(m.base_url or m.model)


def reference_matcher_keys(cfg: Config) -> dict[str, Any]:
    """The matcher keys the reference mode sets: none when the config names its judge (it is
    used as configured), else rules-only matching."""
    return {} if judge_named(cfg) else {"matcher.kind": "rules"}


def matching_label(cfg: Config, privileged: bool) -> str:
    """How the job matches, for the plan, the log and the report."""
    m = cfg.matcher
    if not privileged or judge_named(cfg):
        return f"matcher.kind={m.kind}" + (f", judge {m.model} at {m.base_url}" if m.kind == "rules+llm" else "")
    why = ("matcher.kind=rules+llm names no judge (set matcher.base_url and matcher.model to judge with an LLM); "
           if m.kind == "rules+llm" else "")
    executed = (", or the same tool whose call has the same effect on a fork of the episode (matcher.execution=auto)"
                if getattr(m, "execution", "off") == "auto" else "")
    return (f"rules only: {why}a match is the same tool with canonically equal arguments{executed}, or a "
            "normalised-equal message (the reference server cannot judge equivalence)")


def missing_secrets(cfg: Config) -> list[str]:
    """Environment variables the run needs but that are not set (names only): the endpoint
    mode's teacher key, and the judge's wherever an LLM judge is used."""
    endpoint = teacher_mode(cfg) == "endpoint"
    wanted = [("teacher.api_key_env", cfg.teacher.api_key_env)] if endpoint else []
    if cfg.matcher.kind == "rules+llm" and (endpoint or judge_named(cfg)):
        wanted.append(("matcher.api_key_env", cfg.matcher.api_key_env))
    return [f"{var} ({key})" for key, var in wanted if var and not os.environ.get(var)]


def check_endpoint_settings(cfg: Config) -> None:
    """Offline validation of the teacher's and the judge's endpoint settings (no network, no
    secret values)."""
    m = cfg.matcher
    if teacher_mode(cfg) != "endpoint":
        if judge_named(cfg) and (not m.base_url or not m.model):
            raise ConfigError("matcher.kind=rules+llm beside the reference teacher judges with the LLM the config "
                              "names: set both matcher.base_url and matcher.model, or neither for rules-only "
                              "matching (or matcher.kind=rules)")
        if judge_named(cfg) and not m.base_url.startswith(("http://", "https://")):
            raise ConfigError(f"matcher.base_url={m.base_url!r} must be an http(s) URL ending in /v1")
        return
    t = cfg.teacher
    if t.kind != "openai":
        raise ConfigError(f"the main job talks to a remote teacher over the OpenAI-compatible API: set "
                          f"teacher.kind=openai (got {t.kind!r}), or teacher.kind=none for the embedded "
                          "privileged reference teacher")
    if not t.base_url or not t.model:
        raise ConfigError("teacher.kind=openai needs teacher.base_url and teacher.model")
    if not t.base_url.startswith(("http://", "https://")):
        raise ConfigError(f"teacher.base_url={t.base_url!r} must be an http(s) URL ending in /v1")
    if m.kind == "rules+llm" and (not m.base_url or not m.model):
        raise ConfigError("matcher.kind=rules+llm needs matcher.base_url and matcher.model (the LLM judge); "
                          "set them, or matcher.kind=rules for rules-only matching")


def require_secrets(cfg: Config) -> None:
    missing = missing_secrets(cfg)
    if missing:
        raise ConfigError("environment variable(s) not set: " + ", ".join(missing) +
                          ". Export the API key(s) before running, e.g. `export NAME=...`; "
                          "the key is read from the environment only, never from the config")


@dataclass
class TeacherEndpoint:
    base_url: str
    model: str
    api_key_env: str
    privileged: bool
    label: str
    server: Any = None  # the embedded OpenAIServer (reference mode)

    @property
    def requests(self) -> int:
        return self.server.request_count if self.server is not None else -1

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None


def start_teacher(cfg: Config, train_tasks: list[Task]) -> TeacherEndpoint:
    """Start (reference mode) or describe (endpoint mode) the job's teacher."""
    if teacher_mode(cfg) == "endpoint":
        check_endpoint_settings(cfg)
        require_secrets(cfg)
        t = cfg.teacher
        return TeacherEndpoint(base_url=t.base_url, model=t.model, api_key_env=t.api_key_env, privileged=False,
                               label=f"remote teacher {t.model} at {t.base_url}")
    check_endpoint_settings(cfg)  # a judge the config names beside the reference teacher
    require_secrets(cfg)
    from actionopd_jax.envs.reference_disagreement import Disagreement
    from actionopd_jax.experiment.tasks import opening_collisions
    from actionopd_jax.serve.openai_http import OpenAIServer
    from actionopd_jax.serve.reference_backend import MODEL_NAME, ReferenceBackend

    shared = opening_collisions(train_tasks)
    if shared:
        raise ConfigError(f"training tasks share their first user message ({shared[:3]}); the reference teacher "
                          "could not tell them apart: choose other experiment.bfcl_classes")
    r = cfg.experiment.reference
    disagreement = Disagreement(alternative=r.alternative, wrong=r.wrong, seed=r.seed)
    server = OpenAIServer(ReferenceBackend(train_tasks, model_name=MODEL_NAME, disagreement=disagreement,
                                           latency_s=r.latency_s), host="127.0.0.1", port=0)
    url = server.start()
    how = (f"self-disagreeing: alternative {r.alternative:g}, wrong {r.wrong:g}, seed {r.seed}"
           if disagreement.active else "deterministic")
    if r.latency_s > 0:
        how += f", each answer held {r.latency_s:g} s as an API's latency"
    log.warning("%s: embedded OpenAI-compatible server at %s answering with the reference policy of %d "
                "training tasks (it reads their ground truth; %s)", REFERENCE_LABEL.upper(), url, len(train_tasks), how)
    return TeacherEndpoint(base_url=url, model=MODEL_NAME, api_key_env="", privileged=True,
                           label=f"{REFERENCE_LABEL} (embedded, {len(train_tasks)} training tasks, {how})",
                           server=server)


def teacher_overrides(cfg: Config, endpoint: TeacherEndpoint) -> dict[str, Any]:
    """Config keys that point the trainer's teacher/matcher sections at `endpoint`."""
    if not endpoint.privileged:
        return {}
    return {**REFERENCE_TEACHER_KEYS, **reference_matcher_keys(cfg), "teacher.base_url": endpoint.base_url,
            "teacher.model": endpoint.model}


# the embedded reference teacher is our own server (provider actionopd: it takes top_k and the
# thinking switch, so the run's settings are sent, not dropped); the matcher: reference_matcher_keys
REFERENCE_TEACHER_KEYS: dict[str, Any] = {"teacher.kind": "openai", "teacher.provider": "actionopd",
                                          "teacher.api_key_env": "", "teacher.enable_thinking": False,
                                          # it costs nothing, and says so: the report's spend section
                                          # shows $0 next to the tokens it counted
                                          "teacher.price": [0.0, 0.0, 0.0]}
