"""Load and save Hugging Face Qwen3 safetensors checkpoints (no pickle anywhere).

Loading builds the model abstractly (`nnx.eval_shape`, no memory), then creates every
parameter directly with its target sharding via `jax.make_array_from_callback`: each device
shard is read from the file(s) as just that slice, so no host or device ever holds a full copy
of a large model.
"""

from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy for safetensors' "np" framework)
import numpy as np
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from actionopd_jax.model.config import Qwen3Config
from actionopd_jax.model.hf_names import TensorSpec, read_our_slice, tensor_specs, to_hf
from actionopd_jax.model.qwen3 import Qwen3
from actionopd_jax.model.runtime import RuntimeOptions, split_model_dict
from actionopd_jax.model.sharding import LOGICAL_AXIS_RULES, param_shardings

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
# Present in some HF exports but not parameters (recomputed from the config).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _tensor_locations(path: Path) -> dict[str, Path]:
    """Map tensor name -> safetensors file, from the sharded index or the file(s) themselves."""
    index = path / INDEX_NAME
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ValueError(f"{index} is not a valid safetensors index (needs a 'weight_map'): {e}") from e
        files = {name: path / fname for name, fname in weight_map.items()}
        for f in sorted(set(files.values())):
            if not f.is_file():
                raise FileNotFoundError(f"{index} lists shard {f.name}, which does not exist in {path}")
        return files
    candidates = [path / SINGLE_NAME] if (path / SINGLE_NAME).is_file() else sorted(path.glob("*.safetensors"))
    if not candidates:
        raise FileNotFoundError(
            f"no weights in {path}: expected {SINGLE_NAME} or {INDEX_NAME} (+ shards)")
    files: dict[str, Path] = {}
    for f in candidates:
        with safe_open(f, "np") as h:
            for name in h.keys():
                files[name] = f
    return files


def _check_names_and_shapes(specs: list[TensorSpec], files: dict[str, Path], handles, cfg) -> None:
    expected = {s.hf_name for s in specs}
    present = {n for n in files if not n.endswith(_IGNORED_SUFFIXES)}
    if cfg.tie_word_embeddings:
        present.discard("lm_head.weight")  # a tied export may still carry the duplicate head
    missing = sorted(expected - present)
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} tensor(s) the config needs, e.g. "
                         f"{missing[:5]} (files: {sorted({f.name for f in files.values()})})")
    unexpected = sorted(present - expected)
    if unexpected:
        hint = (" (lm_head.weight present but tie_word_embeddings=true?)" if "lm_head.weight" in unexpected
                else "")
        raise ValueError(f"checkpoint has {len(unexpected)} unexpected tensor(s), e.g. {unexpected[:5]} "
                         f"in {files[unexpected[0]].name}: not a dense Qwen3 checkpoint for this config{hint}")
    for s in specs:
        shape = tuple(handles[files[s.hf_name]].get_slice(s.hf_name).get_shape())
        if shape != s.hf_shape:
            raise ValueError(f"shape mismatch for tensor {s.hf_name} in {files[s.hf_name].name}: "
                             f"file has {shape}, config.json implies {s.hf_shape}")


def _head_differs(files: dict[str, Path], rows: int = 8192) -> bool:
    """Whether lm_head.weight differs from model.embed_tokens.weight (shape or any value),
    compared a block of rows at a time so a large vocabulary is never held twice."""
    names = ("lm_head.weight", "model.embed_tokens.weight")
    with contextlib.ExitStack() as stack:
        head, embed = (stack.enter_context(safe_open(files[n], "np")).get_slice(n) for n in names)
        shape = tuple(head.get_shape())
        if shape != tuple(embed.get_shape()) or len(shape) != 2:
            return True
        blocks = (slice(i, min(i + rows, shape[0])) for i in range(0, shape[0], rows))  # no slicing past the end
        return any(not np.array_equal(head[b], embed[b]) for b in blocks)


def _abstract_model(cfg: Qwen3Config, runtime: RuntimeOptions | None = None):
    # The seed is irrelevant: eval_shape creates shapes only, no values are drawn.
    return nnx.eval_shape(lambda: Qwen3(cfg, runtime=runtime, rngs=nnx.Rngs(0)))


def load_hf(path, *, cfg_overrides: dict | None = None, mesh: jax.sharding.Mesh | None = None,
            rules=None, runtime: RuntimeOptions | None = None) -> tuple[Qwen3Config, Qwen3]:
    """Read `config.json` + safetensors from the local directory `path`.

    With a mesh, each parameter is created sharded per `rules` (default LOGICAL_AXIS_RULES);
    without, on the first local device.  `cfg_overrides` (e.g. param_dtype, dtype, remat)
    replace config fields, its execution keys (runtime.FIELDS) those of `runtime`; weights are
    cast to the resulting param_dtype. The compute dtype, unless given, is the parameters'.
    """
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint directory {path} does not exist")
    shape_over, run_over = split_model_dict(dict(cfg_overrides or {}))
    cfg = Qwen3Config.from_hf_json(path, **shape_over)
    if runtime is None:  # compute in the file's dtype (not an overridden param_dtype), as before the split
        file_dtype = Qwen3Config.from_hf_json(path).param_dtype if "param_dtype" in shape_over else cfg.param_dtype
        runtime = RuntimeOptions(**{"dtype": file_dtype, **run_over})
    elif run_over:
        runtime = runtime.replace(**run_over)
    files = _tensor_locations(path)
    if cfg.tie_word_embeddings and "lm_head.weight" in files and _head_differs(files):
        # transformers 5.x leaves the weights untied when the file holds a head of its own that
        # differs from the embedding (it only warns): load that head, as it does
        cfg = cfg.replace(tie_word_embeddings=False)
    specs = tensor_specs(cfg)
    rules = LOGICAL_AXIS_RULES if rules is None else rules

    abstract = _abstract_model(cfg, runtime)
    graphdef, abs_state = nnx.split(abstract)
    if mesh is not None:
        shardings = param_shardings(abs_state, mesh, rules)
    else:
        single = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        shardings = jax.tree.map(lambda v: v.replace(single), abs_state,
                                 is_leaf=lambda x: isinstance(x, nnx.Variable))
    by_path: dict[tuple[str, ...], list[TensorSpec]] = {}
    for s in specs:
        by_path.setdefault(s.path, []).append(s)

    with contextlib.ExitStack() as stack:
        handles = {f: stack.enter_context(safe_open(f, "np")) for f in sorted(set(files.values()))}
        _check_names_and_shapes(specs, files, handles, cfg)

        def build(key_path, var, sharding_var):
            p = tuple(str(getattr(k, "key", k)) for k in key_path)
            group = by_path.get(p)
            if group is None:
                raise RuntimeError(f"model parameter {'/'.join(p)} has no HF tensor mapping")
            dtype = jnp.dtype(var.dtype)

            def read(index):
                if group[0].layer is None:
                    s = group[0]
                    return read_our_slice(handles[files[s.hf_name]].get_slice(s.hf_name), s.kind,
                                          s.our_shape, index).astype(dtype)
                layer_range = range(*index[0].indices(len(group)))
                parts = [read_our_slice(handles[files[group[l].hf_name]].get_slice(group[l].hf_name),
                                        group[l].kind, group[l].our_shape, index[1:]) for l in layer_range]
                return np.stack(parts).astype(dtype)

            arr = jax.make_array_from_callback(tuple(var.shape), sharding_var.get_value(), read)
            return var.replace(arr)

        state = jax.tree_util.tree_map_with_path(
            lambda kp, v, sh: build(kp, v, sh), abs_state, shardings,
            is_leaf=lambda x: isinstance(x, nnx.Variable))
    return cfg, nnx.merge(graphdef, state)


def _host_array(x: jax.Array) -> np.ndarray:
    if not x.is_fully_addressable:  # multi-host: every process joins the gather
        from jax.experimental import multihost_utils
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(jax.device_get(x))


def save_hf(model: Qwen3, cfg: Qwen3Config, path, *, max_shard_bytes: int = 4 * 1024**3) -> None:
    """Write config.json + model.safetensors (or model-0000i-of-0000N shards + index) to `path`.

    Tensors keep the model's parameter dtype; config.json records it.  In a multi-process run
    every process must call this (parameters are gathered collectively); process 0 writes.
    """
    path = Path(path)
    state = nnx.state(model)
    flat = {tuple(str(getattr(k, "key", k)) for k in kp): v
            for kp, v in jax.tree_util.tree_flatten_with_path(
                state, is_leaf=lambda x: isinstance(x, nnx.Variable))[0]}
    param_dtype = str(jnp.dtype(flat[("embed_tokens",)].dtype))
    out_cfg = cfg.replace(param_dtype=param_dtype) if param_dtype in ("float32", "bfloat16") else cfg
    specs = tensor_specs(cfg)
    missing = [s.path for s in specs if s.path not in flat]
    if missing:
        raise ValueError(f"model has no parameter(s) {missing[:3]} required by the config")

    # Plan shards from shapes so file names (…-of-N) are known before any gather.
    itemsize = jnp.dtype(param_dtype).itemsize
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for s in specs:
        nbytes = math.prod(s.hf_shape) * itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(s)
        size += nbytes
    n = len(shards)
    names = [SINGLE_NAME] if n == 1 else [f"model-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)]

    writer = jax.process_index() == 0
    if writer:
        path.mkdir(parents=True, exist_ok=True)
    gathered: dict[tuple[str, ...], np.ndarray] = {}
    weight_map: dict[str, str] = {}
    total = 0
    for fname, group in zip(names, shards):
        tensors: dict[str, np.ndarray] = {}
        for s in group:
            if s.path not in gathered:
                gathered.clear()  # one stacked parameter on the host at a time
                gathered[s.path] = _host_array(flat[s.path].get_value())
            ours = gathered[s.path] if s.layer is None else gathered[s.path][s.layer]
            tensors[s.hf_name] = to_hf(ours, s.kind)
            weight_map[s.hf_name] = fname
            total += tensors[s.hf_name].nbytes
        if writer:
            save_file(tensors, str(path / fname), metadata={"format": "pt"})
    if writer:
        if n > 1:
            (path / INDEX_NAME).write_text(json.dumps(
                {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
        elif (path / INDEX_NAME).exists():
            (path / INDEX_NAME).unlink()  # a stale index would shadow the single file
        (path / "config.json").write_text(json.dumps(out_cfg.to_hf_dict(), indent=2))


def checkpoint_summary(path) -> dict[str, Any]:
    """Names, shapes and dtypes of every tensor in a local checkpoint (for `--check` style tools)."""
    files = _tensor_locations(Path(path))
    out = {}
    for f in sorted(set(files.values())):
        with safe_open(f, "np") as h:
            for name in h.keys():
                sl = h.get_slice(name)
                out[name] = {"shape": tuple(sl.get_shape()), "dtype": sl.get_dtype(), "file": f.name}
    return out
