"""Self-ActionOPD (paper 3.6, B.5): the teacher is the current student weights plus privileged
context the student never sees; teacher samples are refreshed every collection step from
the updated weights; only student candidates are trained on."""

import jax
import numpy as np
import pytest

from actionopd_jax.baselines.kd import kd_examples
from actionopd_jax.baselines.self_opd import (GUIDANCE, TEACHER_EXTRA_TOKENS, SelfActionOPDGroupSource,
                                              privileged_context)
from actionopd_jax.baselines.wiring import build_source
from actionopd_jax.chat import build_tiny_tokenizer, load_tokenizer
from actionopd_jax.config.load import replace_keys
from actionopd_jax.eval.tasks import select_tasks
from actionopd_jax.model import PRESETS
from actionopd_jax.model.weights import save_hf
from actionopd_jax.sampling import Buckets
from actionopd_jax.serve.openai_http import OpenAIServer
from actionopd_jax.train.loop import Trainer
from actionopd_jax.train.setup import build_mesh, model_config
from actionopd_jax.train.sources import SourceContext
from actionopd_jax.types import Task
from tests._baselines_fixtures import (fit_student, tiny_run_config, toy_env_factory, toy_tasks, toy_teacher_backend,
                                       toy_trajectories)
from tests._collect_fixtures import ListTaskStream, toy_task

SECRET = "PRIVILEGED-NOTE: the reference first action is add with a=2 and b=3."


def test_privileged_context_comes_from_the_task_and_never_from_the_public_conversation():
    bfcl = select_tasks("bfcl:base", limit=1)[0]
    text = privileged_context(bfcl)
    from actionopd_jax.envs import bfcl_data

    first_call = bfcl_data.ground_truth(bfcl.task_id)[0][0]
    assert text.startswith("Reference tool calls") and first_call in text
    tau = Task("retail/0", "tau2_retail", payload={"domain": "retail", "tau2_id": "0"})
    tau_text = privileged_context(tau, {"retail/0": "Prepared summary: Yusuf Rossi forgot his email."})
    assert "Prepared summary: Yusuf Rossi" in tau_text and "find_user_id_by_name_zip" in tau_text
    assert "do not remember your email" not in tau_text  # never the simulator's raw instructions
    with pytest.raises(ValueError, match="no prepared privileged summary"):
        privileged_context(tau)
    assert privileged_context(toy_task("t", "x", privileged_context=SECRET)) == SECRET
    assert privileged_context(toy_task("t", "x")) == ""


@pytest.fixture(scope="module")
def warm_student_dir(tmp_path_factory):
    """A tiny student fitted (plain optax loop) to the toy teacher's first turns, so that its
    samples are often -- not always -- valid tool calls; saved as an HF dir with the tokenizer."""
    root = tmp_path_factory.mktemp("self")
    tok_dir = build_tiny_tokenizer(root / "tok")
    tok = load_tokenizer(tok_dir)
    with OpenAIServer(toy_teacher_backend()) as srv:
        records = toy_trajectories(srv.base_url, toy_tasks(1))
    # the same turns with the teacher's privileged system text: the shared weights must act
    # sensibly in both roles (a fixture property, not something Self-ActionOPD provides)
    from actionopd_jax.baselines.self_opd import GUIDANCE
    from actionopd_jax.teacher.local_provider import with_privileged_context

    teacher_view = [{**r, "messages": with_privileged_context(r["messages"], GUIDANCE + "\n\n" + SECRET)}
                    for r in records]
    examples = kd_examples(records + teacher_view, tok, max_prompt_tokens=1024)
    # 50 steps (not 60): the loss is below 0.2 from step ~46 on at this seed; each step is ~1 s on CPU
    model, losses = fit_student(examples, len(tok), seed=3, steps=50)
    assert losses[-1] < 0.2
    out = root / "student"
    save_hf(model, PRESETS["tiny"], out)
    for f in tok_dir.iterdir():
        if f.is_file():
            (out / f.name).write_bytes(f.read_bytes())
    return out


def test_self_actionopd_teacher_is_the_current_student_with_privileged_context(warm_student_dir, tmp_path):
    cfg = tiny_run_config(warm_student_dir, f"model.hf_path={warm_student_dir}", "collect.kind=actionopd",
                          "teacher.kind=self", "teacher.temperature=1.0", "teacher.top_p=1.0", "teacher.top_k=0",
                          "teacher.max_tokens=32", "teacher.enable_thinking=false", "matcher.kind=rules",
                          "collect.num_candidates=4", "collect.teacher_samples=3", "collect.task_starts_per_step=2",
                          "collect.max_decisions=1", "train.minibatch_rows=16", "train.lr=1e-3", "run.seed=1")
    tok = load_tokenizer(warm_student_dir)
    ctx = SourceContext(model_config=model_config(cfg), run_dir=str(tmp_path), tokenizer_path=str(warm_student_dir),
                        process_index=0, process_count=1, mesh=build_mesh(cfg))
    observed: dict[int, list[np.ndarray]] = {}

    def observe(step, model):
        from flax import nnx

        observed[step] = [np.asarray(x) for x in jax.tree.leaves(nnx.state(model, nnx.Param))]

    tasks = [toy_task(f"toy-self-{i}", "self", privileged_context=SECRET) for i in range(4)]
    source = SelfActionOPDGroupSource(
        cfg, ctx, stream=ListTaskStream(tasks, per_step=2), env_factory=toy_env_factory, tokenizer=tok,
        buckets=Buckets(prompt_len=(512,), prompts=(8,), samples=(4,), max_new=(32,), max_rows=32),
        teacher_buckets=Buckets(prompt_len=(512,), prompts=(8,), samples=(4,), max_new=(32,), max_rows=32),
        observe=observe)
    teacher = source.self_teacher
    assert teacher.settings.max_prompt_tokens == cfg.collect.max_prompt_tokens + TEACHER_EXTRA_TOKENS
    trainer = Trainer(cfg, run_dir=tmp_path / "run", source=source)
    try:
        params0 = [np.asarray(x) for x in jax.tree.leaves(trainer.state["params"])]
        m0 = trainer.train_step()
        groups0 = source.last.groups
        assert teacher.identity["model"] == "self@step-0" and teacher.teacher_prompts
        # the teacher sampled with the step's student weights (the initial ones at step 0)
        assert all(np.array_equal(a, b) for a, b in zip(observed[0], params0))
        # privileged text: first in the teacher's system message, nowhere in the student's prompt
        for messages in teacher.teacher_prompts:
            assert messages[0]["role"] == "system"
            assert messages[0]["content"].startswith(GUIDANCE + "\n\n" + SECRET)
        assert groups0 and all(SECRET not in tok.decode(g.prompt_ids.tolist()) and "Privileged" not in
                               tok.decode(g.prompt_ids.tolist()) for g in groups0)
        # only student candidates become rows: N rows per retained group
        retained = [g for g in groups0 if g.retained]
        assert retained, "the warm student should disagree with itself on some state (seeded run)"
        assert m0["rows"] == 4 * len(retained) and m0["updates"] >= 1
        assert all(len(g.teacher_samples) >= 1 for g in groups0)
        params1 = [np.asarray(x) for x in jax.tree.leaves(trainer.state["params"])]
        assert any(not np.array_equal(a, b) for a, b in zip(params0, params1))

        trainer.train_step()
        # step 1: the teacher is refreshed to the UPDATED weights (no cached step-0 answers)
        assert teacher.identity["model"] == "self@step-1" and teacher.teacher_prompts
        assert all(np.array_equal(a, b) for a, b in zip(observed[1], params1))
    finally:
        trainer.close()


def test_config_builds_the_self_source_and_rejects_self_teacher_outside_actionopd(tmp_path):
    from actionopd_jax.config import ConfigError

    tok_dir = build_tiny_tokenizer(tmp_path / "tok")
    cfg = tiny_run_config(tok_dir, "collect.kind=actionopd", "teacher.kind=self", "matcher.kind=rules",
                          "env.name=bfcl", "env.domains=[base]", "env.allow_eval_overlap=true",
                          "collect.task_starts_per_step=1")
    ctx = SourceContext(model_config=model_config(cfg), run_dir=str(tmp_path), tokenizer_path=str(tok_dir),
                        process_index=0, process_count=1, mesh=build_mesh(cfg))
    source = build_source(cfg, ctx)
    assert isinstance(source, SelfActionOPDGroupSource) and source.collector.teacher is source.self_teacher
    with pytest.raises(ConfigError, match="teacher.kind=self"):
        replace_keys(cfg, **{"collect.kind": "kd", "train.loss": "kd"})
