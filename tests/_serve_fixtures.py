"""A tiny model trained (in seconds) to answer two fixed conversations, one with a tool call,
so the server tests see real tool-call parsing on real generated tokens; and `served`, that
model behind a loopback server (import it into the test files that use it)."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from actionopd_jax.chat import build_tiny_tokenizer, load_tokenizer, render_ids
from actionopd_jax.engine import Engine, EngineConfig
from actionopd_jax.model import Qwen3
from actionopd_jax.sampling.loading import end_token_ids
from actionopd_jax.serve.model_backend import ModelBackend
from actionopd_jax.serve.openai_http import OpenAIServer
from actionopd_jax.testing.tiny_checkpoint import tiny_config

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TOOL_CONVERSATION = [{"role": "user", "content": "What is the weather in Paris?"}]
TOOL_REPLY = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>'
CHAT_CONVERSATION = [{"role": "user", "content": "Say hello."}]
CHAT_REPLY = "Hello! How can I help you today?<|im_end|>"
MAX_CONTEXT = 384


def build_tokenizer(tmp: Path):
    return load_tokenizer(build_tiny_tokenizer(tmp / "tokenizer"))


def trained_model(tokenizer, *, seed: int = 0, max_steps: int = 300) -> Qwen3:
    """Fit a tiny Qwen3 to the two replies (cross-entropy on reply tokens only) until the
    loss is below 0.03 (about 80 steps)."""
    examples = [(render_ids(tokenizer, TOOL_CONVERSATION, [WEATHER_TOOL]), TOOL_REPLY),
                (render_ids(tokenizer, CHAT_CONVERSATION), CHAT_REPLY)]
    seqs, masks = [], []
    for prompt, reply in examples:
        reply_ids = np.asarray(tokenizer.encode(reply, add_special_tokens=False), np.int32)
        seqs.append(np.concatenate([prompt, reply_ids]))
        masks.append(np.concatenate([np.zeros(prompt.size, bool), np.ones(reply_ids.size, bool)]))
    length = max(s.size for s in seqs)
    tokens = np.zeros((len(seqs), length), np.int32)
    loss_mask = np.zeros((len(seqs), length), bool)
    for i, (s, m) in enumerate(zip(seqs, masks)):
        tokens[i, :s.size], loss_mask[i, :m.size] = s, m
    cfg = tiny_config(vocab_size=len(tokenizer), max_position_embeddings=MAX_CONTEXT)
    model = Qwen3(cfg, rngs=nnx.Rngs(params=seed))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    positions = np.broadcast_to(np.arange(length), tokens.shape)

    @nnx.jit
    def step(model, optimizer, tokens, positions, loss_mask):
        def loss_fn(model):
            hidden, _ = model(tokens[:, :-1], positions[:, :-1])
            logp = jax.nn.log_softmax(model.logits(hidden), -1)
            nll = -jnp.take_along_axis(logp, tokens[:, 1:, None], -1)[..., 0]
            return (nll * loss_mask[:, 1:]).sum() / loss_mask[:, 1:].sum()
        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    for i in range(max_steps):
        loss = step(model, optimizer, tokens, positions, loss_mask)
        if i % 10 == 9 and float(loss) < 0.03:
            break
    assert float(loss) < 0.03, f"fixture model did not fit its two replies (loss {float(loss):.3f})"
    return model


SEGMENT = 8  # decode steps per engine segment: short, so the streaming tests see many
SHAPES = EngineConfig(slots=4, page_size=16, max_len=MAX_CONTEXT, chunk=128, prefill_lanes=2, segment=SEGMENT)


# Each module that imports `served` registers its own copy of the fixture, so the session scope
# alone would still build once per file: _SERVED keeps the first build for the process, and
# test_serve_model.py and test_serve_streaming.py share one trained model and one server when
# they run in the same process (under --dist loadfile each file is one unit of work).
_SERVED: list = []


@pytest.fixture(scope="session")
def served(tmp_path_factory):
    """(server, the "tiny-student" backend, tokenizer); the server also serves "endless"."""
    if _SERVED:  # built by another module's copy of this fixture, which closes it at session end
        yield _SERVED[0]
        return
    tokenizer = build_tokenizer(tmp_path_factory.mktemp("serve"))
    model = trained_model(tokenizer)
    eos = end_token_ids(tokenizer)
    backend = ModelBackend(Engine(model, eos_ids=eos, config=SHAPES), tokenizer, model_name="tiny-student",
                           default_max_tokens=48)
    # end ids past the vocabulary are never sampled; as many as the real ones, so both engines
    # run the same compiled programs
    never = [len(tokenizer) + k for k in range(len(eos))]
    endless = ModelBackend(Engine(model, eos_ids=never, config=SHAPES), tokenizer, model_name="endless")
    with OpenAIServer([backend, endless]) as server:
        _SERVED.append((server, backend, tokenizer))
        try:
            yield _SERVED[0]
        finally:
            _SERVED.clear()
