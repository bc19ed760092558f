"""mesh.rollout_devices (issue 44): one host's devices split into a training part (the first
D - k) and the sampler's part (the last k), the weights moved each step by one jitted program
plus a block-for-block device copy (sampling/rollout.py). The test process has 8 CPU devices
(tests/conftest.py): the runs here train on devices 0-3 and sample on 4-7, against the same
run with the sampler on the training devices."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from actionopd_jax.config import ConfigError
from actionopd_jax.config.load import from_dict, replace_keys
from tests._chat_fixtures import tiny_tokenizer, tiny_tokenizer_dir  # noqa: F401 (fixtures)
from tests._collect_fixtures import (A, B, BAD, C, ListTaskStream, Script, ToyEnv, fixed_text_sample_fn,
                                     judge_backend, make_matcher, make_teacher, serve, teacher_backend, toy_task)

SCRIPT = Script(teacher={}, student={(f"split{i}", d): [A, B, C, BAD] for i in range(8) for d in range(4)})


def _cfg(tmp_path, name, **keys):
    c = {"kind": "actionopd", "num_candidates": 4, "teacher_samples": 3, "freq_bonus": 0.5,
         "max_response_tokens": 16, "max_prompt_tokens": 1024, "task_starts_per_step": 2, "concurrency": 4,
         "max_decisions": 2, "temperature": 1.0, "sampler": "static"}
    cfg = from_dict({"collect": c, "model": {"preset": "tiny"}, "train": {"steps": 2, "max_seq_len": 2048},
                     "mesh": {"fsdp": 4}, "checkpoint": {"every_steps": 0},
                     "run": {"seed": 3, "progress": False, "tensorboard": False, "dir": str(tmp_path / name)},
                     "teacher": {"kind": "openai", "provider": "vllm", "model": "teacher",
                                 "base_url": "http://127.0.0.1:9/v1", "max_tokens": 16},
                     "env": {"name": "bfcl", "domains": ["base"], "allow_eval_overlap": True}})
    return replace_keys(cfg, **keys) if keys else cfg


def _run(cfg, tokenizer, server, steps=2, scripted=True):
    """`steps` trainer steps over the collector (the async source at collect.max_staleness >= 1).
    `scripted`: the student's replies are the script's (the sampler still gets each step's
    weights), so the groups have rewards to learn from; else the sampler runs for real (its
    replies recorded). Returns (per-step metrics, per-step sampled token ids, source, trainer)."""
    from actionopd_jax.collect import ActionOPDGroupSource
    from actionopd_jax.collect.async_source import AsyncActionOPDGroupSource
    from actionopd_jax.sampling import Buckets
    from actionopd_jax.train.loop import Trainer
    from actionopd_jax.train.setup import build_mesh, model_config
    from actionopd_jax.train.sources import SourceContext

    ctx = SourceContext(model_config=model_config(cfg), run_dir=cfg.run.dir, tokenizer_path="", process_index=0,
                        process_count=1, mesh=build_mesh(cfg))
    kind = AsyncActionOPDGroupSource if cfg.collect.max_staleness else ActionOPDGroupSource
    source = kind(cfg, ctx, teacher=make_teacher(server, max_tokens=16), matcher=make_matcher(server),
                  stream=ListTaskStream([toy_task(f"t{i}", f"split{i}") for i in range(8)], per_step=2),
                  env_factory=lambda task: ToyEnv(), tokenizer=tokenizer,
                  buckets=Buckets(prompt_len=(1024,), prompts=(4,), samples=(4,), max_new=(16,), max_rows=16))
    if scripted:
        fixed = fixed_text_sample_fn(tokenizer, SCRIPT, tokenizer.convert_tokens_to_ids("<|im_end|>"))
        if cfg.collect.max_staleness:
            source.sampling.sample_fn = fixed
        else:
            source.collector.sample_fn = fixed
    trainer = Trainer(cfg, run_dir=cfg.run.dir, source=source)
    metrics, tokens = [], []
    for _ in range(steps):
        metrics.append(trainer.train_step())
        tokens.append(sorted([c.token_ids.tolist() for c in g.candidates] for g in source.last.groups))
    return metrics, tokens, source, trainer


def _placed_apart(source, trainer):
    devices = jax.devices()
    train, rollout = set(devices[:4]), set(devices[4:])
    state = jax.tree.leaves(trainer.state)
    assert state and all(set(x.sharding.device_set) <= train for x in state)
    weights = [x for x in jax.tree.leaves(source.sampler.model) if isinstance(x, jax.Array)]
    assert weights and all(set(x.sharding.device_set) == rollout for x in weights)
    assert set(source.sampler.mesh.devices.flat) == rollout and source.sampler.mesh.axis_names == ("tensor",)


def test_a_split_keeps_trainer_and_sampler_apart_and_trains_the_same(tiny_tokenizer, tmp_path):
    """Trainer state on devices 0-3 only, the sampler's weights (the updated ones, loaded at
    step 1) on 4-7 only, tensor-parallel; synchronous, the same updates as the same run without
    the split; asynchronous (eta=1, the static sampler), the same placement across its swaps."""
    with serve(teacher_backend(SCRIPT), judge_backend()) as server:
        shared, _, s0, t0 = _run(_cfg(tmp_path, "shared"), tiny_tokenizer, server)
        t0.close()
        split, _, source, trainer = _run(_cfg(tmp_path, "split", **{"mesh.rollout_devices": 4}), tiny_tokenizer, server)
        _placed_apart(source, trainer)
        trainer.close()
        eta1 = _cfg(tmp_path, "async", **{"mesh.rollout_devices": 4, "collect.max_staleness": 1})
        stale, _, source, trainer = _run(eta1, tiny_tokenizer, server)
        _placed_apart(source, trainer)
        trainer.close()
        source.close()
    assert all(m["updates"] > 0 for m in shared + stale)
    for a, b in zip(shared, split):
        for key in ("loss", "approx_kl", "ratio_mean", "grad_norm", "updates", "rows", "collect/groups_kept"):
            assert b[key] == a[key], key
    assert stale[1]["collect/async/max_staleness"] == 1 and stale[1]["collect/async/stale_dropped"] == 0


def test_the_engine_samples_the_same_tokens_on_its_own_devices(tiny_tokenizer, tmp_path):
    """The real sampler (the engine, collect.sampler auto on CPU): its weights and page pool on
    the sampler's devices, and the same tokens at every state as without the split; at eta=1
    its weights stay there across the swaps."""
    keys = {"collect.sampler": "auto", "train.steps": 1}
    with serve(teacher_backend(SCRIPT), judge_backend()) as server:
        _, shared, _, t0 = _run(_cfg(tmp_path, "shared", **keys), tiny_tokenizer, server, steps=1, scripted=False)
        _, split, source, trainer = _run(_cfg(tmp_path, "split", **keys, **{"mesh.rollout_devices": 4}),
                                         tiny_tokenizer, server, steps=1, scripted=False)
        assert source.sampler_kind == "engine"
        _placed_apart(source, trainer)
        pool = [x for x in jax.tree.leaves(source.sampler.pool) if isinstance(x, jax.Array)]
        assert pool and all(set(x.sharding.device_set) <= set(jax.devices()[4:]) for x in pool)
        t0.close()
        trainer.close()
        # asynchronous (eta=1): the engine takes each step's weights while rows run, on its own devices
        eta1 = _cfg(tmp_path, "async", **{**keys, "mesh.rollout_devices": 4, "collect.max_staleness": 1,
                                           "train.steps": 2})
        _, _, source, trainer = _run(eta1, tiny_tokenizer, server, steps=2, scripted=False)
        _placed_apart(source, trainer)
        trainer.close()
        source.close()
    assert split == shared and split[0]


def test_bad_splits_are_refused_naming_the_fix(tmp_path):
    from actionopd_jax.train.preflight import check_run, mesh_sizes, placement
    from actionopd_jax.train.setup import build_mesh, model_config, rollout_devices

    with pytest.raises(ConfigError, match="mesh.rollout_devices must be >= 0"):
        _cfg(tmp_path, "neg", **{"mesh.rollout_devices": -1})
    cfg = _cfg(tmp_path, "bad")

    def sizes(**keys):
        return mesh_sizes(replace_keys(cfg, **keys), 8)

    assert sizes(**{"mesh.rollout_devices": 4}) == {"data": 1, "fsdp": 4, "tensor": 1}
    assert sizes(**{"mesh.rollout_devices": 2, "mesh.fsdp": -1}) == {"data": 1, "fsdp": 6, "tensor": 1}
    with pytest.raises(ConfigError, match=r"leaves no device for training on 8 device\(s\); set "
                                          r"mesh.rollout_devices to at most 7"):
        sizes(**{"mesh.rollout_devices": 8})
    with pytest.raises(ConfigError, match=r"leaves 5 for training, not a multiple of 3.*set mesh.rollout_devices "
                                          r"to one of \[1, 2, 4\]"):
        sizes(**{"mesh.rollout_devices": 3, "mesh.fsdp": -1})
    with pytest.raises(ConfigError, match=r"uses 4 devices but mesh.rollout_devices=2 leaves 6 of 8 for training: "
                                          r"make mesh.data x mesh.fsdp x mesh.tensor = 6"):
        sizes(**{"mesh.rollout_devices": 2})
    # --check of a fixed mesh plans for its devices plus the sampler's (here 2 + 2 of this host's 8)
    small = replace_keys(cfg, **{"mesh.fsdp": 2, "mesh.rollout_devices": 2})
    assert placement(small).devices == 4 and mesh_sizes(small, 4) == {"data": 1, "fsdp": 2, "tensor": 1}
    with pytest.raises(ConfigError, match="cannot split"):
        sizes(**{"mesh.rollout_devices": 2, "mesh.fsdp": -1, "mesh.tensor": 4})
    split = replace_keys(cfg, **{"mesh.rollout_devices": 4})
    with pytest.raises(ConfigError, match=r"runs on one process only \(this run has 2\); set mesh.rollout_devices=0"):
        check_run(split, model_config(split), {"fsdp": 4}, device_count=8, processes=2, platform="cpu")
    from actionopd_jax.launch.common import LaunchError, check_config_for_machine

    (tmp_path / "run.yaml").write_text("train:\n  steps: 1\n")
    with pytest.raises(LaunchError, match=r"runs on one process only \(this run has 2\)"):
        check_config_for_machine(tmp_path / "run.yaml", ["mesh.rollout_devices=4"], machine="a 2-host slice",
                                 platform="tpu", chips=16, hosts=2)
    check_config_for_machine(tmp_path / "run.yaml", ["mesh.rollout_devices=4"], machine="one host", platform="gpu",
                             chips=8, hosts=1)
    # on this host: the trainer's mesh on the first 4 devices, the sampler's the last 4
    assert set(build_mesh(split).devices.flat) == set(jax.devices()[:4])
    assert rollout_devices(split) == tuple(jax.devices()[4:]) and rollout_devices(cfg) == ()


def test_the_reshard_is_one_program_and_never_goes_through_host_memory(monkeypatch):
    """The copy reaches the rollout devices from the training devices by device-to-device
    copies only: reading any array's value on the host (`ArrayImpl._value`, what a
    non-matching `device_put` falls back to) fails the test. The values are the training
    ones (cast to bf16 where asked); the program is compiled once and reused for updated
    weights; the training parameters stay alive (the update donates them afterwards)."""
    import jax._src.array as array_impl
    from flax import nnx

    from actionopd_jax.model import Qwen3
    from actionopd_jax.model.sharding import make_mesh, param_shardings
    from actionopd_jax.sampling import rollout
    from actionopd_jax.testing.tiny_checkpoint import tiny_config
    from actionopd_jax.train.step import split_params

    graphdef, params = split_params(Qwen3(tiny_config(), rngs=nnx.Rngs(params=jax.random.key(5))))
    mesh = make_mesh({"fsdp": 4}, devices=jax.devices()[:4])
    placed = jax.device_put(params, nnx.to_pure_dict(param_shardings(nnx.state(nnx.merge(graphdef, params)), mesh)))
    want = {dt: jax.tree.map(lambda x: np.asarray(x.astype(dt or x.dtype)), placed) for dt in (None, jnp.bfloat16)}

    def no_host(self):
        raise AssertionError("the rollout copy went through host memory")

    # 4 training devices -> 4 rollout devices (one staged copy of the blocks), -> 2 (two copies)
    for target, dt in ((tuple(jax.devices()[4:]), None), (tuple(jax.devices()[6:]), None),
                       (tuple(jax.devices()[6:]), jnp.bfloat16), (tuple(jax.devices()[4:]), jnp.bfloat16)):
        with monkeypatch.context() as m:
            m.setattr(array_impl.ArrayImpl, "_value", property(no_host))
            copy, rmesh = rollout.rollout_params(placed, graphdef, devices=target, dtype=dt)
            jax.block_until_ready(copy)
        assert rmesh.axis_names == ("tensor",) and tuple(rmesh.devices.flat) == target
        leaves = jax.tree.leaves(copy)
        assert all(set(x.sharding.device_set) == set(target) for x in leaves)
        assert any("tensor" in jax.tree.leaves(tuple(x.sharding.spec)) for x in leaves)
        jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), b), copy, want[dt])
    # a training mesh whose devices are not in id order (jax.make_mesh orders by topology on
    # accelerators): staged in that order, which jit requires
    shuffled = jax.sharding.Mesh(np.array([jax.devices()[i] for i in (2, 0, 3, 1)]), ("fsdp",))
    moved = jax.device_put(placed, jax.tree.map(lambda x: jax.sharding.NamedSharding(shuffled, x.sharding.spec),
                                                placed))
    copy, _ = rollout.rollout_params(moved, graphdef, devices=tuple(jax.devices()[6:]), dtype=jnp.bfloat16)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), b), copy, want[jnp.bfloat16])
    before = len(rollout._RESHARD)
    rollout.rollout_params(jax.tree.map(lambda x: x + 1, placed), graphdef, devices=target, dtype=jnp.bfloat16)
    assert len(rollout._RESHARD) == before and not any(x.is_deleted() for x in jax.tree.leaves(placed))
    with pytest.raises(ValueError, match="overlap the training devices"):
        rollout.rollout_params(placed, graphdef, devices=tuple(jax.devices()[3:5]))


def test_check_prints_the_split_and_each_halfs_memory(capsys):
    from actionopd_jax.commands import train as train_cli

    assert train_cli.main(["--check", "mesh.rollout_devices=4", "mesh.device_memory_gb=16"]) == 0
    out = capsys.readouterr().out
    assert "= 4 device(s) of cpu for training; the sampler has 4 device(s) of its own (mesh.rollout_devices)" in out
    assert "memory per training device" in out and "collection per rollout device" in out
    assert re.search(r"  reshard staging +[\d.]+ GiB", out)
    assert re.search(r"training devices [\d.]+ GiB, sampler's devices [\d.]+ GiB -> fits", out), out
    assert train_cli.main(["--check", "mesh.rollout_devices=3"]) == 2
    assert "set mesh.rollout_devices to one of [1, 2, 4]" in capsys.readouterr().err
