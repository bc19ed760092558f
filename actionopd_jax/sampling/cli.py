"""`actionopd generate`: sample replies from a checkpoint (a smoke test of model + sampler).

    actionopd generate --hf DIR --prompt "What is 2+2?" [--n 2] [--temperature 0.7] [--seed 1]
    actionopd generate --checkpoint runs/<run> [--step N] [--dtype bfloat16] --prompt "Hi"
    actionopd generate --tiny        # tiny random model + tiny tokenizer in a temp dir
"""

from __future__ import annotations

import argparse
import secrets
import sys
import tempfile
import time
from pathlib import Path

from actionopd_jax.sampling.loading import build_tiny_demo, end_token_ids, load_model


def add_model_args(parser: argparse.ArgumentParser) -> None:
    """Model source options shared with `actionopd serve`."""
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--hf", metavar="DIR", help="Hugging Face Qwen3 directory (config.json + safetensors)")
    src.add_argument("--checkpoint", metavar="DIR",
                     help="training run directory, its checkpoints/ folder or one step folder (Orbax), "
                          "or an exported HF directory")
    src.add_argument("--tiny", action="store_true", help="tiny random model + tiny tokenizer (smoke test)")
    parser.add_argument("--tokenizer", metavar="DIR", help="tokenizer directory (default: the model directory)")
    parser.add_argument("--step", type=int, help="with --checkpoint RUN: the step to load (default: latest finished)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"),
                        help="parameter and compute dtype (default: as trained / as in config.json)")
    parser.add_argument("--allow-unverified", action="store_true",
                        help="with --checkpoint: load a step that has no checksum manifest (refused otherwise)")


def resolve_model(args, workdir: Path, *, seed: int, mesh=None, record: dict | None = None):
    """(cfg, model, tokenizer) for the options of add_model_args; `record`: loading.load_model's."""
    if args.tiny:
        model_dir, tok_dir = build_tiny_demo(workdir, seed=seed)
        return model_with_tokenizer(hf=model_dir, tokenizer=tok_dir, mesh=mesh, dtype=args.dtype)
    return model_with_tokenizer(hf=args.hf, checkpoint=args.checkpoint, tokenizer=args.tokenizer, mesh=mesh,
                                dtype=args.dtype, step=getattr(args, "step", None), record=record,
                                allow_unverified=getattr(args, "allow_unverified", False))


def model_with_tokenizer(*, hf=None, checkpoint=None, tokenizer=None, mesh=None, dtype=None, step=None, record=None,
                         allow_unverified=False):
    """(cfg, model, tokenizer): the model (load_model) and `tokenizer`, else the one next to the
    HF weights or the one the training run recorded. Shared by generate, serve and eval.
    `record`: see loading.load_model."""
    from actionopd_jax.chat import load_tokenizer

    cfg, model, recorded = load_model(hf=hf, checkpoint=checkpoint, mesh=mesh, dtype=dtype, step=step, record=record,
                                      allow_unverified=allow_unverified)
    tok_dir = Path(tokenizer) if tokenizer else recorded
    if tok_dir is None:
        raise ValueError(f"{checkpoint}: the run recorded no tokenizer (no <run>/tokenizer/, and its config "
                         "names none that still exists); pass --tokenizer DIR")
    tok = load_tokenizer(tok_dir)
    if len(tok) > cfg.vocab_size:
        raise ValueError(f"tokenizer in {tok_dir} has {len(tok)} ids but the model's vocabulary is "
                         f"{cfg.vocab_size}: they do not belong together (pass the right --tokenizer)")
    return cfg, model, tok


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="actionopd generate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.add_argument("--prompt", action="append", help="user message (repeat for several prompts)")
    p.add_argument("--system", help="system message")
    p.add_argument("--n", type=int, default=1, help="samples per prompt")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.7, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--seed", type=int, help="PRNG seed (default: random, printed)")
    p.add_argument("--thinking", action="store_true", help="let the model open a <think> block")
    return p


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    import jax

    from actionopd_jax.chat import render_ids
    from actionopd_jax.sampling.sampler import Sampler

    seed = args.seed if args.seed is not None else secrets.randbits(31)
    with tempfile.TemporaryDirectory(prefix="actionopd-generate-") as tmp:
        try:
            _, model, tokenizer = resolve_model(args, Path(tmp), seed=seed)
        except (FileNotFoundError, ValueError) as e:
            print(f"actionopd generate: {e}", file=sys.stderr)
            return 2
        prompts = args.prompt or ["Hello! What can you do?"]
        head = [{"role": "system", "content": args.system}] if args.system else []
        ids = [render_ids(tokenizer, head + [{"role": "user", "content": text}], enable_thinking=args.thinking)
               for text in prompts]
        sampler = Sampler(model, eos_ids=end_token_ids(tokenizer))
        t0 = time.perf_counter()
        try:
            result = sampler.sample(ids, n=args.n, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                    top_p=args.top_p, top_k=args.top_k, key=jax.random.key(seed))
        except ValueError as e:
            print(f"actionopd generate: {e}", file=sys.stderr)
            return 2
        seconds = time.perf_counter() - t0
    for text, gens in zip(prompts, result.generations):
        print(f"=== prompt: {text}")
        for j, g in enumerate(gens):
            reply = tokenizer.decode(g.token_ids.tolist(), skip_special_tokens=False)
            print(f"--- sample {j} ({len(g.token_ids)} tokens, {g.finish_reason})\n{reply}")
    print(f"[seed {seed}; {seconds:.2f} s incl. {sampler.stats.programs} compiled programs "
          f"({sampler.stats.seconds:.2f} s)]")
    return 0
