"""verl's `BaseTool` over kernelpilot's agent tools (verl 0.9 tool-agent loop); loaded by verl, never by kernelpilot.

verl creates and releases a tool instance around every single call, so a trajectory's workspace is keyed by the
agent loop's request id instead, and lives in `TrajectoryWorkspaces` shared by every tool of the process. Each call
returns, as its tool reward, the best milestone reward the judge has given in the trajectory so far; verl hands
those to the reward function as `extra_info["tool_rewards"]`, where `rl.compute_score` takes the last one.
"""

from __future__ import annotations

import asyncio
from typing import Any
from uuid import uuid4

from verl.tools.base_tool import BaseTool
from verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse

from kernelpilot.train.agent_env import TrajectoryWorkspaces

_workspaces: list[TrajectoryWorkspaces] = []


def _shared_workspaces(allow_unconfined: bool) -> TrajectoryWorkspaces:
    if not _workspaces:
        from kernelpilot.harness.judge import Judge

        _workspaces.append(TrajectoryWorkspaces(lambda: Judge("cuda", allow_unconfined=allow_unconfined)))
    return _workspaces[0]


class KernelpilotTool(BaseTool):
    """One agent tool (the schema's function name picks which) acting on the trajectory's workspace."""

    def __init__(self, config: dict, tool_schema: OpenAIFunctionToolSchema):
        super().__init__(config, tool_schema)
        self._task_code: dict[str, str] = {}
        # The judge refuses sandboxes Landlock does not confine unless the tool config allows them (verl_config).
        self._allow_unconfined = bool((config or {}).get("allow_unconfined", False))

    async def create(self, instance_id: str | None = None, **kwargs: Any) -> tuple[str, ToolResponse]:
        instance_id = instance_id or uuid4().hex
        self._task_code[instance_id] = (kwargs.get("create_kwargs") or {})["task_code"]
        return instance_id, ToolResponse()

    async def execute(
        self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
    ) -> tuple[ToolResponse, float, dict]:
        agent_data = kwargs.get("agent_data")
        trajectory = getattr(agent_data, "request_id", None) or instance_id
        workspaces = _shared_workspaces(self._allow_unconfined)
        output = await asyncio.to_thread(
            workspaces.run, trajectory, self._task_code[instance_id], self.name, parameters
        )
        return ToolResponse(text=output.text), float(workspaces.best_reward(trajectory)), {}

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        self._task_code.pop(instance_id, None)
