"""run.budget_* as a hard cap (issue 46 items 2 and 3): every paid request reserves its worst
case on the process's ledger (paid_calls.py) before it is sent, the check before a step
reserves the next batch (train/budget.py), and a run that reaches the cap stops saved with
exit 3 and a message that says what was spent, what the next batch would reserve, the cap and
how to go on. The ActionOPD run and the KD run are real: a loopback OpenAI-compatible teacher
that reports usage, the real `openai` client, the trainer's loop."""

import jax
import numpy as np
import pytest

from actionopd_jax import paid_calls
from actionopd_jax.config.load import from_dict, replace_keys
from actionopd_jax.paid_calls import PROMPT_ALLOWANCE_TOKENS, BudgetReached, Ledger, prompt_token_bound
from tests._chat_fixtures import tiny_tokenizer, tiny_tokenizer_dir  # noqa: F401 (fixtures)
from tests._collect_fixtures import (ListTaskStream, Script, ToyEnv, judge_backend, make_matcher, make_teacher, serve,
                                     teacher_backend, toy_run_config, toy_task)

PRICE = (1000.0, 0.0, 1000.0)   # USD per million tokens: $0.001 a token, so a request costs about a dollar


def _ledger(usd=0.0, teacher_tokens=0, max_tokens=10):
    ledger = Ledger({"usd": usd, "teacher_tokens": teacher_tokens}, {"teacher": PRICE}, {"teacher": max_tokens})
    ledger.begin_step(0, 0.0, {})
    return ledger


def test_a_reservation_is_the_batch_worst_case_and_spend_never_passes_the_cap():
    """A batch reserves its prompt bound (JSON bytes + the allowance) per request plus
    max_tokens per reply at the role's price; a reservation that would pass the cap raises
    before anything is sent, even when the last batch was cheaper (the old check forecast from
    the last step and let a dearer one through); once refused, the step sends nothing more."""
    messages = [{"role": "user", "content": "x" * 88}]
    bound = prompt_token_bound(messages)
    assert bound == len('{"messages": [{"role": "user", "content": "' + "x" * 88 + '"}], "tools": []}') \
        + PROMPT_ALLOWANCE_TOKENS
    ledger = _ledger(usd=2.0)
    usd, tokens = ledger.worst_case("teacher", bound, replies=3, requests=3)
    assert tokens == 3 * bound + 3 * 10 and usd == pytest.approx(tokens / 1000)
    hold = ledger.reserve("teacher", bound, replies=1)              # one small request: fits
    ledger.record("teacher", requests=1, prompt_tokens=40, completion_tokens=5)
    ledger.release(hold)
    assert ledger.spend_usd == pytest.approx(0.045)
    with pytest.raises(BudgetReached) as refused:                    # a dearer batch: refused whole
        ledger.reserve("teacher", bound, replies=3, requests=3)
    assert ledger.spend_usd == pytest.approx(0.045)                  # nothing was sent, nothing spent
    msg = str(refused.value)
    assert msg.startswith("budget: the paid models (teacher, judge, user simulator) have cost $0.0450 of "
                          "run.budget_usd=$2.0000; the next teacher request batch reserves up to $")
    assert "which would pass the cap: so the run stops within step 0" in msg and "could pass" not in msg
    assert "raise the cap and rerun the same command" in msg and f"run.budget_usd >= ${0.045 + usd:,.4f}" in msg
    with pytest.raises(BudgetReached):                               # the step is over: even a small one is refused
        ledger.reserve("teacher", 1, replies=1)
    ledger.begin_step(1, ledger.spend_usd, {})
    ledger.release(ledger.reserve("teacher", bound, replies=1))      # the next step starts open again
    # token caps alike, per role
    tok = _ledger(teacher_tokens=bound + 9)
    with pytest.raises(BudgetReached, match=r"the teacher has used 0 of run.budget_teacher_tokens="):
        tok.reserve("teacher", bound, replies=1)


def test_in_flight_reservations_count_and_a_cancelled_request_is_counted_at_its_worst_case():
    import asyncio

    ledger = _ledger(usd=1.0)
    first = ledger.reserve("teacher", 400, replies=1)        # $0.41 held
    ledger.reserve("teacher", 400, replies=1)                # $0.82 held
    with pytest.raises(BudgetReached):
        ledger.reserve("teacher", 400, replies=1)            # a third would pass $1 while two are in flight
    ledger.release(first, cancelled=True)                    # cancelled in flight: may have been billed
    assert ledger.spend_usd == pytest.approx(0.41)

    async def cancelled() -> None:
        again = _ledger(usd=1.0)
        paid_calls.install(again)
        try:
            async def call():
                with paid_calls.paid_request("teacher", [{"role": "user", "content": "hi"}]):
                    await asyncio.sleep(3600)
            task = asyncio.ensure_future(call())
            await asyncio.sleep(0)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        finally:
            paid_calls.install(None)
        usd, _ = again.worst_case("teacher", prompt_token_bound([{"role": "user", "content": "hi"}]), 1)
        assert again.spend_usd == pytest.approx(usd)

    asyncio.run(cancelled())


def test_the_check_before_step_0_refuses_a_cap_that_cannot_buy_one_batch():
    """Step 0 was never checked: a $0.010 cap ended at $0.023. Now the check before a step
    reserves the smallest teacher batch (K replies of max_tokens), so such a cap stops the run
    before any request, with a message that says so."""
    from actionopd_jax.train.budget import ledger_from, step_refusal

    cfg = from_dict({"collect": {"kind": "actionopd", "teacher_samples": 3}, "model": {"preset": "tiny"},
                     "teacher": {"kind": "openai", "provider": "vllm", "model": "t", "base_url": "http://127.0.0.1:9/v1",
                                 "price": list(PRICE), "max_tokens": 64},
                     "run": {"budget_usd": 0.010}, "env": {"name": "bfcl", "domains": ["base"], "allow_eval_overlap": True}})
    ledger = ledger_from(cfg)
    msg = step_refusal(cfg, ledger, 0, pays=True)
    assert msg is not None and msg.startswith("budget: the paid models (teacher, judge, user simulator) have cost "
                                              "$0.0000 of run.budget_usd=$0.0100; the next teacher request batch "
                                              "reserves up to $")
    assert "step 0 would start with it, so the run stops before that step" in msg and "Saved at step 0" in msg
    assert step_refusal(cfg, ledger, 0, pays=False) is None          # KD from a recorded file pays nothing
    roomy = ledger_from(replace_keys(cfg, **{"run.budget_usd": 10.0}))
    assert step_refusal(cfg, roomy, 0, pays=True) is None


def _cfg(tmp_path, name, **keys):
    return toy_run_config(tmp_path / name, PRICE, **keys)


def test_a_budget_stops_the_run_before_a_step_that_could_pass_it_with_the_state_saved(tiny_tokenizer, tmp_path):
    """Issue 35 item 3, under the hard cap of issue 46: run.budget_usd against the teacher's
    priced usage. The run stops at the first request batch that would pass the cap (within a
    step or before it), saved at the last finished step, exit 3, spend <= cap; resumed with a
    raised cap it goes on to the parameters of a run that never stopped, with the ledger's
    totals carried, and the teacher cache keeps every paid-for answer: the capped run plus its
    resumption sent the server what the uncapped run sent."""
    from actionopd_jax.checkpoint import Checkpointer
    from actionopd_jax.collect import ActionOPDGroupSource
    from actionopd_jax.sampling import Buckets
    from actionopd_jax.train.loop import BUDGET_EXIT_CODE, Trainer
    from actionopd_jax.train.setup import build_mesh, model_config
    from actionopd_jax.train.sources import SourceContext

    def run(budget: float, name: str = "run"):
        # 2 steps of 2 task starts (suite time): a stop within or before step 1 and its resumption
        # are the same paths as with more steps or starts
        cfg = _cfg(tmp_path, name, **{"run.budget_usd": budget, "train.steps": 2, "collect.task_starts_per_step": 2})
        run_dir = tmp_path / name
        ctx = SourceContext(model_config=model_config(cfg), run_dir=str(run_dir), tokenizer_path="",
                            process_index=0, process_count=1, mesh=build_mesh(cfg))
        tasks = [toy_task(f"t{i}", f"budget{i}") for i in range(4)]
        teacher = teacher_backend(Script({}, {}))
        with serve(teacher, judge_backend()) as server:
            source = ActionOPDGroupSource(cfg, ctx, teacher=make_teacher(server, cache_path=tmp_path / f"{name}.sqlite",
                                                                         max_tokens=16),
                                          matcher=make_matcher(server),
                                          stream=ListTaskStream(tasks, per_step=2), env_factory=lambda task: ToyEnv(),
                                          tokenizer=tiny_tokenizer,
                                          buckets=Buckets(prompt_len=(1024,), prompts=(4,), samples=(4,),
                                                          max_new=(16,), max_rows=16))
            resume = "latest" if (run_dir / "checkpoints").is_dir() else None
            trainer = Trainer(cfg, run_dir=run_dir, source=source, resume=resume)
            try:
                code = trainer.run()
                params = jax.tree.map(np.asarray, trainer.state["params"])
                return trainer, code, source, params, len(teacher.requests)
            finally:
                trainer.close()

    uncapped, code, free, free_params, served_free = run(budget=0.0, name="uncapped")
    assert code == 0
    # a cap that buys the largest batch's reservation and one of the two steps' real cost: the
    # run must stop before the end (where depends on how many batches are held in flight at once;
    # every stop point must resume right)
    budget = free.meters.teacher.spend_usd / 2 + uncapped.ledger.largest["usd"]
    trainer, code, source, _, served = run(budget=budget)
    assert code == BUDGET_EXIT_CODE and trainer.step in (0, 1)
    assert trainer.stop_message.startswith("budget: the paid models (teacher, judge, user simulator) have cost $")
    assert "could pass" not in trainer.stop_message and "the next teacher request batch reserves up to $" \
        in trainer.stop_message
    spent = trainer.ledger.spend_usd
    assert spent <= budget and source.meters.teacher.spend_usd == pytest.approx(spent)
    ckpt = Checkpointer(tmp_path / "run" / "checkpoints", read_only=True)
    assert ckpt.steps() == [trainer.step]
    ckpt.close()
    assert served == source.meters.teacher.requests   # the server counted what the meter did
    trainer, code, source, params, served_after = run(budget=1e9)     # raised: goes on to the end
    assert code == 0 and trainer.step == 2 and trainer.ledger.spend_usd > spent
    assert served + served_after == served_free
    assert source.meters.teacher.requests == free.meters.teacher.requests == served_free
    assert source.meters.teacher.spend_usd == pytest.approx(free.meters.teacher.spend_usd)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(free_params)):
        np.testing.assert_array_equal(a, b)


def _kd_train(tmp_path, name, cap, steps):
    """`actionopd train collect.kind=kd` against a loopback teacher that reports usage, priced at
    $0.001 a token and capped at `cap` dollars; returns (exit code, stderr+stdout, requests served)."""
    from actionopd_jax.chat import build_tiny_tokenizer
    from actionopd_jax.commands import train as cli
    from actionopd_jax.serve.openai_http import OpenAIServer
    from actionopd_jax.serve.scripted import ScriptedBackend, message_choice

    tok_dir = build_tiny_tokenizer(tmp_path / f"tok-{name}")
    backend = ScriptedBackend("kd-teacher", lambda req: message_choice("I cannot help with that."))
    with OpenAIServer(backend) as srv:
        args = ["model.preset=tiny", f"model.tokenizer={tok_dir}", f"train.steps={steps}", "collect.kind=kd",
                "train.loss=kd", "env.name=bfcl", "env.allow_eval_overlap=true", "collect.task_starts_per_step=2",
                "kd.trials=1", "teacher.kind=openai", "teacher.provider=vllm", f"teacher.base_url={srv.base_url}",
                "teacher.model=kd-teacher", "teacher.api_key_env=", "teacher.max_tokens=32",
                "teacher.price=[1000,0,1000]", f"run.budget_usd={cap}", "run.progress=false", "run.tensorboard=false",
                "experiment.enabled=false", "--run-dir", str(tmp_path / name)]
        code = cli.main(args)
        served = len(backend.requests)
    return code, served


def test_kd_with_a_cap_below_one_request_stops_before_step_0_and_sends_nothing(tmp_path, capsys):
    """Issue 46 item 2: with collect.kind=kd and a $0.001 cap, the run made 163 teacher requests
    (~$0.98) and exited 0, unmetered. Now the check before step 0 reserves the teacher's smallest
    request: exit 3, no request sent, the message says what the cap buys."""
    from actionopd_jax.train.loop import BUDGET_EXIT_CODE

    code, served = _kd_train(tmp_path, "tiny-cap", 0.001, steps=3)
    err = capsys.readouterr().err
    assert code == BUDGET_EXIT_CODE, err
    assert served == 0
    assert "stopped: budget: the paid models (teacher, judge, user simulator) have cost $0.0000 of " \
           "run.budget_usd=$0.0010; the next teacher request batch reserves up to $" in err
    assert "step 0 would start with it, so the run stops before that step" in err and "could pass" not in err


def test_kd_is_metered_and_stops_at_its_cap_with_spend_within_it(tmp_path, capsys):
    """KD's teacher requests draw on run.budget_usd: the run stops with exit 3 at the first
    request batch that would pass the cap, having spent no more than the cap (metrics.jsonl and
    spend.md say what, and the server counted what the meter did)."""
    import json

    from actionopd_jax.train.loop import BUDGET_EXIT_CODE

    cap = 40.0
    code, served = _kd_train(tmp_path, "kd", cap, steps=20)
    out = capsys.readouterr()
    assert code == BUDGET_EXIT_CODE, out.err
    assert "stopped: budget: the paid models (teacher, judge, user simulator) have cost $" in out.err
    rows = [json.loads(line) for line in (tmp_path / "kd" / "metrics.jsonl").read_text().splitlines()]
    last = rows[-1]
    assert last.get("budget_stop") == 1.0 and 0 < last["collect/spend_usd_total"] <= cap
    steps = [r for r in rows if "loss" in r or "rows" in r]   # the finished steps' lines carry the meter too
    assert steps and all("collect/teacher/spend_usd" in r and "collect/teacher/requests_total" in r for r in steps)
    assert last["collect/teacher/requests_total"] == served > 0
    assert (tmp_path / "kd" / "spend.md").is_file() and "| teacher |" in (tmp_path / "kd" / "spend.md").read_text()


def test_check_shows_the_cap_against_the_estimate_and_warns_when_it_buys_no_step():
    """`--check` accepted a $0.001 cap: it now says how many steps the cap buys and warns when
    it cannot buy the teacher's first request batch."""
    from actionopd_jax.train.cost_estimate import describe, estimate

    base = {"collect": {"kind": "actionopd", "teacher_samples": 3}, "model": {"preset": "tiny"},
            "train": {"steps": 10},
            "teacher": {"kind": "openai", "provider": "vllm", "model": "t", "base_url": "http://127.0.0.1:9/v1",
                        "price": [1.0, 0.1, 2.0], "max_tokens": 256},
            "env": {"name": "bfcl", "domains": ["base"], "allow_eval_overlap": True}}
    tiny = from_dict({**base, "run": {"budget_usd": 0.001}})
    lines = describe(tiny, estimate(tiny, None), "assumed")
    budget = [line for line in lines if "budget:" in line or "WARNING" in line]
    assert budget[0].startswith("  budget: run.budget_usd=$0.0010 against $") and "of 10 steps" in budget[0]
    assert budget[1].startswith("  WARNING: run.budget_usd=$0.0010 buys 0 steps")
    roomy = from_dict({**base, "run": {"budget_usd": 1000.0}})
    lines = describe(roomy, estimate(roomy, None), "assumed")
    assert any("buys 10 / 10 / 10 of 10 steps" in line for line in lines) and not any("WARNING" in x for x in lines)


def test_the_warm_starts_teacher_episodes_are_metered_capped_and_carried_into_the_job(tmp_path):
    """The main job's warm start asked the teacher unmetered. Its episodes (the real endpoint
    agent against a loopback teacher) now draw on run.budget_*: with a cap that buys some of
    them, the phase stops as StoppedEarly with exit code 3, spend <= cap, the totals kept in
    paid_calls.json (a rerun counts on) and the server counted what the ledger did; the job's
    ActionOPD trainer starts from those totals."""
    import asyncio
    import json

    from actionopd_jax.baselines.kd import teacher_trajectories
    from actionopd_jax.eval.agents import EndpointAgent
    from actionopd_jax.serve.openai_http import OpenAIServer
    from actionopd_jax.train.budget import PHASE_FILE, carry_phase_spend, ledger_from, phase_ledger
    from actionopd_jax.train.sources import StoppedEarly
    from tests._baselines_fixtures import toy_env_factory, toy_teacher_backend, toy_tasks

    def episodes(cap, name):
        cfg = replace_keys(_cfg(tmp_path, name), **{"run.budget_usd": cap, "teacher.max_tokens": 32})
        backend = toy_teacher_backend()
        with OpenAIServer(backend) as srv:
            agent = EndpointAgent(srv.base_url, "toy-teacher", max_tokens=32, role="teacher")
            with phase_ledger(cfg, tmp_path / name, "warm start (teacher trajectories)") as ledger:
                asyncio.run(teacher_trajectories(agent, toy_tasks(6), toy_env_factory, concurrency=1,
                                                 keep_successful=False, out_jsonl=tmp_path / name / "t.jsonl"))
        return ledger, len(backend.requests), cfg

    free, served_free, _ = episodes(0.0, "free")   # unlimited: what all the episodes cost
    assert served_free == free.totals["teacher"].requests > 2 and free.spend_usd > 0
    cap = free.largest["usd"] + free.spend_usd / 2   # the largest reservation plus half the real cost
    with pytest.raises(StoppedEarly) as stop:
        episodes(cap, "capped")
    assert stop.value.code == 3 and str(stop.value).startswith("warm start (teacher trajectories): budget: ")
    saved = json.loads((tmp_path / "capped" / PHASE_FILE).read_text())
    spent = sum(t["spend_usd"] for t in saved["totals"].values())
    assert 0 < spent <= cap and 0 < saved["totals"]["teacher"]["requests"] < served_free
    job = ledger_from(_cfg(tmp_path, "job"))
    carry_phase_spend(job, tmp_path / "capped")
    assert job.spend_usd == pytest.approx(spent)


def test_opd_echo_scoring_reserves_its_exact_prompt_and_records_usage():
    """The OPD baseline's teacher scoring (/v1/completions, token ids, echo) was unmetered."""
    from actionopd_jax.baselines.opd import EndpointScorer
    from actionopd_jax.serve.openai_http import OpenAIServer
    from actionopd_jax.serve.scripted import ScriptedBackend, message_choice

    import openai

    from actionopd_jax.train.sources import RunStop

    backend = ScriptedBackend("scorer", lambda req: message_choice("x"))
    ledger = Ledger({"usd": 1.0}, {"teacher": PRICE}, {"teacher": 8192})
    ledger.begin_step(0, 0.0, {})
    prompts, responses = [np.arange(5, 25, dtype=np.int32)], [np.arange(30, 35, dtype=np.int32)]
    with OpenAIServer(backend) as srv:
        scorer = EndpointScorer(srv.base_url, "scorer")
        paid_calls.install(ledger)
        try:
            with pytest.raises((openai.BadRequestError, RunStop), match="cannot score tokens"):
                scorer.score(prompts, responses)   # a scripted model cannot score; the request was reserved
        finally:
            paid_calls.install(None)
    # the reservation was the exact prompt (20 + 5 token ids) plus one output token; a refused
    # request (HTTP 400) is not billed, so nothing is recorded as spent
    assert ledger.largest == {"usd": pytest.approx(26 / 1000), "tokens": 26, "role": "teacher"}
    assert ledger.spend_usd == 0.0 and ledger.totals["teacher"].requests == 0
    tight = Ledger({"usd": 0.02}, {"teacher": PRICE}, {"teacher": 8192})
    tight.begin_step(0, 0.0, {})
    paid_calls.install(tight)
    try:
        with pytest.raises(BudgetReached, match="reserves up to \\$0.0260"):
            EndpointScorer("http://127.0.0.1:9/v1", "scorer").score(prompts, responses)   # refused before sending
    finally:
        paid_calls.install(None)


def test_the_jobs_final_measurement_collection_draws_on_the_same_ledger(tmp_path, caplog):
    """The main job's last collection (the final policy, no update) ran after the trainer had
    given its ledger back: its teacher calls escaped the cap. Now it runs on the trainer's
    ledger; a cap it would pass skips it with a warning. The source here is a stand-in whose
    collect makes one real reservation on the installed ledger (what a teacher batch does)."""
    import logging
    import types

    from actionopd_jax.experiment.phases import measure_within_budget
    from actionopd_jax.train.budget import ledger_from

    class OneBatchSource:
        calls = 0

        def collect(self, step, policy):
            self.calls += 1
            with paid_calls.paid_request("teacher", [{"role": "user", "content": "x" * 100}], replies=3) as ledger:
                ledger.record("teacher", requests=1, prompt_tokens=30, completion_tokens=3)
            return []

    def measure(cap):
        cfg = replace_keys(_cfg(tmp_path, "job"), **{"run.budget_usd": cap})
        trainer = types.SimpleNamespace(ledger=ledger_from(cfg), step=3)
        source = OneBatchSource()
        measure_within_budget(cfg, trainer, source, None)
        return trainer.ledger, source.calls

    ledger, calls = measure(100.0)
    assert calls == 1 and ledger.totals["teacher"].requests == 1 and ledger.spend_usd == pytest.approx(0.033)
    assert paid_calls.current() is None                       # given back afterwards
    with caplog.at_level(logging.WARNING, logger="actionopd_jax.experiment.phases"):
        ledger, calls = measure(0.0005)
    assert calls == 0 and ledger.spend_usd == 0.0
    assert "final policy's measurement collection is skipped (the curve ends at step 3): budget: " in caplog.text
