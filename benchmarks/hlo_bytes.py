"""Bytes a compiled program moves, walked over its optimized HLO with in-place updates and
indexed reads counted as what they touch.

XLA's HloCostAnalysis ("bytes accessed") counts every operand of a fusion in full. For the
engine that is wrong where it matters: a row scatter into the page pool (in place: the pool is
donated and aliased) is costed as reading and writing the whole pool, and a gather of a
slot's pages as reading the whole pool. This walk reads the program the compiler produced
(its fusions, its copies) and counts, per executed instruction (the entry and loop bodies,
each once, as XLA does; fusion bodies are not executed on their own):

- output bytes, plus each operand's bytes, except
- a fusion parameter used only as the operand of a gather / (dynamic-)slice: the bytes those
  read (their outputs);
- the in-place target of a scatter / dynamic-update-slice at a fusion's root (or bare): not
  read, and the output counted as the update's bytes;
- a fusion that only slices and bitcasts (an unrolled layer's view of the stacked weights or
  cache, which the CPU compiler materializes): nothing, its consumer counts what it reads;
- an asynchronous fusion (`fusion-start` / `fusion-done`, jaxlib 0.11's XLA:GPU): once, as
  the fusion it runs, with the done's shape as its output.

A conditional runs one branch. `branches="all"` counts every branch (an upper figure);
`branches="cheapest"` follows each conditional's cheapest branch: the common path of programs
whose `lax.cond`s are rare fallbacks (the token chooser's full-vocabulary path, the checked
head's float32 head), which the walk would otherwise charge every step.

A model over the compiler's program, not a device measurement (benchmarks/engine_cost.py).
"""

from __future__ import annotations

import math
import re

from actionopd_jax.aot.hlo_text import computation_header, instruction

_SIZES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4, "s32": 4, "u32": 4,
          "f64": 8, "s64": 8, "u64": 8}
_ARRAY = re.compile(r"^(\w+)\[([\d,]*)\]")
_OPERAND = re.compile(r"%([\w.\-]+)")
_SKIP = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "while", "conditional", "call",
         "after-all", "partition-id", "replica-id", "iota"}
_INPLACE = {"scatter", "dynamic-update-slice"}
_INDEXED = {"gather", "dynamic-slice", "slice"}


def _bytes(shape: str) -> int:
    m = _ARRAY.match(shape)
    if not m or m.group(1) not in _SIZES:
        return 0
    dims = m.group(2)
    return math.prod(int(d) for d in dims.split(",")) * _SIZES[m.group(1)] if dims else _SIZES[m.group(1)]


def _parse(text: str) -> tuple[dict, dict, str]:
    """{computation: [(name, bytes, op, operands, attrs, is_root)]}, {computation: [(op, [called])]}
    (the computations a while / call / conditional of it runs), entry."""
    comps, calls, entry, cur = {}, {}, "", None
    for line in text.splitlines():
        h = computation_header(line)
        if h:
            cur = h[0]
            comps[cur], calls[cur] = [], []
            if h[1]:
                entry = cur
            continue
        parsed = instruction(line)
        if parsed is None or cur is None:
            continue
        name, shape, op, rest = parsed
        args, _, attrs = rest.partition(")")
        comps[cur].append((name, _bytes(shape), op, _OPERAND.findall(args), attrs, "ROOT " in line))
        if op not in ("while", "call", "conditional"):
            continue
        called = [a.group(1) for key in ("body", "condition", "to_apply", "true_computation", "false_computation")
                  if (a := re.search(rf"{key}=%?([\w.\-]+)", attrs))]
        b = re.search(r"branch_computations=\{([^}]*)\}", attrs)
        if b:
            called += [x.strip().lstrip("%") for x in b.group(1).split(",")]
        calls[cur].append((op, called))
    return comps, calls, entry


def _executed(comps: dict, calls: dict, entry: str, branches: str) -> set:
    """The computations one pass runs (each once, as XLA's cost analysis counts a loop body):
    from the entry through while / call and every branch of a conditional ("all"), or each
    conditional's cheapest branch ("cheapest": by its own walk, what it runs included)."""
    def walk(comp: str, seen: set) -> None:
        if comp in seen:
            return
        seen.add(comp)
        for op, called in calls.get(comp, []):
            if op == "conditional" and branches == "cheapest" and len(called) > 1:
                called = [min(called, key=lambda c: sum(b for b, _ in _instructions(comps, walk_from(c))))]
            for c in called:
                walk(c, seen)

    def walk_from(comp: str) -> set:
        seen: set = set()
        walk(comp, seen)
        return seen

    return walk_from(entry)


def _fusion_cost(body: list, out_bytes: int) -> int:
    if all(i[2] in ("parameter", "slice", "bitcast") for i in body):
        return 0                            # a view (an unrolled layer's slice of stacked weights or cache)
    by_name = {i[0]: i for i in body}
    users: dict[str, list] = {i[0]: [] for i in body if i[2] == "parameter"}
    origin = {p: p for p in users}          # a bitcast of a parameter is that parameter
    for name, size, op, ops, attrs, root in body:
        if op == "bitcast" and ops and ops[0] in origin:
            origin[name] = origin[ops[0]]
            continue
        for k, o in enumerate(ops):
            if o in origin:
                users[origin[o]].append((op, k, size))
    root = next((i for i in body if i[5]), None)
    total, target = out_bytes, None
    if root is not None and root[2] in _INPLACE and root[3]:
        target = origin.get(root[3][0], root[3][0])
        update = by_name.get(root[3][-1] if root[2] == "scatter" else root[3][1])
        total = 2 * (update[1] if update else 0)           # the rows written (and the update read)
    for name, us in users.items():
        if name == target or (us and all(u[0] in _INPLACE and u[1] == 0 for u in us)):
            continue
        if us and all(u[0] in _INDEXED and u[1] == 0 for u in us):
            total += sum(u[2] for u in us)
        else:
            total += by_name[name][1]
    return total


def program_bytes(text: str, branches: str = "all") -> float:
    """Bytes moved by one pass over the executed computations (module docstring)."""
    return float(sum(b for b, _ in instruction_bytes(text, branches)))


def instruction_bytes(text: str, branches: str = "all") -> list[tuple[int, str]]:
    """[(bytes, "computation/instruction opcode")] of every executed instruction, largest first;
    `branches`: "all" or "cheapest" (module docstring)."""
    if branches not in ("all", "cheapest"):
        raise ValueError(f'branches must be "all" or "cheapest", not {branches!r}')
    comps, calls, entry = _parse(text)
    return sorted(_instructions(comps, _executed(comps, calls, entry, branches)), reverse=True)


def _instructions(comps: dict, executed: set) -> list[tuple[int, str]]:
    sizes = {i[0]: i[1] for body in comps.values() for i in body}
    # an asynchronous fusion (jaxlib 0.11's XLA:GPU: fusion-start / fusion-done) is counted once,
    # at its done, whose shape is the fusion's result, as the fusion it runs
    started = {i[0]: i[4] for body in comps.values() for i in body if i[2] == "fusion-start"}
    out = []
    for comp in executed:
        for name, size, op, ops, attrs, root in comps.get(comp, []):
            if op in _SKIP or op == "fusion-start":
                continue
            if op == "fusion-done" and ops and ops[0] in started:
                op, attrs = "fusion", started[ops[0]]
            if op == "fusion":
                called = re.search(r"calls=%?([\w.\-]+)", attrs)
                body = comps.get(called.group(1), []) if called else []
                b = _fusion_cost(body, size)
            elif op in _INPLACE:
                b = 2 * sizes.get(ops[-1] if op == "scatter" else ops[1], 0)
            elif op in _INDEXED:
                b = 2 * size
            else:
                b = size + sum(sizes.get(o, 0) for o in ops)
            out.append((b, f"{comp}/{name} {op}"))
    return out


__all__ = ["instruction_bytes", "program_bytes"]
