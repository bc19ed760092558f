"""`actionopd train --check`: what a config will run, and whether it fits in device memory.

The memory estimate is per device and deliberately simple (it is a planning aid, not a
compiler report): sharded parameters, gradient accumulator, AdamW moments, and the
activations of one microbatch. With the CPU or xla attention, activations include the
[heads, T, T] scores, which dominate at long context; the fused kernels (splash on TPU, cuDNN
on GPU) never hold them. `actionopd train --check --aot` replaces the estimate by the compiler's
own numbers (TPU, or GPU by XLA's deviceless GPU compiler; train/aot_check.py). The terms are
calibrated on XLA:GPU's compile of the 4B update (within 1.00-1.08x of it for every policy at
1,024-16,384 tokens; the compile equals run 1's measured peak).

Collection is planned too, since it is often the peak: the trainer's parameters and AdamW
moments stay resident while the sampler holds its bf16 rollout copy (tensor-parallel over a
host's chips, sampling/rollout.rollout_params) and the KV cache and prefill activations of one
call, sized by the same token budget the sampler uses (sampling/budget.py).

With mesh.rollout_devices = k the two halves are planned apart: the update on the training
devices (plus the rollout copy's blocks staged there while they are copied out), the sampler's
copy and KV cache (or the engine's pool) on its own k devices, with no trainer state beside them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from actionopd_jax.config import Config
from actionopd_jax.config.rollout import rollout_sampler
from actionopd_jax.engine.aot import engine_shapes
from actionopd_jax.model import Qwen3Config, count_params
from actionopd_jax.model.attention import FUSED as FUSED_ATTENTION
from actionopd_jax.model.attention.splash import backward_dq_bytes
from actionopd_jax.model.runtime import POLICIES

_BYTES = {"float32": 4, "bfloat16": 2}
GIB = 1024**3
TRANSIENT_MARGIN = 1.10


@dataclass
class MemoryEstimate:
    params: float
    grads: float
    optimizer: float
    activations: float
    attention_scores: float
    logits: float

    @property
    def resident(self) -> float:
        """Buffers allocated once at their exact size: parameters, gradients, AdamW moments."""
        return self.params + self.grads + self.optimizer

    @property
    def transient(self) -> float:
        """What the step allocates and frees layer by layer: activations and logits."""
        return self.activations + self.logits

    @property
    def total(self) -> float:
        # +10% of the transient part only, for XLA's temporaries and the fragmentation of
        # buffers freed and reallocated every layer. The resident state is exact: a margin on it
        # (1.10 x everything before issue 42) put the plan 1.36-1.42x over run 1's peaks.
        return self.resident + TRANSIENT_MARGIN * self.transient

    @property
    def update_reserve(self) -> float:
        """What an update allocates beside the parameters and AdamW moments, which stay resident."""
        return self.total - self.params - self.optimizer


def estimate_memory(cfg: Config, qcfg: Qwen3Config, mesh: dict[str, int], attention: str = "cpu",
                    remat: str | None = None) -> MemoryEstimate:
    """Bytes per device for one update of `cfg` on a mesh {"data", "fsdp", "tensor"};
    `attention`: the implementation the target runs (model/attention.resolve); `remat`: a
    policy in place of cfg.model.remat (the chooser, train/remat_choice.py)."""
    n = count_params(qcfg)["total"]
    tp = mesh.get("tensor", 1)
    shards = mesh.get("fsdp", 1) * tp
    pbytes, abytes = _BYTES[qcfg.param_dtype], _BYTES[cfg.model.dtype]
    params = n * pbytes / shards
    # The step scans over microbatches with an f32 accumulator (train/step.py). With more than
    # one, the accumulator and one microbatch's gradient (in the parameters' dtype) are both
    # live. With one (as the device check times the step), XLA inlines the one-trip scan and
    # folds `zeros + g`: the gradient in the parameters' dtype is the only buffer (XLA:GPU's
    # compile of the 4B update, aot/gpu_topology.py: f32 n x 4 / n x 8 with 1 / 2 microbatches,
    # bf16 n x 2 / n x 6; bf16 with one was counted n x 6 before, 1.46x over its compiled peak)
    t = cfg.train
    microbatches = max(1, t.minibatch_rows // max(1, t.microbatch_rows))
    grads = n * (pbytes + (4 if microbatches > 1 else 0)) / shards
    optimizer = 2 * n * pbytes / shards  # AdamW mu, nu (stored like the parameters)

    rows = math.ceil(t.microbatch_rows / (mesh.get("data", 1) * mesh.get("fsdp", 1)))
    seq = t.max_seq_len
    if t.shared_prompt:  # packed rows: one prompt, then N response regions
        c = cfg.collect
        seq = min(c.max_prompt_tokens, t.max_seq_len) + c.num_candidates * c.max_response_tokens
    d, i, h, kv, dh, layers = (qcfg.hidden_size, qcfg.intermediate_size, qcfg.num_attention_heads,
                               qcfg.num_key_value_heads, qcfg.head_dim, qcfg.num_hidden_layers)
    tokens = rows * seq
    # values a layer keeps for its backward pass, per token: norm inputs/outputs, q, k, v, the
    # attention output, gate, up and their product
    per_token_layer = (4 * d + (2 * h * dh + 2 * kv * dh + 3 * i) / tp) * abytes
    # what "dots" keeps: the outputs of the weight matmuls only (q, k, v, o, gate, up, down)
    per_token_dots = (2 * d + (h * dh + 2 * kv * dh + 2 * i) / tp) * abytes
    # what "none" keeps, as XLA:GPU's compile of the 4B update lays it out (buffer report of
    # aot/gpu_topology.py's compile; docs/measurements_compiler.md): six MLP-wide values (gate,
    # up, activation, product and the backward's own), q-, k- and v-wide values after the norms
    # and rotary, three model-wide ones, and in f32 the two RMSNorms' inputs, q, k and v. 213 KiB
    # a layer-token at the 4B against 214 compiled (per_token_layer's 97 put "none" 0.65-0.79x
    # under its compiled peak, and `auto` would choose it where it does not fit)
    per_token_none = ((6 * i + 4 * h * dh + 4 * kv * dh) / tp + 3 * d) * abytes + (2 * d + (h * dh + 2 * kv * dh) / tp) * 4
    # dense attention at the backward peak of one layer: the recomputed probabilities and their
    # gradient in the compute dtype, the scores' gradient in f32. The f32 scores and softmax of
    # the forward are consumed by the fused softmax before the backward starts, so they are not
    # live beside these (run 1, H200, xla at 4,096: 8.5 bytes per score element over cuDNN's peak)
    score_elems = rows * (h / tp) * seq * seq
    scores_peak = score_elems * (abytes + abytes + 4)
    if attention in FUSED_ATTENTION:  # flash kernels: output and log-sum-exp, never the scores
        score_elems, scores_peak = 0, rows * (h / tp) * seq * (dh * abytes + 4)
    if attention == "splash":
        # the fused backward's dq partials, one per KV block, live in one layer's backward (the
        # TPU recipe's 40,960-token rows: 12.5 GiB a chip; counted 0 before, when they were 25
        # GiB: the plan was 0.52x of the update compiled for v5p)
        scores_peak += rows * backward_dq_bytes(seq, math.ceil(h / tp), dh, abytes)
    remat = cfg.model.remat if remat is None else remat
    if remat not in POLICIES:
        raise ValueError(f"estimate_memory: remat {remat!r} is not a policy ({', '.join(POLICIES)}); "
                         "resolve model.remat=auto first (train/remat_choice.resolve_remat)")
    if remat == "full":  # only layer inputs are kept; one layer is recomputed at a time
        activations = layers * tokens * d * abytes + 2 * tokens * per_token_layer + scores_peak
    elif remat in ("attn", "offload"):  # layer inputs + attention residuals (host if offload)
        kept = 0 if remat == "offload" else layers * tokens * (h / tp) * (dh * abytes + 4)
        activations = layers * tokens * d * abytes + kept + 2 * tokens * per_token_layer + scores_peak
    elif remat == "dots":  # matmul outputs kept; one layer's attention/elementwise recomputed at a time
        activations = layers * tokens * per_token_dots + tokens * per_token_layer + scores_peak
    else:  # everything kept, including every layer's attention probabilities
        activations = layers * (tokens * per_token_none + score_elems * abytes) + scores_peak
    if pbytes != abytes and (remat == "none" or attention == "splash"):
        # the layers' weights cast to the compute dtype: kept for the backward under "none"
        # (XLA:GPU's compile: 60% of them), and on TPU cast once outside the layer loop whatever
        # the remat (the compiled update on a v5p chip: 6.8 GiB of bf16 weights at the 4B)
        activations += count_params(qcfg)["per_layer"] * layers * abytes / shards
    resp = t.logits_chunk if t.logits_chunk > 0 and t.vocab_chunk == 0 else cfg.collect.max_response_tokens
    vocab = min(t.vocab_chunk, qcfg.vocab_size) if t.vocab_chunk > 0 else qcfg.vocab_size / tp
    logits = 3 * rows * min(resp, seq) * vocab * 4  # logits, softmax, gradient (f32)
    return MemoryEstimate(params, grads, optimizer, activations, scores_peak, logits)


@dataclass
class CollectionEstimate:
    resident: float          # trainer parameters + AdamW moments, per chip
    rollout_copy: float      # the sampler's copy of the weights, per chip
    budget_tokens: int | None  # cache-token equivalents one sampler call may hold
    state_tokens: float      # cache-token equivalents of the largest single state
    call: float              # bytes of the largest call the budget allows, per chip
    states_per_call: int
    prompt_bucket: int = 0   # the largest prompt, padded to the sampler's bucket

    @property
    def total(self) -> float:
        return self.resident + self.rollout_copy + self.call


def estimate_collection(cfg: Config, qcfg: Qwen3Config, mesh: dict[str, int], *, chips_per_host: int,
                        usable_bytes: float | None, platform: str) -> CollectionEstimate:
    """Bytes per chip while the sampler runs (see the module docstring). The budget is the
    sampler's: collect.sampler_token_budget, or "auto" = SAFETY x what is left of the usable
    memory; "none" plans collect.concurrency largest states in one call. With
    mesh.rollout_devices, per rollout chip (`chips_per_host` of them): no trainer state there,
    and a copy even on CPU."""
    from actionopd_jax.model.attention import resolve
    from actionopd_jax.sampling import budget as sb

    est = estimate_memory(cfg, qcfg, mesh, resolve(cfg.model.attention, platform))
    split = cfg.mesh.rollout_devices > 0
    resident = 0.0 if split else est.params + est.optimizer
    n = count_params(qcfg)["total"]
    copy_bytes = 2 if platform != "cpu" else _BYTES[qcfg.param_dtype]  # bf16 on accelerators
    rollout = 0.0 if platform == "cpu" and not split else n * copy_bytes / chips_per_host
    from actionopd_jax.sampling.buckets import Buckets

    c, b = cfg.collect, Buckets()  # the sampler's default buckets: what a call really allocates
    prompt = Buckets.fit(min(c.max_prompt_tokens, cfg.train.max_seq_len), b.prompt_len, "prompt_len")
    state = sb.chunk_tokens(1, prompt, Buckets.fit(c.num_candidates, b.samples, "samples"),
                            Buckets.fit(c.max_response_tokens, b.max_new, "max_new"))
    per_token = sb.cache_bytes_per_token(qcfg, cfg.model.dtype) / chips_per_host  # KV heads over the host's chips
    setting = sb.parse_token_budget(c.sampler_token_budget)
    if isinstance(setting, int):
        budget = setting
    elif setting == "auto" and usable_bytes is not None and platform != "cpu":
        # asynchronous collection keeps room for the update beside the calls (train/update_reserve.py)
        beside = est.update_reserve if c.max_staleness >= 1 and not split else 0.0
        budget = sb.token_budget(qcfg, max(0.0, usable_bytes - resident - rollout - beside), chips_per_host,
                                dtype=cfg.model.dtype)
    else:
        budget = None
    if budget is None:
        states = max(1, c.concurrency)
        call = states * state * per_token
    else:
        states = int(budget // state)
        call = max(budget, state) * per_token  # a state over the budget still gets a call of its own
    return CollectionEstimate(resident, rollout, budget, state, call, states, prompt)


def _engine_lines(cfg: Config, qcfg: Qwen3Config, mesh: dict[str, int], coll: CollectionEstimate,
                  est: MemoryEstimate, usable: float | None) -> tuple[int | None, float, list[str]]:
    """(pages of the engine's pool per chip, None where the memory is unknown; the peak bytes
    per chip, an update beside the resident pool; the plan's lines). The pool is sized at the
    first weight load from what is left beside the trainer's parameters, AdamW moments and
    rollout copy, less an update's reserve (a run takes XLA's compile where larger,
    train/update_reserve.py), times budget.SAFETY; its KV heads are split over "tensor" where
    that divides them (engine/sizing.pool_shards)."""
    from actionopd_jax.sampling import budget as sb

    e = engine_shapes(cfg.collect)
    # issue 44: with collect.max_staleness >= 1 the engine samples from its own copy while the update runs
    # (on CPU a copy of the training weights, which the synchronous loop samples as they are)
    eta = cfg.collect.max_staleness
    copy = coll.rollout_copy or (est.params if eta >= 1 else 0.0)
    split = cfg.mesh.rollout_devices
    reserve = 0.0 if split else est.update_reserve   # a split's update runs elsewhere
    tensor = split or mesh.get("tensor", 1)
    shards = tensor if tensor > 1 and qcfg.num_key_value_heads % tensor == 0 else 1
    per_page = sb.cache_bytes_per_token(qcfg, cfg.model.dtype) * e.page_size / shards
    lines = [f"collection per {'rollout ' if split else ''}device (analytic estimate; the paged engine's pool "
             + ("on the sampler's own devices):" if split else "stays resident beside the trainer state):"),
             f"  sampler            engine: {e.slots} slots x {e.max_len:,} tokens ({e.page_size}-token pages, "
             f"{e.pages_per_slot} a slot), segments of {e.segment} steps, prefill chunks of {e.chunk}",
             f"  params + AdamW     {coll.resident / GIB:8.2f} GiB",
             f"  rollout copy       {copy / GIB:8.2f} GiB",
             f"  update reserve     {reserve / GIB:8.2f} GiB  (gradients, activations, logits of an update)"]
    if eta >= 1:
        lines.append(f"  beside the update  the pool and the rollout copy stay resident: the engine keeps sampling "
                     f"while the update runs (collect.max_staleness={eta}) and takes its weights between steps")
    if usable is None:
        return None, 0.0, lines + ["  KV page pool       sized at start from free memory (device memory unknown here)"]
    pool = max(0.0, usable - coll.resident - copy - reserve) * sb.SAFETY
    pages = int(pool // per_page)
    full = pages // e.pages_per_slot
    lines.append(f"  KV page pool       {pages * per_page / GIB:8.2f} GiB  ({pages:,} pages: {min(full, e.slots)} of "
                 f"{e.slots} slots full at once{', the rest prefix cache' if full > e.slots else ''})")
    peak = coll.resident + copy + reserve + pages * per_page
    lines.append(f"  total (an update) {peak / GIB:9.2f} GiB  (params + AdamW + rollout copy + reserve + pool)")
    lines.append("  programs' scratch  taken off the pool at start: XLA's memory analysis of the chunk and "
                 "segment programs, read before the pool is allocated (engine/pool_fit.py)")
    if pages < e.pages_per_slot + 1:
        left = usable - coll.resident - copy - reserve
        lines.append(f"  the pool does not hold one slot: {usable / GIB:.2f} GiB usable - params + AdamW, rollout copy "
                     f"and update reserve leaves {left / GIB:.2f} GiB, x {sb.SAFETY:.2f} = {pages:,} pages of "
                     f"{per_page / 2 ** 20:.2f} MiB; one slot of {e.max_len:,} tokens needs {e.pages_per_slot:,} "
                     f"({e.pages_per_slot * per_page / GIB:.2f} GiB): shorten collect.max_prompt_tokens or "
                     "collect.max_response_tokens, or free memory")
    return pages, peak, lines


def _execution_line(cfg: Config) -> str:
    """Which pools the matcher's execution stage (issue 45) decides pairs on, by forking."""
    if cfg.matcher.execution == "off":
        return "execution  matcher.execution off: rules, then the judge"
    from actionopd_jax.envs.fork import execution_support
    from actionopd_jax.envs.mixture import parse_mixture

    try:
        pools = [p for p, _ in parse_mixture(cfg.env.mixture)] if cfg.env.mixture else [cfg.env.name]
    except ValueError:
        pools = [cfg.env.name]  # the config checks say what is wrong with the mixture
    return "execution  matcher.execution auto: " + "; ".join(execution_support(pools))


def describe(cfg: Config, qcfg: Qwen3Config, mesh: dict[str, int], *, device_memory_gb: float | None,
             device_kind: str = "", platform: str = "cpu", usable_fraction: float = 1.0,
             chips_per_host: int = 0) -> tuple[str, bool]:
    """Human-readable plan and whether it is expected to fit (on `platform`'s attention):
    the train step and collection both within `usable_fraction` of `device_memory_gb`."""
    from actionopd_jax.model.attention import resolve

    counts = count_params(qcfg)
    attention = resolve(cfg.model.attention, platform)
    est = estimate_memory(cfg, qcfg, mesh, attention)
    usable = device_memory_gb * usable_fraction * GIB if device_memory_gb else None
    coll = None
    split = cfg.mesh.rollout_devices
    if cfg.collect.kind != "synthetic":
        coll = estimate_collection(cfg, qcfg, mesh, chips_per_host=split or chips_per_host or math.prod(mesh.values()),
                                   usable_bytes=usable, platform=platform)
    # a split stages the copy's blocks on each training device between updates (sampling/rollout.py)
    staging = coll.rollout_copy if split and coll is not None else 0.0
    t, c = cfg.train, cfg.collect
    sampler = rollout_sampler(c.sampler, platform)
    n_dev = math.prod(mesh.values())
    rows_per_step = c.task_starts_per_step * c.max_decisions * c.num_candidates
    lines = [
        f"model      {cfg.model.hf_path or cfg.model.preset}: {counts['total'] / 1e9:.3f} B parameters "
        f"({counts['embedding'] / 1e9:.3f} B embedding), {qcfg.num_hidden_layers} layers, "
        f"params {qcfg.param_dtype}, compute {cfg.model.dtype}, remat {cfg.model.remat}, attention {attention} "
        f"({cfg.model.attention} on {platform})",
        f"mesh       {mesh} = {n_dev} device(s){' of ' + device_kind if device_kind else ''}"
        + (f" for training; the sampler has {split} device(s) of its own (mesh.rollout_devices), tensor-parallel, "
           f"the weights resharded onto them each step" if split else ""),
        f"loss       {t.loss}: clip {t.clip_eps}, dual clip {t.dual_clip}, rollout T={c.temperature}, "
        f"old logprobs: {t.old_logprobs}",
        f"optimizer  AdamW lr {t.lr:g} (warmup {t.warmup_steps}), weight decay {t.weight_decay}, "
        f"grad clip {t.grad_clip}",
        f"batch      minibatch {t.minibatch_rows} rows = {t.minibatch_rows // t.microbatch_rows} x "
        f"{t.microbatch_rows}-row microbatches; rows up to {t.max_seq_len} tokens; "
        f"{t.ppo_epochs} PPO epoch(s)",
        f"collect    {c.kind} ({sampler} sampler{': auto on ' + platform if c.sampler == 'auto' else ''}): "
        f"{c.task_starts_per_step} task starts/step, "
        f"N={c.num_candidates}, "
        f"K={c.teacher_samples}, lambda={c.freq_bonus}, reward {c.reward}, commit {c.commit}, "
        f"<= {c.max_decisions} decisions -> <= {rows_per_step} rows/step "
        f"(<= {math.ceil(rows_per_step / t.minibatch_rows)} updates)",
        f"teacher    {cfg.teacher.kind} {cfg.teacher.model}; matcher {cfg.matcher.kind} {cfg.matcher.model}; "
        f"env {cfg.env.name} {','.join(cfg.env.domains)}"
        + (" (env.allow_eval_overlap: trains on tasks evaluation scores)"
           if getattr(cfg.env, "allow_eval_overlap", False) else ""),
        _execution_line(cfg),
        f"run        {t.steps} steps, checkpoint every {cfg.checkpoint.every_steps} (keep "
        f"{cfg.checkpoint.keep}), seed {cfg.run.seed}",
        f"memory per {'training ' if split else ''}device (analytic estimate, not a compiler figure):",
        f"  parameters         {est.params / GIB:8.2f} GiB",
        f"  gradients          {est.grads / GIB:8.2f} GiB",
        f"  AdamW moments      {est.optimizer / GIB:8.2f} GiB",
        f"  activations        {est.activations / GIB:8.2f} GiB  (rows of train.max_seq_len; one layer's attention "
        f"at its peak, scores or a kernel's buffers: {est.attention_scores / GIB:.2f} GiB)",
        f"  response logits    {est.logits / GIB:8.2f} GiB",
        f"  total (+10%)       {est.total / GIB:8.2f} GiB  (+10% of activations and logits: XLA temporaries)",
    ]
    if staging:
        lines.append(f"  reshard staging    {staging / GIB:8.2f} GiB  (between updates, beside params + AdamW: the "
                     f"rollout copy's {split} block(s), copied out to the sampler's devices)")
    engine_pages, engine_peak = None, 0.0
    if coll is not None and sampler == "engine":
        engine_pages, engine_peak, engine_lines = _engine_lines(cfg, qcfg, mesh, coll, est, usable)
        lines += engine_lines
    elif coll is not None:
        budget = ("no token budget: one call holds collect.concurrency states" if coll.budget_tokens is None
                  else f"token budget {coll.budget_tokens:,} cache tokens, {coll.states_per_call} largest state(s) "
                       f"per call")
        copy_note = ("bf16" if platform != "cpu" else "the parameters' dtype on CPU") + f", over its {split} chip(s)" \
            if split else "bf16, over a host's chips" if platform != "cpu" else "none on CPU: the training weights"
        lines += [
            "collection per rollout device (analytic estimate; the static sampler on its own devices):" if split else
            "collection per device (analytic estimate; the static sampler runs while the trainer state stays "
            "resident):",
            *([] if split else [f"  params + AdamW     {coll.resident / GIB:8.2f} GiB"]),
            f"  rollout copy       {coll.rollout_copy / GIB:8.2f} GiB  ({copy_note})",
            f"  KV cache + prefill {coll.call / GIB:8.2f} GiB  ({budget}; a state: "
            f"{coll.prompt_bucket:,}-token prompt bucket x 1.25 + "
            f"{cfg.collect.num_candidates} x {cfg.collect.max_response_tokens:,} new)",
            f"  total              {coll.total / GIB:8.2f} GiB",
        ]
        if c.max_staleness >= 1 and not split:   # issue 44: collection runs while the update does
            beside = (coll.rollout_copy or est.params) + coll.call   # on CPU a copy of the training weights
            lines.append(f"  beside the update  {beside / GIB:8.2f} GiB  (collect.max_staleness={c.max_staleness}: the "
                         f"sampler's own weights and a call's KV cache; with the update "
                         f"{(est.total + beside) / GIB:.2f} GiB)")
    fits = True
    if device_memory_gb:
        collection = engine_peak if sampler == "engine" else (coll.total if coll is not None else 0.0)
        if coll is not None and sampler != "engine" and c.max_staleness >= 1 and not split:   # both at once
            collection = est.total + (coll.rollout_copy or est.params) + coll.call
        peak = max(est.total, collection, est.params + est.optimizer + staging)
        fits = peak <= usable and (coll is None or coll.budget_tokens is None or coll.states_per_call >= 1
                                   or engine_pages is not None)
        if engine_pages is not None:   # the engine's pool takes what is left: it fits when it holds one slot
            fits = fits and engine_pages >= engine_shapes(cfg.collect).pages_per_slot + 1
        share = f" x {usable_fraction:.2f} usable = {usable / GIB:.2f} GiB" if usable_fraction < 1 else ""
        what = ("update beside the engine pool" if sampler == "engine" else
                "update beside collection" if c.max_staleness >= 1 else "collection")
        if split:   # each half against its own chips
            train_peak = max(est.total, est.params + est.optimizer + staging)
            lines.append(f"  device memory      {device_memory_gb:8.2f} GiB{share}; training devices "
                         f"{train_peak / GIB:.2f} GiB, sampler's devices {collection / GIB:.2f} GiB -> "
                         f"{'fits' if fits else 'DOES NOT FIT'}")
        else:
            lines.append(f"  device memory      {device_memory_gb:8.2f} GiB{share}; peak "
                         f"{what if collection > est.total else 'train step'} "
                         f"{peak / GIB:.2f} GiB -> {'fits' if fits else 'DOES NOT FIT'}")
        if engine_pages is None and coll is not None and coll.budget_tokens is not None and coll.states_per_call < 1:
            lines.append("  the largest state does not fit in one sampler call: shorten collect.max_prompt_tokens "
                         "or collect.max_response_tokens, or put more chips on a host")
        if not fits:
            hints = []
            if cfg.model.remat != "full":
                hints.append("model.remat=auto (the least recompute that fits) or full")
            if est.logits > 0.2 * est.total and t.logits_chunk == 0 and t.vocab_chunk == 0:
                hints.append("train.vocab_chunk=8192")
            if est.attention_scores > 0.3 * est.total:
                hints.append("fewer train.microbatch_rows or a shorter train.max_seq_len "
                             "(dense attention scores grow with T^2)")
            if est.params + est.grads + est.optimizer > 0.5 * usable:
                hints.append("more devices on mesh.fsdp")
            if hints:
                lines.append("  try: " + "; ".join(hints))
    else:
        lines.append("  device memory      unknown (set mesh.device_memory_gb to compare)")
    return "\n".join(lines), fits
