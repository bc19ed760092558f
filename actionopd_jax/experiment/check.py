"""`actionopd train --check` for the main job: validate the config and print the job's plan,
offline (no network, no devices beyond the visible ones, nothing written).

An API-key variable that is not set is reported (by name) but does not fail the check: a plan
is made on a machine that may not hold the secrets. The run itself stops at once, naming the
variable (experiment/teacher.py).
"""

from __future__ import annotations

from pathlib import Path

from actionopd_jax.config import Config
from actionopd_jax.config.load import replace_keys


def _student_config(cfg: Config, notes: list[str]):
    from actionopd_jax.experiment.assets import random_student_config
    from actionopd_jax.model import Qwen3Config

    m = cfg.model
    if m.hf_path:
        if (Path(m.hf_path) / "config.json").is_file():
            return Qwen3Config.from_hf_json(m.hf_path, param_dtype=m.param_dtype), \
                f"checkpoint {m.hf_path}"
        from actionopd_jax.model import PRESETS

        notes.append(f"note: {m.hf_path}/config.json not found; planned with preset {m.preset!r} "
                     "(the run needs the checkpoint)")
        return PRESETS[m.preset].replace(param_dtype=m.param_dtype), \
            f"checkpoint {m.hf_path} (not on this machine)"
    vocab = cfg.experiment.tokenizer_vocab
    if m.tokenizer:
        from actionopd_jax.chat import load_tokenizer

        vocab = len(load_tokenizer(m.tokenizer))
    q = random_student_config(cfg.experiment, vocab, param_dtype=m.param_dtype)
    return q, "random init"


def check_main_job(cfg: Config, devices: int = 0) -> int:
    from actionopd_jax.experiment import teacher as teacher_lib
    from actionopd_jax.experiment.phases import context_overrides
    from actionopd_jax.experiment.tasks import job_tasks
    from actionopd_jax.train.plan import describe
    from actionopd_jax.train.preflight import check_run, mesh_sizes, placement

    exp, c = cfg.experiment, cfg.collect
    notes: list[str] = []
    teacher_lib.check_endpoint_settings(cfg)
    split = job_tasks(exp)
    mode = teacher_lib.teacher_mode(cfg)
    if mode == "reference":
        teacher = (f"{teacher_lib.REFERENCE_LABEL} (embedded server on 127.0.0.1, reference policy of the "
                   f"{len(split.train)} training tasks); matching: {teacher_lib.matching_label(cfg, True)}")
    else:
        t = cfg.teacher
        teacher = f"remote {t.model} at {t.base_url} (key from ${t.api_key_env or '<none>'}), matcher {cfg.matcher.kind}"
    notes += [f"warning: environment variable {name} is not set; the run will stop until it is exported"
              for name in teacher_lib.missing_secrets(cfg)]
    qcfg, student = _student_config(cfg, notes)
    ctx = context_overrides(cfg)
    # the ActionOPD phase as it will run (experiment/phases.py derives the same keys)
    phase = {**ctx, "collect.task_starts_per_step": len(split.train), "train.lr": exp.opd_lr or cfg.train.lr,
             "collect.kind": "actionopd", "train.loss": "actionopd", "env.name": "bfcl",
             "env.domains": [exp.bfcl_category], "model.hf_path": cfg.model.hf_path or "<random-init student>",
             "env.task_ids": [t.task_id for t in split.train], "env.heldout_task_ids": [t.task_id for t in split.heldout]}
    if mode == "reference":
        from actionopd_jax.serve.reference_backend import MODEL_NAME

        phase.update({**teacher_lib.REFERENCE_TEACHER_KEYS, **teacher_lib.reference_matcher_keys(cfg),
                      "teacher.model": MODEL_NAME,
                      "teacher.base_url": "<embedded>"})
    plan_cfg = replace_keys(cfg, **phase)
    from actionopd_jax.train.gpu_lowering import gpu_target, lower_if_gpu

    # the run's start-up checks for the devices it will have (mesh.target, else this host)
    where = placement(cfg, devices)
    target = gpu_target(cfg, devices)
    notes += where.notes
    sizes = mesh_sizes(plan_cfg, where.devices)
    # trainer-level checks only: the phases build their sources from the job's split
    check_run(plan_cfg, qcfg, sizes, device_count=where.devices, processes=where.processes,
              platform=where.platform)
    text, fits = describe(plan_cfg, qcfg, sizes, device_memory_gb=where.memory_gib, device_kind=where.device_kind,
                          platform=where.platform, usable_fraction=where.usable_fraction,
                          chips_per_host=where.devices_per_process)
    lines = [
        "main job (experiment.enabled=true): KD warm start -> ActionOPD -> held-out evaluation",
        f"tasks      BFCL {exp.bfcl_category} using only {'+'.join(exp.bfcl_classes)}: {split.pool_size} tasks, "
        f"{len(split.train)} training, {len(split.heldout)} held out (sha256 split)",
        f"teacher    {teacher}",
        f"student    {student}: hidden {qcfg.hidden_size}, {qcfg.num_hidden_layers} layers, "
        f"{qcfg.num_attention_heads} head(s) x {qcfg.head_dim}, vocab {qcfg.vocab_size}",
        f"warm start {exp.pretrain_epochs} epoch(s) of next-token pretraining on the teacher's successful "
        f"conversations, then {exp.kd_epochs} epoch(s) of KD on its turns; lr {exp.kd_lr:g}, "
        f"{exp.kd_examples_per_step} examples per update",
        f"ActionOPD  {cfg.train.steps} step(s) x {len(split.train)} task starts, N={c.num_candidates}, "
        f"K={c.teacher_samples}, lambda={c.freq_bonus}, lr {plan_cfg.train.lr:g}, context budget "
        f"{ctx['collect.max_prompt_tokens']} + {c.max_response_tokens} new tokens",
        f"eval       {len(split.heldout)} held-out tasks, greedy, {exp.eval_max_new_tokens} new tokens, before and "
        "after ActionOPD",
        text,
    ]
    from actionopd_jax.collect.source import check_training_tasks

    lines.append(check_training_tasks(plan_cfg))  # the phase's train/held-out split under the eval-overlap rule
    from actionopd_jax.experiment.prompt_check import check_job_prompts

    # the job's prompts under its tokenizer vs its budget and the student's context (issue 43 item 6)
    lines += check_job_prompts(cfg, plan_cfg, split, qcfg.max_position_embeddings)
    print("\n".join(lines + notes))
    if not lower_if_gpu(plan_cfg, qcfg, target):
        print("config valid, but some program of the run does not lower for CUDA (see above)")
        return 1
    if not fits:
        print("config valid, but the plan DOES NOT FIT the usable device memory (see above)")
        return 1
    print("config OK")
    return 0
