"""kill -9 of a real training process collecting asynchronously (issue 44, collect.max_staleness
= 1): the resumed run loses only the episodes that were in flight, and their teacher answers
come from the teacher cache, not from new paid requests.

The child trains over the loopback teacher/judge this test serves and the small real
environment of tests/test_collect_async.py (its student's replies are fixed texts, so a redone
episode asks the teacher the same prompts). It kills itself with SIGKILL at a fixed point: in
step 2's callback, before step 2's checkpoint, once the draw in flight (draw 2) has finished
and its answers are cached. Nothing runs on the way down (no finally, no atexit, no save).
"""

import signal
import subprocess
import sys

from tests._chat_fixtures import tiny_tokenizer, tiny_tokenizer_dir  # noqa: F401 (fixtures)
from tests._collect_fixtures import case_of, judge_backend, serve, teacher_backend, toy_task
from tests._subprocess_fixtures import cli_env
from tests.test_collect_async import SCRIPT, _alive, _cfg, _source

TASKS = [toy_task(f"t{i}", f"async{i}") for i in range(16)]   # 4 draws of 4 task starts


def child(run_root: str, server_url: str, tokenizer_dir: str) -> None:
    """The training process: eta=1, a checkpoint every step, killed in step 2's callback."""
    import os
    from pathlib import Path

    from actionopd_jax.chat import load_tokenizer
    from actionopd_jax.config.load import replace_keys
    from actionopd_jax.train.loop import Trainer

    root = Path(run_root)
    cfg = replace_keys(_cfg(root), **{"train.steps": 4, "checkpoint.every_steps": 1})
    source = _source(cfg, root, load_tokenizer(tokenizer_dir), server_url, TASKS, root / "teacher.sqlite")
    trainer = Trainer(cfg, run_dir=cfg.run.dir, source=source)

    def on_step(step, metrics):
        if step == 2:
            source.scheduler.wait(2)   # draw 2 (in flight beside step 2's update) ended: its answers are cached
            os.kill(os.getpid(), signal.SIGKILL)

    trainer.run(on_step=on_step)


def test_kill9_under_eta_1_resumes_with_the_in_flight_draws_answered_from_the_cache(
        tiny_tokenizer, tiny_tokenizer_dir, tmp_path):  # noqa: F811
    from actionopd_jax.checkpoint import Checkpointer
    from actionopd_jax.config.load import replace_keys
    from actionopd_jax.train.loop import Trainer

    teacher = teacher_backend(SCRIPT)
    with serve(teacher, judge_backend()) as server:
        code = f"from tests.test_collect_async_kill import child; child({str(tmp_path)!r}, {server.base_url!r}, " \
               f"{str(tiny_tokenizer_dir)!r})"
        proc = subprocess.run([sys.executable, "-c", code], env=cli_env(devices=8), capture_output=True, text=True,
                              timeout=110)
        assert proc.returncode == -signal.SIGKILL, (proc.stdout + proc.stderr)[-4000:]
        asked = {case_of(str(r.messages)) for r in teacher.requests}
        assert {f"async{i}" for i in range(12)} <= asked   # draws 0-2 were asked before the kill
        ckpt = Checkpointer(tmp_path / "run" / "checkpoints", read_only=True)
        assert ckpt.latest_step() == 1   # step 2's checkpoint was never written
        ckpt.close()

        before = len(teacher.requests)
        cfg = replace_keys(_cfg(tmp_path), **{"train.steps": 4, "checkpoint.every_steps": 1})
        source = _source(cfg, tmp_path, tiny_tokenizer, server, TASKS, tmp_path / "teacher.sqlite")
        trainer = Trainer(cfg, run_dir=cfg.run.dir, source=source, resume="latest")
        assert trainer.step == 1
        trained = []
        orig = source.collect

        def spy(step, policy):
            groups = orig(step, policy)
            trained.append(sorted({g.task_id for g in groups}))
            return groups

        source.collect = spy
        assert trainer.run() == 0 and trainer.step == 4
        trainer.close()
        assert not _alive()
    # the run goes on from draw 1, the oldest not trained on at step 1's checkpoint: every draw
    # is trained once, in order, and nothing answered before the kill is asked again
    assert trained == [sorted(f"t{4 * d + i}" for i in range(4)) for d in (1, 2, 3)]
    again = {case_of(str(r.messages)) for r in teacher.requests[before:]}
    assert not again & {f"async{i}" for i in range(12)}, sorted(again)
