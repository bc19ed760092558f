"""`actionopd tokenizer`: build a tokenizer directory offline.

  actionopd tokenizer --qwen3 OUT_DIR          real Qwen3 vocabulary (151,669 ids) + our chat template
  actionopd tokenizer --tiny OUT_DIR [--vocab-size 2048]   small BPE for tests / the tiny CPU job
"""

from __future__ import annotations

import argparse
import sys
import time


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="actionopd tokenizer", description=__doc__.split("\n\n")[0])
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--qwen3", metavar="OUT_DIR", help="build the offline Qwen3 tokenizer into OUT_DIR")
    which.add_argument("--tiny", metavar="OUT_DIR", help="train the tiny tokenizer into OUT_DIR")
    parser.add_argument("--vocab-size", type=int, default=2048, help="total ids of the tiny tokenizer (default 2048)")
    return parser


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    from actionopd_jax.chat.tiny_tokenizer import build_tiny_tokenizer
    from actionopd_jax.chat.tokenizer import build_qwen3_tokenizer, load_tokenizer

    start = time.perf_counter()
    try:
        if args.qwen3:
            path = build_qwen3_tokenizer(args.qwen3)
        else:
            path = build_tiny_tokenizer(args.tiny, vocab_size=args.vocab_size)
    except (OSError, ValueError, ImportError) as err:
        print(f"actionopd tokenizer: {err}", file=sys.stderr)
        return 1
    tok = load_tokenizer(path)
    print(f"wrote {path} ({len(tok)} ids, eos {tok.eos_token!r}={tok.eos_token_id}, "
          f"{time.perf_counter() - start:.1f}s)")
    return 0
