"""The kernel families, found through one registry, and the files the policy renders from them.

A family is what the policy generates for one kind of group: its launch candidates (the expected best first),
the context its template is rendered with for one candidate, the template, and what its binding adds. Each lives
in its own module (elementwise.py, row.py, columns.py, scan.py, matmul.py, convolution.py) built on the shared emitter and
layouts of codegen.py; a new family is one module and one entry of FAMILIES.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kernelpilot.policy.codegen import (
    MATMUL_WORKSPACE_BYTES,
    SCALAR_TYPES,
    GeneratedFile,
    LaunchConfig,
    argument_names,
    function_name,
    kernel_stem,
    launcher_name,
    render_model_new,
)
from kernelpilot.policy.columns import ColumnConfig, column_candidates, column_context
from kernelpilot.policy.convolution import ConvConfig, conv_binding_context, conv_candidates, conv_context
from kernelpilot.policy.elementwise import elementwise_candidates, elementwise_context
from kernelpilot.policy.ir import Analysis, Group
from kernelpilot.policy.leading import describe_leading
from kernelpilot.policy.matmul import MatmulConfig, matmul_candidates, matmul_context
from kernelpilot.policy.row import row_candidates, row_context
from kernelpilot.policy.scan import scan_candidates, scan_context
from kernelpilot.resources import template_environment

if TYPE_CHECKING:
    from kernelpilot.problem import Problem

# A launch configuration of any family (elementwise and row kernels share LaunchConfig).
KernelConfig = LaunchConfig | MatmulConfig | ColumnConfig | ConvConfig


def _no_binding_settings(group: Group) -> dict[str, Any]:
    return {"workspace_query": None, "settings": []}


@dataclass(frozen=True)
class Family:
    """How one kind of group becomes a kernel: candidates, template context, template, binding extras."""

    template: str
    candidates: Callable[[Group], list[KernelConfig]]
    context: Callable[[Group, KernelConfig], dict[str, Any]]
    binding_context: Callable[[Group], dict[str, Any]] = _no_binding_settings
    workspace_bytes: int = 0  # scratch the binding allocates for the launcher


FAMILIES: dict[str, Family] = {
    "elementwise": Family("policy/elementwise.cu.j2", elementwise_candidates, elementwise_context),
    "row": Family("policy/row.cu.j2", row_candidates, row_context),
    "column": Family("policy/column.cu.j2", column_candidates, column_context),
    "scan": Family("policy/scan.cu.j2", scan_candidates, scan_context),
    "matmul": Family("policy/matmul.cu.j2", matmul_candidates, matmul_context,
                     workspace_bytes=MATMUL_WORKSPACE_BYTES),  # fmt: skip
    "conv": Family("policy/conv.cu.j2", conv_candidates, conv_context, binding_context=conv_binding_context),
}


def family(group: Group) -> Family:
    """The family that generates `group`; ValueError for a group the policy does not generate."""
    if group.kind not in FAMILIES:
        raise ValueError(f"group {group.name} is a {group.kind} group, which the policy does not generate")
    return FAMILIES[group.kind]


def launch_candidates(group: Group) -> list[KernelConfig]:
    """A few launch geometries (matmuls and convolutions: library algorithms) worth timing, the expected best first."""
    return family(group).candidates(group)


def render_kernel(group: Group, config: KernelConfig) -> GeneratedFile:
    """kernels/policy_<group>.cu for one launch configuration."""
    kernel = family(group)
    content = template_environment("templates").get_template(kernel.template).render(**kernel.context(group, config))
    return GeneratedFile(f"kernels/{kernel_stem(group)}.cu", content)


def render_binding(group: Group) -> GeneratedFile:
    """kernels/policy_<group>_binding.cpp: checks, allocation, launcher call, registration."""
    kernel = family(group)
    names = argument_names(group.tensors)
    frees = group.carrier_dims or (0,) * len(group.tensors)
    # The tensor whose free dims the output is allocated with: one with as many free dims as the output, else (an
    # output of batch x tokens rows) the first that moves, whose free dims' product is the row count.
    carriers = [(arg, free) for arg, free in zip(names, frees) if free]
    leading = next((c for c in carriers if c[1] == group.free_dims), carriers[0] if carriers else (None, 0))
    content = template_environment("templates").get_template("policy/binding.cpp.j2").render(
        stem=kernel_stem(group),
        description=group.describe(),
        shapes=describe_leading(group),
        function=function_name(group),
        launcher=launcher_name(group),
        tensors=[
            {"arg": arg, "scalar_type": SCALAR_TYPES[t.dtype], "shape": list(t.shape), "batched": free > 0,
             "free": free, "rest": list(t.shape[free:])}
            for arg, t, free in zip(names, group.tensors, frees)
        ],
        # The tensor carrying the runtime sizes that the others must agree with (None: all fixed), and its free dims.
        leading=leading[0],
        leading_free=leading[1],
        free_dims=group.free_dims,
        out_shape=list(group.output.shape),
        out_scalar_type=SCALAR_TYPES[group.output.dtype],
        workspace_bytes=kernel.workspace_bytes,
        **kernel.binding_context(group),
    )
    return GeneratedFile(f"kernels/{kernel_stem(group)}_binding.cpp", content)


def render_all(problem: Problem, analysis: Analysis, configs: dict[str, KernelConfig] | None = None) -> list[GeneratedFile]:
    """Every file the policy writes for a supported analysis; `configs` picks launch configs by group name."""
    if not analysis.supported:
        raise ValueError(analysis.blockers())
    files = []
    for group in analysis.generated_groups:
        config = (configs or {}).get(group.name) or launch_candidates(group)[0]
        files += [render_kernel(group, config), render_binding(group)]
    return files + [render_model_new(problem, analysis)]
