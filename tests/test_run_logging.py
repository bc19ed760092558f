"""The run's log handler follows sys.stderr: a run started in-process (a notebook, a test)
may swap stderr and close the old stream, and records logged after that (the environment
pools' exit handlers log) must reach the current stream, not fail on the closed one."""

import io
import logging
import sys

from actionopd_jax.train.reporting import setup_logging


def test_records_after_stderr_was_swapped_and_closed_reach_the_new_stream(tmp_path, monkeypatch):
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    first, second = io.StringIO(), io.StringIO()
    try:
        monkeypatch.setattr(sys, "stderr", first)
        setup_logging(tmp_path / "run", primary=True)
        logging.getLogger("actionopd_jax.test").info("while the run holds stderr")
        first.close()                                   # the caller's stream goes away
        monkeypatch.setattr(sys, "stderr", second)
        logging.getLogger("actionopd_jax.test").info("at exit")
        assert second.getvalue().rstrip().endswith("INFO actionopd_jax.test: at exit")
        log = (tmp_path / "run" / "train.log").read_text()
        assert "while the run holds stderr" in log and "at exit" in log
    finally:
        for h in list(root.handlers):
            if h not in saved[0]:
                root.removeHandler(h)
                h.close()
        root.setLevel(saved[1])
