"""Collective traffic of a compiled XLA program, read from its optimized HLO text.

Counts every all-reduce / all-gather / all-to-all / ragged-all-to-all / reduce-scatter / collective-permute
(sync, or the -start half of an async pair) with its operand and result bytes per device. Operand shapes
come from the defining instructions (the optimized HLO prints operands by name only).

The count is static: an op inside a while body is counted once, and an op inside a conditional branch is
counted although the branch may not run. Each op records where it sits: `loop` (inside a while body, may
run several times per call; `trips` = the product of the known trip counts XLA recorded, else 1) and
`conditional` (inside a branch); `total_*` counts every op once, `unconditional_*` leaves out ops that only
run in some branch (e.g. the sampling path when decoding greedily), `executed_*` = unconditional ops times
their trips (the bytes one call moves when no branch with collectives runs).
"""

from __future__ import annotations

import re
from collections import defaultdict

KINDS = ("all-reduce", "all-gather", "all-to-all", "ragged-all-to-all", "reduce-scatter", "collective-permute",
         "collective-broadcast")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
          "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "s4": 0.5, "u4": 0.5, "f8e4m3fn": 1, "f8e5m2": 1}
_SHAPE = re.compile(r"\b(pred|[suf]\d+|bf16|c64|c128|f8e4m3fn|f8e5m2)\[([\d,]*)\]")
_DEF = re.compile(r"^\s*(?:ROOT\s+)?(%[\w.\-]+)\s*=\s*(.*)$")
_COMP = re.compile(r"^(ENTRY\s+)?(%[\w.\-]+)\s.*\{\s*$")  # computation headers are not indented
_OPNAME = re.compile(r"^(.*?)\s([a-z][\w\-]*)\((.*)$")
_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
_CALLS = re.compile(r"\b(calls|to_apply|body|condition|true_computation|false_computation|branch_computations)="
                    r"(\{[^}]*\}|%[\w.\-]+)")


def _shape_bytes(text: str) -> int:
    total = 0.0
    for dt, dims in _SHAPE.findall(text):
        n = 1
        for d in dims.split(","):
            if d:
                n *= int(d)
        total += n * _BYTES.get(dt, 4)
    return int(total)


def _args(rest: str) -> str:
    depth = 1
    for i, ch in enumerate(rest):
        depth += ch == "("
        depth -= ch == ")"
        if depth == 0:
            return rest[:i]
    return rest


def collectives(hlo_text: str) -> dict:
    """-> {"ops": [{kind, name, result_bytes, operand_bytes, loop, conditional, trips, op_name}], "by_kind": {kind: {count,
    operand_bytes, result_bytes}}, "total_operand_bytes", "total_result_bytes", "unconditional_operand_bytes",
    "unconditional_result_bytes"} (bytes per device, static count)."""
    shapes: dict[str, str] = {}
    comp_of: dict[str, str] = {}
    edges: dict[str, list[tuple[str, str, int]]] = defaultdict(list)  # computation -> [(edge, callee, trips)]
    found = []
    comp, entry = None, None
    for line in hlo_text.splitlines():
        mc = _COMP.match(line)
        if mc:
            comp = mc.group(2)
            if mc.group(1):
                entry = comp
            continue
        md = _DEF.match(line)
        if not md:
            continue
        name, rhs = md.groups()
        mo = _OPNAME.match(rhs)
        if not mo:
            continue
        result, op, rest = mo.groups()
        shapes[name] = result
        comp_of[name] = comp
        mt = _TRIPS.search(rest)
        trips = int(mt.group(1)) if mt else 1
        for kind, target in _CALLS.findall(rest):
            for callee in re.findall(r"%[\w.\-]+", target):
                edges[comp].append((kind, callee, trips if kind == "body" else 1))
        base = op[:-6] if op.endswith("-start") else op
        if base in KINDS:
            mn = re.search(r'op_name="([^"]*)"', rest)
            found.append((name, base, result, _args(rest), mn.group(1) if mn else ""))
    # Which computations run inside a while body / a conditional branch (transitively).
    flags: dict[str, tuple[bool, bool, int]] = {}
    stack = [(entry, False, False, 1)] if entry else []
    while stack:
        c, loop, cond, mult = stack.pop()
        old = flags.get(c)
        if old is not None:  # reached by several call sites: conditional only if every path is
            new = (old[0] or loop, old[1] and cond, max(old[2], mult))
            if new == old:
                continue
            loop, cond, mult = new
        flags[c] = (loop, cond, mult)
        for kind, callee, trips in edges.get(c, []):
            stack.append((callee, loop or kind in ("body", "condition"),
                          cond or kind in ("true_computation", "false_computation", "branch_computations"),
                          mult * trips))
    ops = []
    for name, kind, result, args, op_name in found:
        operand_bytes = sum(_shape_bytes(shapes.get(a, "")) for a in re.findall(r"%[\w.\-]+", args))
        loop, cond, mult = flags.get(comp_of.get(name), (False, False, 1))
        ops.append({"kind": kind, "name": name, "result_bytes": _shape_bytes(result),
                    "operand_bytes": operand_bytes, "loop": loop, "conditional": cond, "trips": mult,
                    "op_name": op_name})
    by_kind: dict = defaultdict(lambda: {"count": 0, "operand_bytes": 0, "result_bytes": 0})
    for o in ops:
        k = by_kind[o["kind"]]
        k["count"] += 1
        k["operand_bytes"] += o["operand_bytes"]
        k["result_bytes"] += o["result_bytes"]
    unc = [o for o in ops if not o["conditional"]]
    return {"ops": ops, "by_kind": dict(by_kind),
            "total_operand_bytes": sum(o["operand_bytes"] for o in ops),
            "total_result_bytes": sum(o["result_bytes"] for o in ops),
            "unconditional_operand_bytes": sum(o["operand_bytes"] for o in unc),
            "unconditional_result_bytes": sum(o["result_bytes"] for o in unc),
            # per call: loop bodies times their known trip count, branches left out
            "executed_operand_bytes": sum(o["operand_bytes"] * o["trips"] for o in unc),
            "executed_result_bytes": sum(o["result_bytes"] * o["trips"] for o in unc)}


def compiled_collectives(compiled) -> dict:
    """collectives() of a jax `Compiled` (jax.jit(f).lower(...).compile())."""
    return collectives(compiled.as_text())
