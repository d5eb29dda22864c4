"""The scan family: a running sum or product along each row (cumsum, cumprod), one team of threads per row walking
it tile by tile, with the elementwise ops before the scan fused into its loads; its launch candidates and its
template context.

A tile is `items` vectors per thread, each item a coalesced stripe of the team's vectors. A thread scans its
vector's elements in registers, a warp scans its threads' totals with shuffles, and the warps of a team exchange
their totals through shared memory once per tile (one barrier pair for all items). The running total of the tiles
before (the carry) is added to every element, so each element is read once and written once.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

from kernelpilot.policy.codegen import (
    CTYPES,
    Emitter,
    LaunchConfig,
    dtype_context,
    kernel_stem,
    launcher_name,
    next_power_of_two,
    row_access_context,
    row_layout,
    tensor_context,
)
from kernelpilot.policy.ir import Group, Scan
from kernelpilot.policy.row import row_launch_context

# Per kind: the C operator of the running statistic and its identity.
SCAN_OPS = {"sum": ("+", "0.0f"), "prod": ("*", "1.0f")}
SCAN_WORDS = {"sum": "running sum", "prod": "running product"}


def scan_candidates(group: Group) -> list[LaunchConfig]:
    """Team sizes that cover a row in about four tiles or fewer, the largest first: a long row (KernelBench's
    32768 floats) takes a 1024-thread team in two tiles of four vectors per thread, then 512 and 256 threads."""
    layout = row_layout(group)
    vectors = math.ceil(group.row_length / layout.vec)
    items = max(1, min(4, 16 // layout.vec))
    preferred = min(1024, max(4, next_power_of_two(math.ceil(vectors / items))))
    teams = [t for t in (preferred, preferred // 2, preferred // 4) if t >= 4] or [4]
    return [LaunchConfig(team, items, max(1, 256 // team), persistent=False) for team in teams]


def scan_context(group: Group, config: LaunchConfig) -> dict[str, Any]:
    scan = group.expr
    assert isinstance(scan, Scan), "a scan group's expression is its Scan"
    layout = row_layout(group)
    accesses = [{**row_access_context(group, layout, i), "guard": None} for i in range(len(group.accesses))]
    names = {load: (f"e{index}" if layout.along_row(index) else f"r{index}") for load, index in group.loads.items()}
    emitter = Emitter(names, itertools.count())
    value = emitter.value(scan.value)
    element = [a for a in accesses if a["along_row"]]
    vector_tensors = {a["tensor"] for a in element if not a["broadcast"]} if layout.vec > 1 else set()
    operator, identity = SCAN_OPS[scan.kind]
    return {
        **row_launch_context(group, config),
        "items": config.items,
        "vec": layout.vec,
        "operator": operator,
        "identity": identity,
        "statistic": SCAN_WORDS[scan.kind],
        "reverse": scan.reverse,
        "all_accesses": accesses,
        "element_accesses": element,
        "row_accesses": [a for a in accesses if not a["along_row"]],
        "element_code": emitter.lines,
        "value": value,
        "kernel": f"{kernel_stem(group)}_kernel",
        "launcher": launcher_name(group),
        "tensors": tensor_context(group, vector_tensors),
        "out_ctype": CTYPES[group.output.dtype],
        **dtype_context(group),
    }
