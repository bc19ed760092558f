"""`actionopd train --check`: what a config will run, and whether it fits in device memory.

The memory estimate is per device and deliberately simple (it is a planning aid, not a
compiler report): sharded parameters, gradient accumulator, AdamW moments, and the
activations of one microbatch. With the CPU or xla attention, activations include the
[heads, T, T] scores, which dominate at long context; the fused kernels (splash on TPU, cuDNN
on GPU) never hold them. `actionopd train --check --aot` replaces the estimate by the TPU
compiler's own numbers (train/aot_check.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from actionopd_jax.config import Config
from actionopd_jax.model import Qwen3Config, count_params

_BYTES = {"float32": 4, "bfloat16": 2}
GIB = 1024**3


@dataclass
class MemoryEstimate:
    params: float
    grads: float
    optimizer: float
    activations: float
    attention_scores: float
    logits: float

    @property
    def total(self) -> float:
        # +10% for XLA temporaries, fragmentation and the batch itself
        return 1.10 * (self.params + self.grads + self.optimizer + self.activations + self.logits)


FUSED_ATTENTION = ("splash", "cudnn")


def estimate_memory(cfg: Config, qcfg: Qwen3Config, mesh: dict[str, int], attention: str = "cpu"
                    ) -> MemoryEstimate:
    """Bytes per device for one update of `cfg` on a mesh {"data", "fsdp", "tensor"};
    `attention`: the implementation the target runs (model/attention.resolve)."""
    n = count_params(qcfg)["total"]
    tp = mesh.get("tensor", 1)
    shards = mesh.get("fsdp", 1) * tp
    pbytes, abytes = _BYTES[qcfg.param_dtype], _BYTES[qcfg.dtype]
    params = n * pbytes / shards
    # f32 accumulator carried through the microbatch scan + one microbatch's gradient
    grads = n * (4 + pbytes) / shards
    optimizer = 2 * n * pbytes / shards  # AdamW mu, nu (stored like the parameters)

    t = cfg.train
    rows = math.ceil(t.microbatch_rows / (mesh.get("data", 1) * mesh.get("fsdp", 1)))
    seq = t.max_seq_len
    if t.shared_prompt:  # packed rows: one prompt, then N response regions
        c = cfg.collect
        seq = min(c.max_prompt_tokens, t.max_seq_len) + c.num_candidates * c.max_response_tokens
    d, i, h, kv, dh, layers = (qcfg.hidden_size, qcfg.intermediate_size, qcfg.num_attention_heads,
                               qcfg.num_key_value_heads, qcfg.head_dim, qcfg.num_hidden_layers)
    tokens = rows * seq
    # values a layer keeps for its backward pass, per token
    per_token_layer = (4 * d + (2 * h * dh + 2 * kv * dh + 3 * i) / tp) * abytes
    # dense attention at the backward peak of one layer: f32 scores, f32 softmax, probs in the
    # compute dtype, and their gradients (probs-grad in the compute dtype, scores-grad in f32)
    score_elems = rows * (h / tp) * seq * seq
    scores_peak = score_elems * (4 + 4 + abytes + abytes + 4)
    if attention in FUSED_ATTENTION:  # flash kernels: output and log-sum-exp, never the scores
        score_elems, scores_peak = 0, rows * (h / tp) * seq * (dh * abytes + 4)
    if qcfg.remat == "full":  # only layer inputs are kept; one layer is recomputed at a time
        activations = layers * tokens * d * abytes + 2 * tokens * per_token_layer + scores_peak
    elif qcfg.remat in ("attn", "offload"):  # layer inputs + attention residuals (host if offload)
        kept = 0 if qcfg.remat == "offload" else layers * tokens * (h / tp) * (dh * abytes + 4)
        activations = layers * tokens * d * abytes + kept + 2 * tokens * per_token_layer + scores_peak
    elif qcfg.remat == "dots":  # matmul outputs kept, attention/elementwise recomputed
        activations = layers * tokens * per_token_layer + scores_peak
    else:  # everything kept, including every layer's attention probabilities
        activations = layers * (tokens * per_token_layer + score_elems * abytes) + scores_peak
    resp = t.logits_chunk if t.logits_chunk > 0 and t.vocab_chunk == 0 else cfg.collect.max_response_tokens
    vocab = min(t.vocab_chunk, qcfg.vocab_size) if t.vocab_chunk > 0 else qcfg.vocab_size / tp
    logits = 3 * rows * min(resp, seq) * vocab * 4  # logits, softmax, gradient (f32)
    return MemoryEstimate(params, grads, optimizer, activations, scores_peak, logits)


def describe(cfg: Config, qcfg: Qwen3Config, mesh: dict[str, int], *, device_memory_gb: float | None,
             device_kind: str = "", platform: str = "cpu") -> tuple[str, bool]:
    """Human-readable plan and whether it is expected to fit (on `platform`'s attention)."""
    from actionopd_jax.model.attention import resolve

    counts = count_params(qcfg)
    attention = resolve(qcfg.attention, platform)
    est = estimate_memory(cfg, qcfg, mesh, attention)
    t, c = cfg.train, cfg.collect
    n_dev = math.prod(mesh.values())
    rows_per_step = c.task_starts_per_step * c.max_decisions * c.num_candidates
    lines = [
        f"model      {cfg.model.hf_path or cfg.model.preset}: {counts['total'] / 1e9:.3f} B parameters "
        f"({counts['embedding'] / 1e9:.3f} B embedding), {qcfg.num_hidden_layers} layers, "
        f"params {qcfg.param_dtype}, compute {qcfg.dtype}, remat {qcfg.remat}, attention {attention} "
        f"({qcfg.attention} on {platform})",
        f"mesh       {mesh} = {n_dev} device(s){' of ' + device_kind if device_kind else ''}",
        f"loss       {t.loss}: clip {t.clip_eps}, dual clip {t.dual_clip}, rollout T={c.temperature}, "
        f"old logprobs: {t.old_logprobs}",
        f"optimizer  AdamW lr {t.lr:g} (warmup {t.warmup_steps}), weight decay {t.weight_decay}, "
        f"grad clip {t.grad_clip}",
        f"batch      minibatch {t.minibatch_rows} rows = {t.minibatch_rows // t.microbatch_rows} x "
        f"{t.microbatch_rows}-row microbatches; rows up to {t.max_seq_len} tokens; "
        f"{t.ppo_epochs} PPO epoch(s)",
        f"collect    {c.kind}: {c.task_starts_per_step} task starts/step, N={c.num_candidates}, "
        f"K={c.teacher_samples}, lambda={c.freq_bonus}, reward {c.reward}, commit {c.commit}, "
        f"<= {c.max_decisions} decisions -> <= {rows_per_step} rows/step "
        f"(<= {math.ceil(rows_per_step / t.minibatch_rows)} updates)",
        f"teacher    {cfg.teacher.kind} {cfg.teacher.model}; matcher {cfg.matcher.kind} {cfg.matcher.model}; "
        f"env {cfg.env.name} {','.join(cfg.env.domains)}",
        f"run        {t.steps} steps, checkpoint every {cfg.checkpoint.every_steps} (keep "
        f"{cfg.checkpoint.keep}), seed {cfg.run.seed}",
        "memory per device (estimate):",
        f"  parameters         {est.params / GIB:8.2f} GiB",
        f"  gradients          {est.grads / GIB:8.2f} GiB",
        f"  AdamW moments      {est.optimizer / GIB:8.2f} GiB",
        f"  activations        {est.activations / GIB:8.2f} GiB  (rows of train.max_seq_len; attention scores: "
        f"{est.attention_scores / GIB:.2f} GiB)",
        f"  response logits    {est.logits / GIB:8.2f} GiB",
        f"  total (+10%)       {est.total / GIB:8.2f} GiB",
    ]
    fits = True
    if device_memory_gb:
        fits = est.total <= device_memory_gb * GIB
        lines.append(f"  device memory      {device_memory_gb:8.2f} GiB -> "
                     f"{'fits' if fits else 'DOES NOT FIT'}")
        if not fits:
            hints = []
            if qcfg.remat == "none":
                hints.append("model.remat=full")
            if est.logits > 0.2 * est.total and t.logits_chunk == 0 and t.vocab_chunk == 0:
                hints.append("train.vocab_chunk=8192")
            if est.attention_scores > 0.3 * est.total:
                hints.append("fewer train.microbatch_rows or a shorter train.max_seq_len "
                             "(dense attention scores grow with T^2)")
            if est.params + est.grads + est.optimizer > 0.5 * device_memory_gb * GIB:
                hints.append("more devices on mesh.fsdp")
            if hints:
                lines.append("  try: " + "; ".join(hints))
    else:
        lines.append("  device memory      unknown (set mesh.device_memory_gb to compare)")
    return "\n".join(lines), fits
