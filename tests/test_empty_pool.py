"""A pool the run draws from with no task to train on is a config error that names the pool,
the audit and the screen (issue 46 item 10), not a traceback from the task stream."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

AWM = Path(__file__).parent / "data" / "awm_mini"


def test_a_pool_with_no_admitted_tasks_is_a_config_error_not_a_traceback(tmp_path, capsys):
    """Issue 46 item 10: `train --check` on a pool whose manifest admits none of its tasks ended
    in `ValueError: pool 'awm' has no admitted tasks but is drawn 59 a step` (a traceback). It is
    a config error now (exit 2) naming the pool, the stage that dropped the last task, the audit
    and the screen; a pool whose admitted tasks are all held out says so too."""
    from actionopd_jax.commands import train as train_cli
    from actionopd_jax.config import ConfigError
    from actionopd_jax.config.load import load_config
    from actionopd_jax.envs.mixture import mixture_stream_from

    manifest = tmp_path / "m.json"   # what `envs audit` writes when every AWM server fails to start
    manifest.write_text(json.dumps({"pool": "awm", "dir": str(AWM), "admitted": [], "dropped": {
        "library_loans_1/0": "server does not start: unable to open database file"}, "funnel": [
        {"stage": "tasks in the directory", "kept": 3, "reasons": {}, "note": ""},
        {"stage": "server starts and lists tools", "kept": 0, "reasons": {"server does not start": 3}, "note": ""}]}))
    recipe = tmp_path / "awm.yaml"
    recipe.write_text(f"experiment: {{enabled: false}}\ncollect: {{kind: actionopd}}\nmatcher: {{kind: rules}}\n"
                      f"teacher: {{kind: openai, provider: vllm, base_url: 'http://127.0.0.1:9/v1', model: t}}\n"
                      f"env: {{name: awm, awm_dir: '{AWM}', manifest: '{manifest}', mixture: ['awm:59']}}\n")
    assert train_cli.main(["--config", str(recipe), "--check"]) == 2
    captured = capsys.readouterr()
    err = captured.err
    assert "Traceback" not in err + captured.out and "config error: pool 'awm' has no tasks to train on" in err, err
    assert "dropped at 'server starts and lists tools'" in err
    assert f"`actionopd envs audit --env awm --dir {AWM} --manifest {manifest}`" in err
    assert f"`actionopd envs screen --env awm --manifest {manifest}" in err
    # every admitted task held out for evaluation: the same error, saying so
    manifest.write_text(json.dumps({"pool": "awm", "admitted": ["recipe_box_2/1"], "heldout": ["recipe_box_2/1"]}))
    with pytest.raises(ConfigError, match=r"pool 'awm' has no tasks to train on.*all 1 of its admitted tasks are "
                                          r"held out for evaluation"):
        mixture_stream_from(load_config(recipe).env, per_step=4, seed=0)
