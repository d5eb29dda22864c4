"""Decontamination of synthesized tasks: drop a task whose operator sequence equals a benchmark problem's, or whose
source is too similar to one (AST token sequences, difflib ratio), so training never sees the benchmark."""

from __future__ import annotations

import ast
import difflib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kernelpilot.train.tasks import Task


@dataclass
class Dropped:
    """A task dropped by decontamination: which benchmark file it matched and how."""

    task_id: str
    benchmark_file: str
    why: str  # "same operator sequence" or "AST similarity 0.93"


def op_sequence(code: str) -> list[str]:
    """The operators a problem's forward applies, in evaluation order, spelled alike whatever the source's style.

    `self.conv(x)` resolves through `__init__` to its class; `nn.ReLU`, `F.relu` and `torch.relu` all read "relu";
    binary operators read as their names ("add", "mult").
    """
    tree = ast.parse(code)
    model = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Model"), None)
    if model is None:
        return []
    attributes: dict[str, str] = {}
    forward = None
    for item in model.body:
        if isinstance(item, ast.FunctionDef) and item.name == "__init__":
            for node in ast.walk(item):
                if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
                    for target in node.targets:
                        if isinstance(target, ast.Attribute):
                            attributes[target.attr] = _callee(node.value.func)
        elif isinstance(item, ast.FunctionDef) and item.name == "forward":
            forward = item
    return _OpCollector(attributes).collect(forward) if forward else []


class _OpCollector(ast.NodeVisitor):
    def __init__(self, attributes: dict[str, str]):
        self.attributes = attributes
        self.ops: list[str] = []

    def collect(self, node: ast.AST) -> list[str]:
        self.visit(node)
        return self.ops

    def visit_Call(self, node: ast.Call) -> None:
        self.generic_visit(node)  # arguments first: that is the order they run in
        func = node.func
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "self":
            self.ops.append(self.attributes.get(func.attr, func.attr))
        else:
            self.ops.append(_callee(func))

    def visit_BinOp(self, node: ast.BinOp) -> None:
        self.generic_visit(node)
        self.ops.append(type(node.op).__name__.lower())


def _callee(func: ast.AST) -> str:
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else "call"
    return name.lower().replace("_", "")


def ast_tokens(code: str) -> list[str]:
    """The source's syntax as node-type names plus called attribute names: identifiers and numbers erased."""
    tokens = []
    for node in ast.walk(ast.parse(code)):
        tokens.append(type(node).__name__)
        if isinstance(node, ast.Attribute):
            tokens.append(node.attr.lower())
    return tokens


def decontaminate(
    tasks: list[Task], benchmark_dir: Path, *, similarity: float = 0.9
) -> tuple[list[Task], list[Dropped]]:
    """The tasks far enough from every .py problem under `benchmark_dir`, and the dropped ones with the reason."""
    benchmark = []
    for path in sorted(Path(benchmark_dir).rglob("*.py")):
        try:
            code = path.read_text(encoding="utf-8")
            benchmark.append((path, op_sequence(code), ast_tokens(code)))
        except (SyntaxError, UnicodeDecodeError, OSError):
            continue  # not a problem file we can compare against
    kept, dropped = [], []
    for task in tasks:
        match = _closest_match(task, benchmark, similarity)
        if match is None:
            kept.append(task)
        else:
            dropped.append(Dropped(task.task_id, str(match[0]), match[1]))
    return kept, dropped


def _closest_match(task: Task, benchmark: list, similarity: float) -> tuple[Path, str] | None:
    ops, tokens = op_sequence(task.code), ast_tokens(task.code)
    for path, bench_ops, bench_tokens in benchmark:
        if ops and ops == bench_ops:
            return path, "same operator sequence"
        ratio = difflib.SequenceMatcher(None, tokens, bench_tokens, autojunk=False).ratio()
        if ratio >= similarity:
            return path, f"AST similarity {ratio:.2f}"
    return None
