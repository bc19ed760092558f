"""`actionopd serve`: an OpenAI-compatible chat-completions server over a checkpoint.

    actionopd serve --hf DIR [--port 8000] [--api-key-env ACTIONOPD_API_KEY]
    actionopd serve --checkpoint RUN_DIR [--step N] [--dtype bfloat16] --mesh tensor=-1
    actionopd serve --hf DIR --lm-head float32    # exact float32 logprob normalisers
    actionopd serve --hf DIR --engine-slots 16 --engine-max-len 16384 --segment-tokens 16

Generation runs through the continuous-batching engine (requests join and leave between
segments, `stream: true` sends tokens as segments end); `--sampler static` uses the batched
static sampler instead (the same samples; streams once a reply is finished).

Binds 127.0.0.1 unless --host says otherwise. With --api-key-env NAME, clients must send
`Authorization: Bearer $NAME`. SIGTERM or Ctrl-C: requests in flight finish (or are
cancelled after 10 s), then it exits 0.
"""

from __future__ import annotations

import argparse
import secrets
import sys
import tempfile
from pathlib import Path

from actionopd_jax.sampling.cli import add_model_args, resolve_model
from actionopd_jax.serve.openai_http import _exit_now


def parse_mesh(text: str) -> dict[str, int]:
    """'data=1,tensor=-1' -> {"data": 1, "tensor": -1}."""
    shape = {}
    for part in text.split(","):
        name, _, size = part.partition("=")
        try:
            shape[name.strip()] = int(size)
        except ValueError:
            raise argparse.ArgumentTypeError(f"--mesh wants axis=size[,axis=size], got {text!r}") from None
    return shape


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="actionopd serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key-env", metavar="NAME", help="environment variable holding the bearer token")
    p.add_argument("--model-name", help="model id clients send (default: the directory name)")
    p.add_argument("--max-context", type=int, help="prompt + completion tokens (default: the model's)")
    p.add_argument("--default-max-tokens", type=int, default=1024)
    p.add_argument("--max-body-mb", type=float, default=8.0,
                   help="larger request bodies get a 413 before they are parsed (default 8)")
    p.add_argument("--shutdown-grace", type=float, default=10.0,
                   help="seconds requests in flight get to finish after SIGTERM / Ctrl-C before they are cancelled")
    p.add_argument("--max-large-bodies", type=int, default=2,
                   help="request bodies over 1 MiB read, parsed and tokenized at once; more wait unread "
                        "(default 2)")
    p.add_argument("--batch-window-ms", type=float, default=5.0,
                   help="how long a request waits for others to share its device call")
    p.add_argument("--no-warmup", action="store_true",
                   help="skip the warm-up request that compiles the programs before the port reports ready")
    p.add_argument("--sampler", choices=("engine", "static"), default="engine",
                   help="engine (default): continuous batching, requests join and leave between segments and "
                        "stream token by token; static: batched calls of the static sampler, streamed at the end")
    p.add_argument("--engine-slots", type=int, default=8, help="requests' samples the engine decodes together")
    p.add_argument("--engine-max-len", type=int,
                   help="prompt + reply tokens one engine slot holds (sizes the page pool; caps --max-context); "
                        "default: the model's own context (max_position_embeddings)")
    p.add_argument("--segment-tokens", type=int,
                   help="new tokens per device call (default 16 with the engine, 256 static): a disconnected "
                        "client's request stops within one segment, new requests join between segments, and "
                        "streamed text arrives segment by segment")
    p.add_argument("--mesh", type=parse_mesh, help="shard over local devices, e.g. tensor=-1 or fsdp=2,tensor=4")
    p.add_argument("--enable-thinking", action="store_true", help="default for chat_template_kwargs.enable_thinking")
    p.add_argument("--default-temperature", type=float,
                   help="temperature for requests that send none (default: OpenAI's 1.0); 0 is greedy")
    p.add_argument("--default-top-p", type=float, help="top_p for requests that send none (default 1.0)")
    p.add_argument("--default-top-k", type=int, help="top_k for requests that send none (default 0: off)")
    p.add_argument("--max-tokens-cap", type=int,
                   help="no reply is longer than this many tokens, whatever max_tokens a request asks "
                        "(finish_reason 'length' when reached); it also replaces --default-max-tokens when lower")
    p.add_argument("--task-max-messages", type=int,
                   help="per task (named by each request's `user` field): refuse a request whose conversation "
                        "already holds this many messages (paper B.3, ToolSandbox: 30; serve/task_limits.py)")
    p.add_argument("--task-max-output-tokens", type=int,
                   help="per task (named by each request's `user` field): output tokens all its replies may take "
                        "together; each reply is cut to what is left (paper B.3, AppWorld: 100,000)")
    p.add_argument("--seed", type=int, help="init seed of the --tiny model (default: random)")
    p.add_argument("--lm-head", choices=("checked", "float32", "bfloat16"), default="checked",
                   help="decode-step LM head: checked (default; float32 tokens, bf16 speed on CPU), "
                        "float32 (exact logprob normalisers), bfloat16 (rounded head)")
    return p


def _sampler(args: argparse.Namespace, cfg, model, tokenizer, mesh):
    """The engine (default) or the static sampler, as the flags say."""
    from actionopd_jax.sampling import Sampler
    from actionopd_jax.sampling.loading import end_token_ids

    if args.sampler == "static":
        return Sampler(model, cfg, eos_ids=end_token_ids(tokenizer), mesh=mesh, lm_head=args.lm_head)
    from actionopd_jax.engine import Engine, EngineConfig

    # the model's own context unless narrowed (issue 43 item 2: a fixed 8,192 left ToolSandbox and
    # AppWorld prompts over ~4k without table 8's 4k reply); a CPU pool is bounded by host memory
    max_len = min(args.engine_max_len or cfg.max_position_embeddings, args.max_context or cfg.max_position_embeddings,
                  cfg.max_position_embeddings)
    if args.engine_slots < 1 or max_len < 1 or (args.segment_tokens is not None and args.segment_tokens < 1):
        raise ValueError("--engine-slots, --engine-max-len and --segment-tokens must be >= 1")
    shapes = EngineConfig(slots=args.engine_slots, max_len=max_len, chunk=min(256, max_len),
                          segment=args.segment_tokens or 16)
    return Engine(model, cfg, eos_ids=end_token_ids(tokenizer), mesh=mesh, config=shapes, lm_head=args.lm_head)


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    from actionopd_jax.compile_cache import enable_compile_cache
    enable_compile_cache()  # persistent XLA compile cache (JAX_COMPILATION_CACHE_DIR or the default)
    from actionopd_jax.model import make_mesh
    from actionopd_jax.sampling.loading import model_name_of
    from actionopd_jax.serve.model_backend import ModelBackend, RequestDefaults
    from actionopd_jax.serve.openai_http import OpenAIServer

    mesh = make_mesh(args.mesh) if args.mesh else None
    loaded: dict = {}   # what was loaded (a checkpoint's step, a fallback): /v1/models says it
    with tempfile.TemporaryDirectory(prefix="actionopd-serve-") as tmp:
        try:
            cfg, model, tokenizer = resolve_model(args, Path(tmp), seed=args.seed if args.seed is not None
                                                  else secrets.randbits(31), mesh=mesh, record=loaded)
        except (FileNotFoundError, ValueError) as e:
            print(f"actionopd serve: {e}", file=sys.stderr)
            return 2
        name = args.model_name or ("tiny" if args.tiny else model_name_of(args.hf or args.checkpoint))
        try:  # ValueError: --max-context beyond the model's context, an unset --api-key-env variable
            sampler = _sampler(args, cfg, model, tokenizer, mesh)
            if args.max_tokens_cap is not None and args.max_tokens_cap < 1:
                raise ValueError(f"--max-tokens-cap must be >= 1, got {args.max_tokens_cap}")
            defaults = RequestDefaults(temperature=args.default_temperature, top_p=args.default_top_p,
                                       top_k=args.default_top_k, max_tokens_cap=args.max_tokens_cap)
            backend = ModelBackend(sampler, tokenizer, model_name=name, max_context=args.max_context,
                                   default_max_tokens=args.default_max_tokens,
                                   batch_window_s=args.batch_window_ms / 1000.0, enable_thinking=args.enable_thinking,
                                   segment_tokens=args.segment_tokens or 256, defaults=defaults)
            backend.source = dict(loaded)
            if not args.no_warmup:
                print(f"warm-up: the first request's programs compiled in {backend.warm_up():.1f} s", flush=True)
            served = backend
            if args.task_max_messages is not None or args.task_max_output_tokens is not None:
                from actionopd_jax.serve.task_limits import TaskLimitedBackend

                served = TaskLimitedBackend(backend, max_messages=args.task_max_messages,
                                            max_output_tokens=args.task_max_output_tokens)
            server = OpenAIServer(served, host=args.host, port=args.port, api_key_env=args.api_key_env,
                                  max_body_bytes=int(args.max_body_mb * 1024 * 1024),
                                  max_large_bodies=args.max_large_bodies, shutdown_grace_s=args.shutdown_grace)
        except ValueError as e:
            print(f"actionopd serve: {e}", file=sys.stderr)
            return 2
        try:
            server.serve_forever()
        finally:
            # the generation thread ends before the interpreter does: ended by it mid-segment,
            # the device runtime aborts the process (SIGABRT after a clean shutdown, issue 34)
            if not backend.close(timeout_s=30.0):
                _exit_now("the engine was still generating 30 s after the server stopped: exiting")
    return 0


if __name__ == "__main__":  # `python -m actionopd_jax.serve.cli` (launch/benchmark_harness.py starts it so)
    sys.exit(main(sys.argv[1:]))
