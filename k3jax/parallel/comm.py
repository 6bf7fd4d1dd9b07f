"""Communication accounting read from compiled HLO: every collective, its buffer and its bytes per rank.

    report = collectives(jax.jit(f).lower(*args).compile().as_text())
    summary(report)  ->  {kind: {"count", "payload_bytes", "wire_bytes"}}

Nothing here knows the strategies: shapes, dtypes, replica groups and loop membership all come from
the HLO text. For each collective:

  payload_bytes  the bytes of the collective's buffer on one rank (the sum over a tuple's operands;
                 for all-gather the gathered result, for reduce-scatter the unreduced input)
  wire_bytes     the bytes one rank sends with the bandwidth-optimal algorithm for a group of g ranks
                 (the nccl-tests "bus bandwidth" convention):
                   all-reduce 2(g-1)/g * payload   all-gather / reduce-scatter (g-1)/g * payload
                   all-to-all (g-1)/g * payload (its own 1/g stays local)   collective-permute payload
  in_loop        the collective sits in a while body (per iteration; the trip count may be data
                 dependent, e.g. DEP's capacity rounds)
Async pairs (`-start` / `-done`) are counted once, at the start.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3": 1, "f8e8m0fnu": 1, "s4": 0.5, "u4": 0.5,
          "f4e2m1fn": 0.5, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8,
          "f64": 8, "c64": 8, "c128": 16}
_OP = re.compile(r"^\s*(?:ROOT\s+)?%(?P<name>[\w.\-]+)\s*=\s*(?P<type>.+?)\s+(?P<kind>" + "|".join(KINDS)
                 + r")(?P<start>-start)?\((?P<args>.*)$")
_ARRAY = re.compile(r"\b([a-z]+\d*[a-z0-9]*)\[([\d,]*)\]")
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%([\w.\-]+)\s*\(.*\{\s*$")
_CALLEE = re.compile(r"\b(?:body|condition|to_apply|calls|true_computation|false_computation)=%([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")


@dataclass(frozen=True)
class Collective:
    """One collective of a compiled program (see the module docstring for the byte conventions)."""

    kind: str
    name: str
    computation: str
    shapes: tuple[tuple[str, tuple[int, ...]], ...]  # (dtype, dims) of each buffer on one rank
    group_size: int
    payload_bytes: int
    wire_bytes: float
    in_loop: bool


def _arrays(text: str) -> list[tuple[str, tuple[int, ...]]]:
    out = []
    for dtype, dims in _ARRAY.findall(text):
        if dtype in _BYTES:
            out.append((dtype, tuple(int(d) for d in dims.split(",") if d)))
    return out


def _nbytes(arrays) -> int:
    total = 0
    for dtype, dims in arrays:
        count = 1
        for d in dims:
            count *= d
        total += count * _BYTES[dtype]
    return int(total)


def _group_size(line: str, num_devices: int | None) -> int:
    """Ranks per replica group, from any of XLA's three spellings."""
    m = re.search(r"replica_groups=\{\{([^}]*)\}", line)
    if m:
        return len([x for x in m.group(1).split(",") if x.strip()])
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=", line)
    if m:
        return int(m.group(2))
    m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", line)
    if m:
        sizes = dict((k.strip().strip("'"), int(v)) for k, v in (a.split("=") for a in m.group(1).split(",")))
        size = 1
        for axis in m.group(2).split(","):
            size *= sizes[axis.strip().strip("'")]
        return size
    m = re.search(r"source_target_pairs=\{([^}]*)\}", line)
    if m or num_devices is None:
        return 2
    return num_devices  # empty replica_groups: all devices


def _wire(kind: str, payload: int, group: int) -> float:
    if kind == "all-reduce":
        return 2 * (group - 1) / group * payload
    if kind in ("all-gather", "reduce-scatter", "all-to-all"):
        return (group - 1) / group * payload
    return float(payload)


def _split_computations(hlo: str) -> dict[str, list[str]]:
    comps: dict[str, list[str]] = {}
    current = None
    for line in hlo.splitlines():
        m = _COMPUTATION.match(line)
        if m:
            current = m.group(1)
            comps[current] = []
        elif current is not None:
            if line.strip() == "}":
                current = None
            else:
                comps[current].append(line)
    return comps


def _loop_computations(comps: dict[str, list[str]]) -> set[str]:
    """Computations executed inside a while loop: bodies and conditions, and whatever they call."""
    calls = {name: set() for name in comps}
    roots = set()
    for name, lines in comps.items():
        for line in lines:
            callees = set(_CALLEE.findall(line))
            for group in _BRANCHES.findall(line):
                callees |= {c.strip().lstrip("%") for c in group.split(",") if c.strip()}
            calls[name] |= callees
            if re.search(r"\swhile\(", line):
                roots |= set(re.findall(r"\b(?:body|condition)=%([\w.\-]+)", line))
    inside, stack = set(), list(roots)
    while stack:
        c = stack.pop()
        if c not in inside:
            inside.add(c)
            stack.extend(calls.get(c, ()))
    return inside


def collectives(hlo: str, num_devices: int | None = None) -> list[Collective]:
    """Every collective of a compiled HLO module's text (`compiled.as_text()`), in program order."""
    comps = _split_computations(hlo)
    looped = _loop_computations(comps)
    found = []
    for comp, lines in comps.items():
        for line in lines:
            m = _OP.match(line)
            if not m:
                continue
            kind = m.group("kind")
            if kind == "reduce-scatter":
                shapes = tuple(_arrays(m.group("args").split(")")[0])) or tuple(_arrays(m.group("type")))
            else:
                shapes = tuple(_arrays(m.group("type")))
            if m.group("start") and kind in ("all-gather", "collective-permute"):
                shapes = shapes[len(shapes) // 2 :]  # start ops return (operands, results)
            group = _group_size(line, num_devices)
            payload = _nbytes(shapes)
            found.append(Collective(kind, m.group("name"), comp, shapes, group, payload, _wire(kind, payload, group),
                                    comp in looped))
    return found


def summary(report: list[Collective]) -> dict[str, dict[str, float]]:
    """{kind: {"count", "payload_bytes", "wire_bytes"}} summed over a report (loop bodies once)."""
    out: dict[str, dict[str, float]] = defaultdict(lambda: {"count": 0, "payload_bytes": 0, "wire_bytes": 0.0})
    for c in report:
        s = out[c.kind]
        s["count"] += 1
        s["payload_bytes"] += c.payload_bytes
        s["wire_bytes"] += c.wire_bytes
    return dict(out)


def per_layer(report: list[Collective], num_layers: int) -> dict[str, dict[str, float]]:
    """`summary` divided by the number of decoder layers (a whole-model program): bytes per layer."""
    return {k: {f: v / num_layers for f, v in s.items()} for k, s in summary(report).items()}


def compiled_collectives(fn, *args, **kwargs) -> list[Collective]:
    """Lowers and compiles jitted `fn` at these arguments and returns its collectives."""
    return collectives(fn.lower(*args, **kwargs).compile().as_text())
