"""`Sampler`: the host-side API over the compiled prefill/decode programs.

Callers pass token ids (never strings) and explicit PRNG keys. A call is split into chunks
that fit the largest batch buckets; each chunk is left-padded to shape buckets and run as
one prefill plus one decode loop. Compiled programs are cached by shape (and by the
parameters' shapes/shardings), and counted, so tests and benchmarks can see how many
programs a workload needs.

Key derivation (so results do not depend on how prompts were batched): with one key for the
call, prompt i uses fold_in(key, i); with one key per prompt, that key. Sample j of a prompt
uses fold_in(prompt_key, j), and step t of that sample fold_in(sample_key, t).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
import weakref
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import actionopd_jax.sampling.budget as budget_lib
import actionopd_jax.sampling.checked_head as checked_head_lib
import actionopd_jax.sampling.cpu_backend as cpu_backend
from actionopd_jax.sampling.policy_specs import check_policy, leaf_specs, policy_record
import actionopd_jax.sampling.decode as decode_lib
from actionopd_jax.sampling.buckets import Buckets
from actionopd_jax.sampling.token_choice import DEFAULT_CAP
from actionopd_jax.jax_compat import set_mesh


@dataclasses.dataclass
class Generation:
    """One sampled sequence. `token_ids` includes the end token when finish_reason == "stop"."""

    token_ids: np.ndarray     # int32[L]
    logprobs: np.ndarray      # float32[L], full softmax at the sampling temperature (T=1 if greedy)
    finish_reason: str        # "stop" (end token) | "length" (max_new_tokens)
    versions: np.ndarray | None = None  # int32[L] policy version per token (engine/versions.py); else None


@dataclasses.dataclass
class SampleResult:
    generations: list[list[Generation]]   # [prompt][sample]
    prefill_s: float = 0.0                # wall time to first token (all chunks), compile included
    decode_s: float = 0.0
    compiled_programs: int = 0            # programs compiled during this call
    decode_steps: int = 0                 # tokens per row actually generated (max over chunks)
    head_fallback_steps: int = 0          # "checked" head: decode steps that needed the float32 head
    # rows that finish early keep their slots until the slowest row of their chunk ends:
    # tokens generated / (real rows x steps their chunk ran), summed over chunks; the decode
    # time continuous batching could reclaim is at most 1 - generated_tokens / row_steps
    generated_tokens: int = 0
    row_steps: int = 0

    @property
    def slot_utilisation(self) -> float:
        return self.generated_tokens / self.row_steps if self.row_steps else 1.0


@dataclasses.dataclass
class CompileStats:
    programs: int = 0
    seconds: float = 0.0
    # (kind, prompt rows, prompt length, samples per prompt, max_new, compile seconds)
    shapes: list[tuple] = dataclasses.field(default_factory=list)


def _per_prompt(value, n_prompts: int, name: str) -> list:
    if isinstance(value, (list, tuple, np.ndarray)):
        if len(value) != n_prompts:
            raise ValueError(f"{name} has {len(value)} entries for {n_prompts} prompts")
        return list(value)
    return [value] * n_prompts


def _as_typed_key(key) -> jax.Array:
    key = jnp.asarray(key) if not isinstance(key, jax.Array) else key
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        return key
    if key.dtype == jnp.uint32 and key.shape[-1:] == (2,):
        return jax.random.wrap_key_data(key)
    raise TypeError(f"key must be a jax PRNG key (jax.random.key(seed)), got dtype {key.dtype} shape {key.shape}")


def _signature(tree) -> tuple:
    leaves, treedef = jax.tree.flatten(tree)
    return (treedef, tuple((x.shape, x.dtype, getattr(x, "sharding", None)) for x in leaves))


def _compiler_options(kind: str, backend: str) -> tuple[tuple[str, Any], ...]:
    """XLA options for the sampler's programs: the CPU backend's (cpu_backend.compiler_options);
    none elsewhere."""
    return cpu_backend.compiler_options(kind) if backend == "cpu" else ()


_build_checked_head = jax.jit(checked_head_lib.checked_head)


@jax.jit
def _row_keys(prompt_keys, row_prompt, sample_index):
    """Key of sample j of prompt p: fold_in(prompt key, j), whatever the batch layout."""
    return jax.vmap(jax.random.fold_in)(prompt_keys[row_prompt], sample_index)


class Sampler:
    """Generate from a Qwen3 model.

    model: a `Qwen3` (its current parameters are read at every call, so a trainer can keep
    updating the same module); eos_ids: token ids that end a sequence; cap: candidates kept
    per step for top-k/top-p (top_k above it takes the slower exact path); mesh: when the
    parameters are sharded, the mesh to trace under (activations follow the model's rules);
    backend: "auto" (default) follows the target: the accelerator path (decode.py: layers
    under `lax.scan`, stacked KV cache sharded by KV head and prompt rows, one attention
    phase) when the mesh's devices (or, without a mesh, the default backend) are not CPUs,
    else the CPU backend (cpu_backend.py: unrolled layers, fused output-major weights, split
    cache blocks, the "checked" head); "accelerator" / "cpu" force one.
    lm_head: how decode steps evaluate the LM head (decode.token_chooser). On accelerators
    the model's own head (float32 accumulation over its parameter dtype) for "checked" and
    "float32". "bfloat16": the head rounded to bfloat16 (an explicit opt-in: the samples and
    logprobs are then those of the rounded head). On the CPU backend with a float32 head,
    "checked" (default) is a bfloat16 head whose best candidates are recomputed in float32
    and checked against a rigorous error bound, falling back to the float32 head for any row
    the check cannot settle: the float32 model's tokens, logprobs with an approximate
    normaliser (~2e-4 from float32 on bench-tiny; checked_head.py), decoding 1.3-1.5x faster
    on bench-tiny; "float32" runs the float32 head at every step (exact normalisers).
    token_budget: how many states one device call (prefill + decode) takes, in cache-token
    equivalents (budget.py: PREFILL_FACTOR x padded prompt tokens + generated-cache slots,
    after bucket padding). "auto" (default): from the memory the devices can still allocate
    at each call (memory_stats bytes_limit - bytes_in_use, x budget.SAFETY, / bytes per
    cached token); none where the platform reports no limit (CPU: chunking unchanged). An
    int: that budget; None: no budget (chunks by the buckets' prompts and max_rows only).
    """

    def __init__(self, model, cfg=None, *, eos_ids: Sequence[int], buckets: Buckets | None = None,
                 cap: int = DEFAULT_CAP, mesh: jax.sharding.Mesh | None = None,
                 lm_head: str = "checked", backend: str = "auto", token_budget: int | str | None = "auto",
                 reserve_bytes: float = 0.0):
        self.model = model
        self.cfg = cfg if cfg is not None else model.cfg
        self.eos_ids = np.asarray(sorted(set(int(i) for i in eos_ids)) or [-1], np.int32)
        self.buckets = buckets or Buckets()
        self.cap = int(cap)
        if lm_head not in decode_lib.HEAD_MODES:
            raise ValueError(f"lm_head must be one of {decode_lib.HEAD_MODES}, got {lm_head!r}")
        self.lm_head = lm_head
        self.mesh = mesh
        platform = mesh.devices.flat[0].platform if mesh is not None else jax.default_backend()
        self.backend = decode_lib.resolve_backend(backend, platform)
        if not (token_budget is None or token_budget == "auto" or (isinstance(token_budget, int) and token_budget > 0)):
            raise ValueError(f"token_budget must be 'auto', None or a positive int, got {token_budget!r}")
        self.token_budget = token_budget
        # asynchronous collection (collect.max_staleness >= 1): what an update running beside the
        # calls allocates, a chip; "auto" is then fixed at the first call (current_token_budget)
        self.reserve_bytes = float(reserve_bytes)
        self._fixed_budget: int | None = None
        self.stats = CompileStats()
        self._programs: dict[tuple, Any] = {}
        # "checked" head: (weak ref to the head-weight array, its CheckedHead), rebuilt when the
        # weights change; weak, so an updated-away head is not kept alive by the sampler
        self._checked: tuple[weakref.ref, Any] | None = None
        # what load_policy checks incoming weights against, fixed at the first load
        self._policy: dict[str, tuple] | None = None

    def load_policy(self, graphdef, params, mesh: jax.sharding.Mesh | None = None) -> None:
        """Sample from `params` (the state `nnx.split` gives, e.g. a pure dict) of `graphdef`
        from the next call on, tracing under `mesh`: the one way weights reach a sampler after
        it is built (a trainer's rollout copy each step, a teacher's checkpoint).

        Checked leaf by leaf against what the sampler was built for, with a ValueError naming
        the leaf path: the shapes of the model config's parameters; dtype and sharding of the
        weights it was built with (the constructor's model, else the first load). The compiled
        programs are specialised on those, so a changed dtype or placement is a caller's
        mistake, not a reason to compile again. The "checked" head's cache stays: its weak
        reference to the head weights rebuilds it only when the head array changes."""
        got = leaf_specs(params)
        self._policy = policy_record(self._policy, self.model, self.cfg, got)
        check_policy(self._policy, got)
        self.model = nnx.merge(graphdef, params)
        self.mesh = mesh

    @property
    def compile_count(self) -> int:
        return self.stats.programs

    # --- compiled programs -----------------------------------------------------------------
    def _compiled(self, kind: str, fn, args: tuple, static: dict, donate: tuple[int, ...], label: tuple):
        key = (kind, _signature(args), tuple(sorted(static.items())))
        program = self._programs.get(key)
        if program is None:
            t0 = time.perf_counter()
            jitted = jax.jit(functools.partial(fn, **static), static_argnums=(0,), donate_argnums=donate)
            program = jitted.lower(*args).compile(compiler_options=dict(_compiler_options(kind, self.backend)))
            seconds = time.perf_counter() - t0
            self.stats.programs += 1
            self.stats.seconds += seconds
            self.stats.shapes.append((kind, *label, round(seconds, 2)))
            self._programs[key] = program
        return program

    def _run(self, kind, fn, args, static, donate=(), label=()):
        program = self._compiled(kind, fn, args, static, donate, label)
        return program(*args[1:])  # the graphdef (arg 0) is static, baked into the program

    # --- public API ------------------------------------------------------------------------
    def sample(self, prompts: Sequence[np.ndarray], *, n: int | Sequence[int] = 1,
               max_new_tokens: int | Sequence[int], temperature: float | Sequence[float] = 1.0,
               top_p: float | Sequence[float] = 1.0, top_k: int | Sequence[int] = 0,
               key) -> SampleResult:
        """Sample n sequences per prompt. Every setting may be one value or one per prompt.
        `key`: one PRNG key for the call, or a list with one key per prompt (required)."""
        n_prompts = len(prompts)
        if n_prompts == 0:
            return SampleResult(generations=[])
        prompts = [np.asarray(p) for p in prompts]
        settings = {
            "n": _per_prompt(n, n_prompts, "n"),
            "max_new": _per_prompt(max_new_tokens, n_prompts, "max_new_tokens"),
            "temperature": _per_prompt(temperature, n_prompts, "temperature"),
            "top_p": _per_prompt(top_p, n_prompts, "top_p"),
            "top_k": _per_prompt(top_k, n_prompts, "top_k"),
        }
        self._validate(prompts, settings)
        if isinstance(key, (list, tuple)):
            if len(key) != n_prompts:
                raise ValueError(f"got {len(key)} keys for {n_prompts} prompts")
            prompt_keys = [_as_typed_key(k) for k in key]
        else:
            base = _as_typed_key(key)
            prompt_keys = [jax.random.fold_in(base, i) for i in range(n_prompts)]

        result = SampleResult(generations=[[] for _ in range(n_prompts)])
        compiled_before = self.stats.programs
        for chunk in self._chunks(settings["n"], [p.size for p in prompts], settings["max_new"]):
            self._run_chunk(chunk, prompts, settings, prompt_keys, result)
        result.compiled_programs = self.stats.programs - compiled_before
        return result

    def _validate(self, prompts, settings) -> None:
        vocab = self.cfg.vocab_size
        for i, p in enumerate(prompts):
            if p.ndim != 1 or p.size == 0 or not np.issubdtype(p.dtype, np.integer):
                raise ValueError(f"prompt {i} must be a non-empty 1-D array of token ids, got {p.dtype}{p.shape}")
            if p.min() < 0 or p.max() >= vocab:
                raise ValueError(f"prompt {i} has token ids outside [0, {vocab})")
            total = p.size + int(settings["max_new"][i])
            if total > self.cfg.max_position_embeddings:
                raise ValueError(f"prompt {i}: {p.size} prompt + {settings['max_new'][i]} new tokens exceed "
                                 f"the model's context of {self.cfg.max_position_embeddings}")
        for i in range(len(prompts)):
            if int(settings["n"][i]) < 1 or int(settings["max_new"][i]) < 1:
                raise ValueError(f"prompt {i}: n and max_new_tokens must be >= 1")
            if not float(settings["temperature"][i]) >= 0.0:
                raise ValueError(f"prompt {i}: temperature must be >= 0 (0 = greedy)")
            if not 0.0 < float(settings["top_p"][i]) <= 1.0:
                raise ValueError(f"prompt {i}: top_p must be in (0, 1]")
            if int(settings["top_k"][i]) < 0:
                raise ValueError(f"prompt {i}: top_k must be >= 0 (0 = off)")
        most = max(int(x) for x in settings["n"])
        if most > self.buckets.samples[-1] or Buckets.fit(most, self.buckets.samples, "samples") > self.buckets.max_rows:
            raise ValueError(f"n={most} exceeds the largest samples bucket {self.buckets.samples[-1]} "
                             f"(or max_rows {self.buckets.max_rows}); pass larger Buckets")

    def _chunks(self, ns: list[int], prompt_lens: Sequence[int] | None = None,
                max_news: Sequence[int] | None = None) -> list[list[int]]:
        """Consecutive prompt groups whose padded size (prompts bucket x samples bucket)
        stays within the largest prompts bucket and max_rows, and whose cache-token
        equivalents stay within the token budget (`current_token_budget`)."""
        prompt_lens = [1] * len(ns) if prompt_lens is None else prompt_lens
        max_news = [1] * len(ns) if max_news is None else max_news
        return budget_lib.plan_chunks(ns, prompt_lens, max_news, self.buckets, self.current_token_budget())

    def current_token_budget(self) -> int | None:
        """The budget this call plans with: the int given, None, or for "auto" the devices'
        free memory now (budget.default_token_budget; None on CPU). With `reserve_bytes` (an
        update runs beside the calls) "auto" is the free memory at the first call, before any
        update has run, less the reserve, then kept: free memory read while an update holds
        its buffers would count them twice, and read between updates would leave them none."""
        if self.token_budget != "auto":
            return self.token_budget
        if self.backend == "cpu":
            return None
        if self._fixed_budget is not None:
            return self._fixed_budget
        dtype = self.model.runtime.dtype if self.model is not None else "float32"  # the cache's dtype
        budget = budget_lib.default_token_budget(self.cfg, self.mesh, dtype=dtype, reserve_bytes=self.reserve_bytes)
        if self.reserve_bytes and budget is not None:
            self._fixed_budget = budget
        return budget

    def _run_chunk(self, chunk, prompts, settings, prompt_keys, result: SampleResult) -> None:
        b = self.buckets
        n_prompt_rows = Buckets.fit(len(chunk), b.prompts, "prompts")
        samples = Buckets.fit(max(int(settings["n"][i]) for i in chunk), b.samples, "samples")
        prompt_len = Buckets.fit(max(prompts[i].size for i in chunk), b.prompt_len, "prompt_len")
        max_new = Buckets.fit(max(int(settings["max_new"][i]) for i in chunk), b.max_new, "max_new")
        n_rows = n_prompt_rows * samples

        tokens = np.zeros((n_prompt_rows, prompt_len), np.int32)
        mask = np.zeros((n_prompt_rows, prompt_len), bool)
        mask[:, -1] = True  # padding prompts: one dummy token, so no row attends to nothing
        for slot, i in enumerate(chunk):
            tokens[slot, prompt_len - prompts[i].size:] = prompts[i]
            mask[slot, prompt_len - prompts[i].size:] = True

        # row = slot * samples + j (prompt-major: a prompt's samples share its prefill cache)
        row_of = [(slot, j) for slot, i in enumerate(chunk) for j in range(int(settings["n"][i]))]
        row_index = np.asarray([slot * samples + j for slot, j in row_of], np.int32)
        per_row = {name: np.zeros(n_rows, dt) for name, dt in
                   (("temperature", np.float32), ("top_p", np.float32), ("top_k", np.int32), ("max_new", np.int32))}
        per_row["top_p"][:] = 1.0  # padding rows: max_new 0, never sampled
        for r, (slot, _) in zip(row_index, row_of):
            for name in per_row:
                per_row[name][r] = settings[name][chunk[slot]]
        keys_by_slot = [prompt_keys[i] for i in chunk]
        keys_by_slot += [keys_by_slot[0]] * (n_prompt_rows - len(chunk))
        row_keys = _row_keys(jnp.stack(keys_by_slot), np.repeat(np.arange(n_prompt_rows, dtype=np.int32), samples),
                             np.tile(np.arange(samples, dtype=np.int32), n_prompt_rows))
        rows = decode_lib.RowSettings(keys=row_keys, temperature=per_row["temperature"], top_k=per_row["top_k"],
                                      top_p=per_row["top_p"], max_new=per_row["max_new"])

        graphdef, params = nnx.split(self.model)
        with self._mesh_context():
            checked = self._checked_head()
            t0 = time.perf_counter()
            state = self._run("prefill", decode_lib.prefill, (graphdef, params, tokens, mask, rows, self.eos_ids),
                              {"samples": samples, "max_new": max_new, "cap": self.cap,
                               "head": self.lm_head, "span_ladder": b.attention_spans,
                               "backend": self.backend},
                              label=(n_prompt_rows, prompt_len, samples, max_new))
            jax.block_until_ready(state.done)
            t1 = time.perf_counter()
            state = self._run("decode", decode_lib.decode, (graphdef, params, state, rows, self.eos_ids, checked),
                              {"cap": self.cap, "head": self.lm_head}, donate=(2,),
                              label=(n_prompt_rows, prompt_len, samples, max_new))
            out_tokens, out_logprobs, lengths, stopped, steps, fallbacks = jax.device_get(
                (state.tokens, state.logprobs, state.lengths, state.stopped, state.step, state.head_fallbacks))
            t2 = time.perf_counter()
        result.prefill_s += t1 - t0
        result.decode_s += t2 - t1
        result.decode_steps = max(result.decode_steps, int(steps))
        result.head_fallback_steps += int(fallbacks)
        result.generated_tokens += int(sum(int(lengths[r]) for r in row_index))
        result.row_steps += len(row_index) * int(steps)
        for r, (slot, _) in zip(row_index, row_of):
            length = int(lengths[r])
            result.generations[chunk[slot]].append(Generation(
                token_ids=out_tokens[r, :length].copy(), logprobs=out_logprobs[r, :length].copy(),
                finish_reason="stop" if stopped[r] else "length"))

    def _checked_head(self):
        """The "checked" head's bf16 copy and norms, kept while the head-weight array is the
        same object (a parameter update makes a new array): building them reads and converts
        the whole head (~0.1 s on bench-tiny, once per update instead of once per call). The
        kept copy costs half the head's f32 memory; None when the mode does not apply."""
        if not decode_lib.uses_checked_head(self.model, self.lm_head, self.backend):
            self._checked = None
            return None
        w = self.model.head_weight()
        if self._checked is None or self._checked[0]() is not w:
            self._checked = (weakref.ref(w), _build_checked_head(w))
        return self._checked[1]

    def _mesh_context(self):
        if self.mesh is None:
            return contextlib.nullcontext()
        return set_mesh(self.mesh)
