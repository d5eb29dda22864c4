"""The agent's tools as an RL environment: one fresh workspace per trajectory, one shared judge per process.

An RL engine (verl's multi-turn tool interface) calls tools by name for many trajectories at once. Each trajectory
gets its own workspace of its task on first use; every tool runs exactly as in `kernelpilot optimize`
(agent/tools.py through loop.run_tool, so a bad call comes back as a ToolError observation). The judge's worker
serves one request at a time, so calls into it are serialised; everything else runs concurrently.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kernelpilot.agent import ToolCall, ToolContext, ToolOutput


class SerialJudge:
    """A judge shared by threads, started on first use (editing tools never need it); its methods run under one lock."""

    def __init__(self, make_judge: Callable[[], Any]):
        self._make_judge = make_judge
        self._judge: Any = None
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        with self._lock:
            if self._judge is None:
                self._judge = self._make_judge()
        attribute = getattr(self._judge, name)
        if not callable(attribute):
            return attribute

        def serialised(*args: Any, **kwargs: Any) -> Any:
            with self._lock:
                return attribute(*args, **kwargs)

        return serialised


class TrajectoryWorkspaces:
    """Workspaces keyed by trajectory id; `run` executes one tool call in the trajectory's workspace."""

    def __init__(self, make_judge: Callable[[], Any], root: Path | None = None, settings: Any = None):
        from kernelpilot.agent.tools import default_tools

        self._judge = SerialJudge(make_judge)
        self._root = Path(root) if root is not None else Path(tempfile.mkdtemp(prefix="kp-rl-"))
        self._settings = settings
        self._tools = default_tools()
        self._contexts: dict[str, ToolContext] = {}
        self._lock = threading.Lock()

    def run(self, trajectory_id: str, task_code: str, name: str, arguments: dict[str, Any]) -> ToolOutput:
        """Run tool `name` with `arguments` in the trajectory's workspace (made from `task_code` on first use)."""
        from kernelpilot.agent.loop import run_tool
        from kernelpilot.agent.text_actions import new_call_id

        ctx = self._context(trajectory_id, task_code)
        return run_tool(ToolCall(new_call_id(), name, arguments), self._tools, ctx)

    def best_reward(self, trajectory_id: str) -> int:
        """The best milestone reward the judge gave in this trajectory so far; -1 before any verified candidate."""
        ctx = self._contexts.get(trajectory_id)
        evals = ctx.judged.evals if ctx is not None else []
        return max((result.reward for result in evals), default=-1)

    def release(self, trajectory_id: str) -> None:
        """Forget a finished trajectory and delete its workspace."""
        with self._lock:
            ctx = self._contexts.pop(trajectory_id, None)
        if ctx is not None:
            shutil.rmtree(ctx.workspace.root.parent, ignore_errors=True)

    def _context(self, trajectory_id: str, task_code: str) -> ToolContext:
        from kernelpilot.config import Settings
        from kernelpilot.workspace import init_workspace

        with self._lock:
            if trajectory_id in self._contexts:
                return self._contexts[trajectory_id]
            folder = Path(tempfile.mkdtemp(prefix="traj-", dir=self._root))
            (folder / "task.py").write_text(task_code, encoding="utf-8")
            ws, _ = init_workspace(folder / "task.py", folder / "ws")
            ctx = ToolContext(workspace=ws, judge=self._judge, settings=self._settings or Settings())
            self._contexts[trajectory_id] = ctx
            return ctx
