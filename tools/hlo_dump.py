"""Dump the compiled CPU programs whose HLO the restructuring (issue 22) must not change.

Usage (from a checkout's root):  PYTHONPATH=$PWD python tools/hlo_dump.py OUT_DIR
To compare with an older commit: `git worktree add /tmp/old COMMIT`, run the same command in
/tmp/old (with this file copied there if it is older than this script), then `diff -r A B`.

Programs (CPU, one device):
- train_update / train_old_logp: TrainStep at bench-tiny shapes with 2 layers, fused LM head
  (vocab_chunk 8192), float32, 8 rows of 64 + 64 tokens in 2 microbatches of 4 rows;
- sampler_<backend>_<head>_<kind>: the Sampler's prefill and decode for the tiny model (2 layers),
  heads "checked" and "float32", on the CPU backend and on the accelerator path traced for CPU.

For each: `<name>.stablehlo.txt` (lowered, debug_info=False) and `<name>.hlo.txt` (compiled,
metadata stripped), plus counts.json with the instruction count of each compiled module.
Works on the code before the change (model dtype etc. in Qwen3Config) and after it
(actionopd_jax.model.runtime.RuntimeOptions).
"""

from __future__ import annotations

import functools
import json
import os
import re
import sys
from pathlib import Path

import numpy as np

os.environ.setdefault("JAX_PLATFORMS", "cpu")
import jax
import jax.numpy as jnp
from flax import nnx

try:  # after the split: execution settings in their own record
    from actionopd_jax.model.runtime import RuntimeOptions
except ImportError:
    RuntimeOptions = None

_META = re.compile(r",? ?metadata=\{[^}]*\}")
_LOC = re.compile(r"\s*loc\([^()]*(\([^()]*\)[^()]*)*\)")


_INDEX_SECTIONS = ("FileNames", "FunctionNames", "FileLocations", "StackFrames")


def _strip(text: str) -> str:
    text = _META.sub("", text)
    text = _LOC.sub("", text)
    lines, skipping = [], False
    for ln in text.splitlines():
        if ln in _INDEX_SECTIONS:  # the compiled module's source-location tables
            skipping = True
            continue
        if skipping and re.match(r"\s*\d+ ", ln):
            continue
        skipping = False
        if not ln.startswith("#loc"):
            lines.append(ln)
    return "\n".join(lines) + "\n"


def _count(hlo: str) -> int:
    """Instructions of a compiled HLO module: lines of the form `name = type op(...)`."""
    return sum(1 for ln in hlo.splitlines() if re.match(r"\s*(ROOT\s+)?[%\w.\-]+\s*=\s*\S", ln)
               and not ln.lstrip().startswith("HloModule"))


class Dumper:
    def __init__(self, out: Path):
        self.out = out
        self.counts: dict[str, int] = {}

    def save(self, name: str, lowered, compiled):
        (self.out / f"{name}.stablehlo.txt").write_text(_strip(lowered.as_text(debug_info=False)))
        hlo = _strip(compiled.as_text())
        (self.out / f"{name}.hlo.txt").write_text(hlo)
        self.counts[name] = _count(hlo)
        print(f"{name}: {self.counts[name]} instructions", flush=True)


def _build_model(cfg, rt, seed: int):
    from actionopd_jax.model import Qwen3

    if rt is None:
        return Qwen3(cfg, rngs=nnx.Rngs(params=seed))
    return Qwen3(cfg, runtime=rt, rngs=nnx.Rngs(params=seed))


def _config(preset: str, **shape):
    from actionopd_jax.model import PRESETS

    cfg = PRESETS[preset].replace(**shape)
    return cfg, (RuntimeOptions() if RuntimeOptions is not None else None)


def dump_train(d: Dumper):
    from actionopd_jax.train.batching import Row, pack_minibatch
    from actionopd_jax.train.step import StepSettings, TrainStep, make_optimizer, split_params

    cfg, rt = _config("bench-tiny", num_hidden_layers=2)
    model = _build_model(cfg, rt, 0)
    graphdef, params = split_params(model)
    rng = np.random.default_rng(0)
    prompt_len, resp_len, n_rows, micro = 64, 64, 8, 4
    rows = [Row(rng.integers(0, 1000, prompt_len - i).astype(np.int32),
                rng.integers(0, 1000, resp_len - 2 * i).astype(np.int32), float(i % 3 - 1))
            for i in range(n_rows)]
    mb = pack_minibatch(rows, list(range(n_rows)), microbatches=n_rows // micro, microbatch_rows=micro,
                        seq_len=prompt_len + resp_len, resp_len=resp_len)
    tx = make_optimizer(lr=1e-5, weight_decay=0.0, grad_clip=0.0)
    mesh = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:1])
    step = TrainStep(graphdef, params, mesh, tx, StepSettings(temperature=1.0, clip_eps=0.2,
                                                              logits_chunk=0, vocab_chunk=8192))
    state = step.abstract_state()
    batch = step.put_batch(mb.arrays)
    batch_old = {k: v for k, v in batch.items()}
    with jax.set_mesh(mesh):
        low = step._old_logp.lower(state["params"], batch_old)
        d.save("train_old_logp", low, low.compile())
        batch["old_logp"] = jax.ShapeDtypeStruct(batch["resp_tokens"].shape, jnp.float32,
                                                 sharding=step.row_sharding) if "resp_tokens" in batch else None
        if batch["old_logp"] is None:
            out = jax.eval_shape(step._old_logp_impl, state["params"], batch_old)[0]
            batch["old_logp"] = jax.ShapeDtypeStruct(out.shape, out.dtype, sharding=step.row_sharding)
        low = step._update.lower(state, batch)
        d.save("train_update", low, low.compile())


def dump_sampler(d: Dumper):
    from actionopd_jax.sampling import sampler as sampler_lib
    from actionopd_jax.sampling.sampler import Sampler
    from actionopd_jax.testing.tiny_checkpoint import TINY_DEFAULTS

    from actionopd_jax.model import Qwen3Config

    cfg = Qwen3Config(**TINY_DEFAULTS)
    rt = RuntimeOptions() if RuntimeOptions is not None else None
    model = _build_model(cfg, rt, 3)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, cfg.vocab_size, n).astype(np.int32) for n in (5, 9)]

    for backend in ("cpu", "accelerator"):
        for head in ("checked", "float32"):
            s = Sampler(model, eos_ids=[], lm_head=head, backend=backend, token_budget=None)
            seen: list[str] = []

            def compiled(kind, fn, args, static, donate, label, _s=s, _seen=seen, _b=backend, _h=head):
                key = (kind, sampler_lib._signature(args), tuple(sorted(static.items())))
                program = _s._programs.get(key)
                if program is None:
                    jitted = jax.jit(functools.partial(fn, **static), static_argnums=(0,), donate_argnums=donate)
                    low = jitted.lower(*args)
                    program = low.compile(compiler_options=dict(sampler_lib._compiler_options(kind, _s.backend)))
                    name = f"sampler_{_b}_{_h}_{kind}{'' if kind not in _seen else len(_seen)}"
                    _seen.append(kind)
                    d.save(name, low, program)
                    _s._programs[key] = program
                return program

            s._compiled = compiled
            s.sample(prompts, n=2, max_new_tokens=6, temperature=1.0, key=jax.random.key(0))


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    out = Path(argv[0])
    out.mkdir(parents=True, exist_ok=True)
    d = Dumper(out)
    dump_train(d)
    dump_sampler(d)
    (out / "counts.json").write_text(json.dumps(d.counts, indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
