"""The self-disagreeing reference teacher (issue 26 item 8): seeded per-sample draws among the
due reference call, the turn's other due calls and a plausible wrong action, so the match
count c takes values between 0 and K and r_lambda differs from the binary reward. Real HTTP:
the embedded server, the OpenAI teacher client, the rules matcher."""

import asyncio
from collections import Counter

import numpy as np
import pytest

from actionopd_jax.envs.reference import BFCL_DONE, reference_policy
from actionopd_jax.envs.reference_disagreement import Disagreement, sample_actions
from actionopd_jax.envs.registry import make_environment
from actionopd_jax.eval.tasks import select_tasks
from actionopd_jax.matching.matcher import Matcher
from actionopd_jax.rewards import RewardConfig, score_group
from actionopd_jax.serve.reference_backend import MODEL_NAME, ReferenceBackend
from actionopd_jax.types import Invalid, Message, ToolCall
from tests._teacher_fixtures import serve, teacher_for

CD_PROJECTS = ToolCall("cd", {"folder": "projects"})
CD_PHOTO = ToolCall("cd", {"folder": "photography"})
CP_IMAGE = ToolCall("cp", {"source": "test_image1.jpg", "destination": "backup_tests"})
CP_DOC = ToolCall("cp", {"source": "test_document.txt", "destination": "backup_tests"})


@pytest.fixture(scope="module")
def turn2():
    """multi_turn_base_3 at the opening of its second turn (reference calls: cd projects,
    cd photography, cp image, cp document)."""
    task = next(t for t in select_tasks("bfcl:base", limit=4) if t.task_id == "multi_turn_base_3")

    async def play():
        env, policy = make_environment(task.env), reference_policy(task)
        obs = await env.reset(task)
        while sum(m["role"] == "user" for m in obs.messages) < 2:
            obs, _ = await env.step(policy.next_action(obs))
        return obs

    return task, asyncio.run(play())


def test_options_of_a_bfcl_state_follow_the_calls_already_made(turn2):
    task, obs = turn2
    policy = reference_policy(task)
    assert policy.options(obs) == (CD_PROJECTS, [CD_PHOTO, CP_IMAGE, CP_DOC], [Message(BFCL_DONE)])
    # a reordered call counts as made: the teacher does not ask for it again
    made = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "cp", "arguments": '{"source": "test_image1.jpg", '
                                                                                 '"destination": "backup_tests"}'}}]}
    later = obs.__class__(messages=obs.messages + [made, {"role": "tool", "tool_call_id": "c1", "content": "{}"}],
                          tools=obs.tools)
    assert policy.options(later) == (CD_PROJECTS, [CD_PHOTO, CP_DOC], [Message(BFCL_DONE)])


def test_draw_frequencies_follow_the_configured_probabilities(turn2):
    """Independent of the seeded sequence: over 4 x 300 draws, P(wrong) = 0.25, P(each of the
    3 alternatives) = 0.5 / 3, P(due) = 0.25 (binomial sd ~0.013 at n=1200; tolerance 0.05)."""
    task, obs = turn2
    d = Disagreement(alternative=0.5, wrong=0.25, seed=3)
    draws = [a for s in range(4) for a in sample_actions(reference_policy(task), obs.messages, obs.tools, 300, d, s)]
    freq = {k: v / len(draws) for k, v in Counter(repr(a) for a in draws).items()}
    assert abs(freq[repr(Message(BFCL_DONE))] - 0.25) < 0.05
    assert abs(freq[repr(CD_PROJECTS)] - 0.25) < 0.05
    for alt in (CD_PHOTO, CP_IMAGE, CP_DOC):
        assert abs(freq[repr(alt)] - 0.5 / 3) < 0.05


def test_counts_take_intermediate_values_and_r_lambda_differs_from_binary(turn2):
    """K=8 samples over HTTP from the seeded server. The seeded draw is a PIN (seed 0, this
    conversation as the client sends it): cp document x5, cd photography x1, cd projects x1, Done x1.
    The rewards are then eq. 6 by hand: r = 1 + lambda (c - 1) / (K - 1), lambda = 0.5, K = 8."""
    task, obs = turn2
    backend = ReferenceBackend([task], disagreement=Disagreement(alternative=0.5, wrong=0.25, seed=0))
    with serve([backend]) as server:
        teacher = teacher_for(server, MODEL_NAME, temperature=0.6)
        samples = asyncio.run(teacher.sample(obs.messages, obs.tools, 8))
        again = asyncio.run(teacher_for(server, MODEL_NAME).sample(obs.messages, obs.tools, 8))
    actions = [s.action for s in samples]
    assert [a for a in actions] == [a.action for a in again]  # seeded: the same request, the same samples
    counted = Counter(repr(a) for a in actions)
    assert counted == {repr(CP_DOC): 5, repr(Message(BFCL_DONE)): 1, repr(CD_PHOTO): 1, repr(CD_PROJECTS): 1}

    candidates = [CP_DOC, CD_PROJECTS, Message(BFCL_DONE), CP_IMAGE, Invalid("unparsable")]
    verdicts = asyncio.run(Matcher(None).match_group(candidates, actions, messages=obs.messages, tools=obs.tools))
    valid = [not isinstance(c, Invalid) for c in candidates]
    lam = score_group(verdicts, valid, RewardConfig(k=8, lam=0.5, mode="actionopd"))
    binary = score_group(verdicts, valid, RewardConfig(k=8, lam=0.5, mode="binary"))
    assert lam.counts.tolist() == [5, 1, 1, 0, 0]  # c strictly between 0 and K for three candidates
    np.testing.assert_allclose(lam.train_rewards, [1 + 0.5 * 4 / 7, 1.0, 1.0, 0.0, -1.0])
    np.testing.assert_allclose(lam.train_rewards, [1.2857143, 1.0, 1.0, 0.0, -1.0], rtol=1e-6)
    np.testing.assert_allclose(binary.train_rewards, [1.0, 1.0, 1.0, 0.0, -1.0])


def test_request_seed_gives_each_trial_its_own_samples_and_default_stays_deterministic(turn2):
    task, obs = turn2
    policy = reference_policy(task)
    d = Disagreement(alternative=0.5, wrong=0.25, seed=0)
    per_seed = [sample_actions(policy, obs.messages, obs.tools, 6, d, s) for s in range(4)]
    assert per_seed[1] == sample_actions(policy, obs.messages, obs.tools, 6, d, 1)
    assert len({repr(s) for s in per_seed}) == 4  # four request seeds, four different sample lists
    with serve([ReferenceBackend([task])]) as server:  # no disagreement: K identical samples
        plain = asyncio.run(teacher_for(server, MODEL_NAME).sample(obs.messages, obs.tools, 5))
    assert [s.action for s in plain] == [CD_PROJECTS] * 5


def test_bad_probabilities_are_refused_with_what_to_set():
    with pytest.raises(ValueError, match="must be <= 1"):
        Disagreement(alternative=0.8, wrong=0.3)
    with pytest.raises(ValueError, match=r"wrong=-0.1 must be a probability"):
        Disagreement(wrong=-0.1)


def test_latency_holds_each_answer_without_blocking_other_requests(turn2, monkeypatch):
    """experiment.reference.latency_s (a paid API's latency, for measuring schedules): every
    answer waits that long on the server's loop, concurrent requests wait together, answers are
    unchanged. The wait is recorded, not timed: both requests must be waiting at once."""
    import types

    from actionopd_jax.config import ConfigError
    from actionopd_jax.config.load import load_config
    from actionopd_jax.serve import reference_backend
    from tests._configs import CONFIGS

    task, obs = turn2
    waiting, most, both = [], [], {}

    async def recorded_sleep(seconds):
        waiting.append(seconds)
        most.append(len(waiting))
        arrived = both.setdefault("event", asyncio.Event())   # made on the server's loop
        if len(waiting) == 2:
            arrived.set()
        try:   # the first waits for the second; a loop blocked by the first never lets it arrive
            await asyncio.wait_for(arrived.wait(), 30)
        except TimeoutError:
            pass
        waiting.pop()

    monkeypatch.setattr(reference_backend, "asyncio", types.SimpleNamespace(sleep=recorded_sleep))
    with serve([ReferenceBackend([task], latency_s=7.5)]) as server:
        teacher = teacher_for(server, MODEL_NAME)

        async def two():
            return await asyncio.gather(teacher.sample(obs.messages, obs.tools, 2), teacher.sample(obs.messages, obs.tools, 2))

        answers = asyncio.run(two())
    assert max(most) == 2 and not waiting
    assert [s.action for a in answers for s in a] == [CD_PROJECTS] * 4
    with pytest.raises(ConfigError, match="experiment.reference.latency_s=-1.0 must be 0-600 seconds"):
        load_config(CONFIGS / "tiny_cpu.yaml", ["experiment.reference.latency_s=-1"])
