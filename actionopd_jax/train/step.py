"""The jitted, sharded train step: scan over microbatches, one division, one AdamW update.

State is a plain dict {"params": pure-dict params, "opt_state": optax state, "step": int32}
so that optimizers and checkpoints see ordinary pytrees; the model is rebuilt inside the
traced function with `nnx.merge(graphdef, params)`.

Shardings are explicit: parameters follow the model's logical-axis rules, optimizer moments
follow their parameters (`optax.tree_map_params`; `jit(tx.init)` alone can drop them),
scalars are replicated, and batch rows are split over the ("data", "fsdp") mesh axes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from actionopd_jax.model import LOGICAL_AXIS_RULES, param_shardings
from actionopd_jax.model.attention import SharedPrefix
from actionopd_jax.model.sharding import constrain
from actionopd_jax.train import losses as L
from actionopd_jax.train.head_logprobs import SCOPE as HEAD_SCOPE, head_logprobs
from actionopd_jax.jax_compat import set_mesh

ROW_AXES = ("data", "fsdp")
OPTIMIZER_SCOPE = "optimizer"   # the name scope of the AdamW update's ops in the compiled step
LOSS_KINDS = ("actionopd", "kd", "opd")


@dataclass(frozen=True)
class StepSettings:
    """Static choices baked into the compiled step."""

    loss: str = "actionopd"  # "actionopd" | "kd" | "opd"
    temperature: float = 1.0  # rollout temperature: logits / T before the full softmax
    clip_eps: float = 0.2
    dual_clip: float = 3.0
    logits_chunk: int = 0  # score response positions in chunks of this many (0: all at once)
    vocab_chunk: int = 0  # >0: fused LM head + log-softmax over vocabulary chunks (head_logprobs.py)
    # >0: rows are shared-prompt rows holding this many candidates (batching.pack_shared_minibatch)
    shared_prompt: int = 0

    def __post_init__(self):
        if self.loss not in LOSS_KINDS:
            raise ValueError(f"loss must be one of {LOSS_KINDS}, got {self.loss!r}")
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if self.shared_prompt < 0:
            raise ValueError(f"shared_prompt must be >= 0, got {self.shared_prompt}")
        if self.vocab_chunk < 0 or self.logits_chunk < 0:
            raise ValueError(f"vocab_chunk and logits_chunk must be >= 0, got {self.vocab_chunk}, "
                             f"{self.logits_chunk}")


def make_optimizer(*, lr: float, weight_decay: float = 0.0, b1: float = 0.9, b2: float = 0.999,
                   eps: float = 1e-8, grad_clip: float = 1.0, warmup_steps: int = 0
                   ) -> optax.GradientTransformation:
    """AdamW after global-norm clipping. Paper: constant lr 1e-6, no warmup (the default
    here when warmup_steps=0). The schedule counts optimizer updates, not collection steps."""
    schedule = lr if warmup_steps <= 0 else optax.linear_schedule(0.0, lr, warmup_steps)
    parts = [optax.clip_by_global_norm(grad_clip)] if grad_clip and grad_clip > 0 else []
    parts.append(optax.adamw(schedule, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay))
    return optax.chain(*parts)


def split_params(model: nnx.Module) -> tuple[Any, dict]:
    """(graphdef, pure-dict params). The model must hold nothing but Params."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    if jax.tree.leaves(rest):
        raise ValueError("the model holds non-Param state; the trainer only trains nnx.Param")
    return graphdef, nnx.to_pure_dict(params)


def response_logprobs(model, hidden: jax.Array, resp_index: jax.Array, resp_tokens: jax.Array,
                      temperature: float, chunk: int = 0, vocab_chunk: int = 0) -> jax.Array:
    """log pi(resp_tokens) [b, R] from hidden states [b, T, D]: gather the positions that
    predict response tokens, then the LM head on those only (never on prompt positions).
    vocab_chunk > 0 scores them with the fused head (never materialises [b, R, V] logits);
    otherwise `chunk` > 0 scores response positions `chunk` at a time."""
    h = jnp.take_along_axis(hidden, resp_index[..., None].astype(jnp.int32), axis=1)  # [b, R, D]
    h = constrain(h, ("batch", "length", "act_embed"))
    with jax.named_scope(HEAD_SCOPE):      # by name in the compiled step (train/time_split.py)
        return _head(model, h, resp_tokens, temperature, chunk, vocab_chunk)


def _head(model, h, resp_tokens, temperature, chunk, vocab_chunk):
    if vocab_chunk > 0:
        return head_logprobs(h, model.head_weight(), resp_tokens, temperature, chunk=vocab_chunk)

    def score(hh, tt):
        return L.token_logprobs(model.logits(hh), tt, temperature)

    b, r = resp_tokens.shape
    if chunk <= 0 or r <= chunk:
        return score(h, resp_tokens)
    if r % chunk:
        raise ValueError(f"response width {r} is not a multiple of logits_chunk={chunk}")
    n = r // chunk
    hc = h.reshape(b, n, chunk, -1).swapaxes(0, 1)
    tc = resp_tokens.reshape(b, n, chunk).swapaxes(0, 1)
    # recompute each chunk's [b, chunk, V] logits in the backward pass instead of keeping them
    out = jax.lax.map(lambda xs: jax.checkpoint(score)(*xs), (hc, tc))
    return out.swapaxes(0, 1).reshape(b, r)


class TrainStep:
    """Compiled update and old-logprob functions for one model graph on one mesh."""

    def __init__(self, graphdef, abstract_params: dict, mesh: Mesh, tx: optax.GradientTransformation,
                 settings: StepSettings, rules=LOGICAL_AXIS_RULES):
        self.graphdef = graphdef
        self.mesh = mesh
        self.tx = tx
        self.settings = settings
        self.abstract_params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                                            abstract_params)
        model_state = nnx.state(nnx.merge(graphdef, abstract_params))
        self.param_shardings = nnx.to_pure_dict(param_shardings(model_state, mesh, rules))
        replicated = NamedSharding(mesh, PartitionSpec())
        abstract_opt = jax.eval_shape(tx.init, abstract_params)
        self.opt_shardings = optax.tree_map_params(
            tx, lambda _, s: s, abstract_opt, self.param_shardings,
            transform_non_params=lambda _: replicated)
        self.state_shardings = {"params": self.param_shardings, "opt_state": self.opt_shardings,
                                "step": replicated}
        rows = tuple(a for a in ROW_AXES if a in mesh.axis_names)
        self.row_sharding = NamedSharding(mesh, PartitionSpec(None, rows or None))
        self.replicated = replicated
        self.rows_divisor = 1
        for a in rows:
            self.rows_divisor *= mesh.shape[a]

        self._init = jax.jit(self._init_impl, out_shardings=self.state_shardings)
        self._update = jax.jit(self._update_impl, donate_argnums=(0,),
                               out_shardings=(self.state_shardings, replicated))
        self._old_logp = jax.jit(self._old_logp_impl, out_shardings=(self.row_sharding, replicated))
        self._behav = jax.jit(lambda stale, sampler, old: jnp.where(stale > 0, sampler, old),
                              out_shardings=self.row_sharding)

    # ---- public API (each runs under the mesh so activation constraints apply) -------------
    def init_state(self, params: dict) -> dict:
        params = jax.device_put(params, self.param_shardings)
        with set_mesh(self.mesh):
            return self._init(params)

    def abstract_state(self) -> dict:
        """ShapeDtypeStructs with target shardings (for restoring a checkpoint onto this mesh)."""
        shapes = jax.eval_shape(self._init_impl, self.abstract_params)
        return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                            shapes, self.state_shardings)

    def update(self, state: dict, batch: dict) -> tuple[dict, dict]:
        """One optimizer update over the minibatch `batch` ([M, b, ...] arrays). `state` is
        donated: do not use it afterwards."""
        with set_mesh(self.mesh):
            return self._update(state, batch)

    def old_logprobs(self, params: dict, batch: dict) -> tuple[jax.Array, dict]:
        """Behaviour-policy logprobs [M, b, R] recomputed by this forward, and their mismatch
        with the sampler's logprobs (sums over active tokens)."""
        with set_mesh(self.mesh):
            return self._old_logp(params, batch)

    def add_behaviour(self, batch: dict) -> None:
        """Replace the batch's "stale" marks by behav_logp, the log-probs of the policy that
        sampled each token (asynchronous collection, issue 44): the sampler's recorded ones on
        stale rows, the recomputed old_logp elsewhere, so a fresh row's off-policy weight is
        exp(0) = 1 and its loss today's. Call after old_logp is set."""
        with set_mesh(self.mesh):
            batch["behav_logp"] = self._behav(batch.pop("stale"), batch["sampler_logp"], batch["old_logp"])

    def put_batch(self, local_arrays: dict) -> dict:
        """Host arrays [M, b_local, ...] of this process -> global arrays [M, b, ...]."""
        out = {}
        for name, x in local_arrays.items():
            global_shape = (x.shape[0], x.shape[1] * jax.process_count()) + x.shape[2:]
            out[name] = jax.make_array_from_process_local_data(self.row_sharding, x, global_shape)
        return out

    # ---- traced implementations ------------------------------------------------------------
    def _init_impl(self, params):
        return {"params": params, "opt_state": self.tx.init(params), "step": jnp.zeros((), jnp.int32)}

    def shared_prefix(self, seq_len: int, resp_len: int) -> SharedPrefix | None:
        """The packed-row layout of a [.., seq_len] batch with resp_len response columns."""
        n = self.settings.shared_prompt
        if not n:
            return None
        if resp_len % n:
            raise ValueError(f"{resp_len} response columns do not split into {n} regions")
        return SharedPrefix(prompt=seq_len - resp_len, response=resp_len // n, count=n)

    def _logp(self, params, mb):
        model = nnx.merge(self.graphdef, params)
        layout = self.shared_prefix(mb["tokens"].shape[-1], mb["resp_tokens"].shape[-1])
        hidden, _ = model(mb["tokens"], mb["positions"], attention_mask=mb["attention_mask"],
                          shared_prefix=layout)
        s = self.settings
        return response_logprobs(model, hidden, mb["resp_index"], mb["resp_tokens"], s.temperature,
                                 s.logits_chunk, s.vocab_chunk)

    def _microbatch_sums(self, params, mb) -> tuple[jax.Array, L.LossSums]:
        s = self.settings
        logp = self._logp(params, mb)
        if s.loss == "actionopd":
            # behav_logp only in batches of asynchronous collection (collect.max_staleness >= 1)
            sums = L.actionopd_sums(logp, mb["old_logp"], mb["advantages"], mb["loss_mask"],
                                    clip_eps=s.clip_eps, dual_clip=s.dual_clip, logp_behav=mb.get("behav_logp"))
        elif s.loss == "opd":
            sums = L.opd_sums(logp, mb["old_logp"], mb["teacher_logp"], mb["loss_mask"],
                              clip_eps=s.clip_eps, dual_clip=s.dual_clip)
        else:
            sums = L.kd_sums(logp, mb["loss_mask"])
        return sums.loss_sum, sums

    def _update_impl(self, state, batch):
        params = state["params"]
        grad_fn = jax.value_and_grad(self._microbatch_sums, has_aux=True)

        def body(carry, mb):
            g_acc, s_acc = carry
            (_, sums), g = grad_fn(params, mb)
            g_acc = jax.tree.map(lambda a, b: a + b.astype(jnp.float32), g_acc, g)
            g_acc = jax.lax.with_sharding_constraint(g_acc, self.param_shardings)
            return (g_acc, L.add_sums(s_acc, sums)), None

        zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
        zeros = jax.lax.with_sharding_constraint(zeros, self.param_shardings)
        (g_sum, sums), _ = jax.lax.scan(body, (zeros, L.zero_sums()), batch)
        # the one division: mean over the active tokens of the whole minibatch
        denom = jnp.maximum(sums.tokens, 1.0)
        grads = jax.tree.map(lambda g, p: (g / denom).astype(p.dtype), g_sum, params)
        with jax.named_scope(OPTIMIZER_SCOPE):     # by name in the compiled step (train/time_split.py)
            updates, new_opt = self.tx.update(grads, state["opt_state"], params)
            new_params = optax.apply_updates(params, updates)
        # a minibatch without active tokens must not move anything (paper A.4: empty batch
        # skips optimization; AdamW would otherwise still decay weights and moments)
        active = sums.tokens > 0
        keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(active, a, b), new, old)  # noqa: E731
        new_state = {"params": keep(new_params, params), "opt_state": keep(new_opt, state["opt_state"]),
                     "step": state["step"] + active.astype(jnp.int32)}
        tok = denom
        metrics = {
            "loss": L.mean_loss(sums),
            "tokens": sums.tokens,
            "grad_norm": optax.tree.norm(grads),
            "update_norm": optax.tree.norm(updates),
            "clip_frac_low": sums.clipped_low / tok,
            "clip_frac_high": sums.clipped_high / tok,
            "dual_clip_frac": sums.dual_clipped / tok,
            "ratio_mean": sums.ratio_sum / tok,
            "approx_kl": sums.approx_kl_sum / tok,
        }
        return new_state, metrics

    def _old_logp_impl(self, params, batch):
        logp = jax.lax.map(lambda mb: self._logp(params, mb), batch)
        mismatch = L.logprob_mismatch(logp, batch["sampler_logp"], batch["loss_mask"])
        return logp, mismatch

