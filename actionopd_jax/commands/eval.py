"""`actionopd eval`: the evaluation harness (eval/cli.py), given the config front end so that
`--config RECIPE` reads the recipe's eval: section (with its base: chain and checks)."""

from __future__ import annotations


def load_eval_section(path: str):
    from actionopd_jax.config.load import load_config

    return load_config(path).eval


def main(argv: list[str]) -> int:
    from actionopd_jax.eval.cli import main as eval_main

    return eval_main(argv, load_section=load_eval_section)
