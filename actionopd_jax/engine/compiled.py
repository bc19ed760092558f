"""The engine's compiled programs: one per (kind, weights' graph, argument shapes, static
settings, backend), shared by every engine in the process (a new engine per collection run, and
the tests, compile once), and looked up per engine by kind while its weights stay the same."""

from __future__ import annotations

import contextlib
import functools
import time
from typing import Any

import jax

import actionopd_jax.sampling.cpu_backend as cpu_backend
from actionopd_jax.sampling.sampler import CompileStats, _signature
from actionopd_jax.jax_compat import set_mesh

_PROGRAMS: dict[tuple, Any] = {}


class Programs:
    """backend: the engine's decode backend ("cpu" gets the CPU compiler options); mesh: traced
    under when given (a callable, read at compile time: load_policy may change it)."""

    def __init__(self, backend: str, mesh):
        self.backend, self.mesh = backend, mesh
        # XLA options beside the backend's own, part of every program's key: a profile compiles
        # with command buffers off (benchmarks/device_check_split.py); empty for every run
        self.options: dict[str, str] = {}
        self.stats = CompileStats()
        self._local: dict[str, tuple] = {}

    def run(self, kind: str, fn, args: tuple, static: dict, *, weights, donate=()):
        """fn(*args, **static) compiled once; args[0] is the graphdef (static). `weights`: the
        identity of the parameter arrays: while it is the same, the program found for `kind` is
        the one (the other arguments' shapes are the engine's own; hashing the graphdef and pool
        costs host time per call)."""
        mine = self._local.get(kind)
        if mine is not None and mine[0] == weights:
            return mine[1](*args[1:])
        program = self.compile(kind, fn, args, static, donate=donate)
        self._local[kind] = (weights, program)
        return program(*args[1:])

    def compile(self, kind: str, fn, args: tuple, static: dict, *, donate=()):
        """fn(*args, **static) compiled once per process (counted in `stats` when compiled);
        any of `args` may be abstract (jax.ShapeDtypeStruct, nothing allocated for it: the pool
        sizing compiles against a pool not allocated yet, engine/pool_fit.py), and a later
        `run` with concrete arguments of the same shapes, dtypes and placement finds it."""
        key = (kind, args[0], _signature(args[1:]), tuple(sorted(static.items())), self.backend,
               tuple(sorted(self.options.items())))
        program = _PROGRAMS.get(key)
        if program is not None:
            return program
        t0 = time.perf_counter()
        options = {**dict(cpu_backend.compiler_options("decode" if kind.startswith("segment") else "prefill")
                          if self.backend == "cpu" else ()), **self.options}
        jitted = jax.jit(_named(kind, fn, static), static_argnums=(0,), donate_argnums=donate)
        mesh = self.mesh()
        with set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
            program = jitted.lower(*args).compile(compiler_options=dict(options))
        took = time.perf_counter() - t0
        self.stats.programs += 1
        self.stats.seconds += took
        self.stats.shapes.append((kind, round(took, 2)))
        _PROGRAMS[key] = program
        return program


def _named(kind: str, fn, static: dict):
    """fn(*args, **static) named `kind`: the compiled module is then jit_<kind>, so a profile (or
    an out-of-memory message) tells the engine's programs apart, a fresh prefill chunk from a
    continuing one and each row count's segment (all were jit_prefill_chunk / jit_segment)."""
    bound = functools.partial(fn, **static)

    def program(*args):
        return bound(*args)
    program.__name__ = program.__qualname__ = kind
    return program


__all__ = ["Programs"]
