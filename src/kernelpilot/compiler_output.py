"""What the build printed, read: ninja's log split by edge, nvcc/gcc/ld diagnostics as `Diagnostic`s, `-Xptxas -v` as
`KernelResources` per kernel, and mangled names made readable (cu++filt from the CUDA toolkit, else c++filt)."""

from __future__ import annotations

import contextlib
import functools
import re
import shutil
import subprocess
from dataclasses import dataclass

from kernelpilot.errors import BuildError
from kernelpilot.results import Diagnostic, KernelResources
from kernelpilot.toolkit import resolve_cuda_home


# ------------------------------------------------------------------------------------------ ninja's log

# ninja runs with NINJA_STATUS="[kp %f/%t] " (build.py): a prefix no compiler prints, so each edge's log is found.
_STATUS = re.compile(r"^\[kp \d+/\d+\] (compile|link) (.+)$")
_FAILED = re.compile(r"^FAILED: (?:\[code=\d+\] )?(.+)$", re.MULTILINE)


@dataclass
class EdgeLog:
    """The part of ninja's log that one finished edge printed (ninja prints it whole, after the edge ends)."""

    action: str | None  # "compile" | "link"; None for text before the first edge
    subject: str | None  # the source compiled (relative to the workspace) or the library linked
    text: str

    @property
    def failed(self) -> bool:
        return _FAILED.search(self.text) is not None


def edge_logs(log: str) -> list[EdgeLog]:
    edges = [EdgeLog(None, None, "")]
    for line in log.splitlines():
        status = _STATUS.match(line)
        if status:
            edges.append(EdgeLog(status.group(1), status.group(2).strip(), ""))
        else:
            edges[-1].text += line + "\n"
    return edges


# ------------------------------------------------------------------------------------- diagnostics


def _diagnostic_patterns() -> list[tuple[re.Pattern[str], str]]:
    """(pattern, tool) pairs; each pattern names its groups from: file, line, column, severity, message."""
    severity = r"(?P<severity>catastrophic error|fatal error|error|warning|remark|note)"
    return [
        (re.compile(r"^FAILED: (?:\[code=\d+\] )?(?P<message>.+)$"), "ninja"),
        (re.compile(r"^ninja: (?P<severity>error): (?P<message>.+)$"), "ninja"),
        # nvcc / cudafe++: kernels/foo.cu(12): error: expected a ";"  (warnings carry a number: warning #177-D:)
        (re.compile(rf"^(?P<file>[^\s(][^(]*)\((?P<line>\d+)\): {severity}(?: #[\w-]+)?: (?P<message>.+)$"), "nvcc"),
        # gcc: kernels/foo_binding.cpp:7:3: error: 'x' was not declared in this scope
        (re.compile(rf"^(?P<file>[^\s:][^:]*):(?P<line>\d+):(?:(?P<column>\d+):)? {severity}: (?P<message>.+)$"), "gcc"),
        # ptxas warning : ... / ptxas /tmp/x.ptx, line 3; error   : ... / ptxas fatal   : ...
        (re.compile(r"^ptxas(?: [^;]*;)? *(?P<severity>error|warning|fatal) *: (?P<message>.+)$"), "ptxas"),
        (re.compile(r"^nvlink (?P<severity>error|warning|fatal) *: (?P<message>.+)$"), "nvlink"),
        (re.compile(r"^nvcc (?P<severity>error|warning|fatal) *: (?P<message>.+)$"), "nvcc"),
        # ld: foo.cpp:(.text+0x5): undefined reference to `bar()'
        (re.compile(r"^(?:\S*ld: )?(?:(?P<file>[^\s:]+):\([^)]*\): )?(?P<message>undefined reference to .+)$"), "ld"),
        (re.compile(r"^\S*ld: (?P<message>cannot find .+)$"), "ld"),
        (re.compile(r"^.*?(?P<message>undefined symbol: \S+)"), "ld"),
        (re.compile(rf"^(?:c\+\+|g\+\+|gcc|cc1plus)(?:-\d+)?: {severity}: (?P<message>.+)$"), "gcc"),
    ]


_PATTERNS = _diagnostic_patterns()
_SEVERITY = {"catastrophic error": "error", "fatal error": "error", "fatal": "error", "remark": "note"}


def parse_diagnostics(log: str) -> list[Diagnostic]:
    """Errors, warnings and notes from nvcc/cudafe, g++, ptxas, nvlink, ld and ninja output, in log order."""
    diagnostics = []
    for line in log.splitlines():
        for pattern, tool in _PATTERNS:
            found = pattern.match(line.rstrip())
            if found:
                diagnostics.append(_diagnostic(found, tool))
                break
    return diagnostics


def _diagnostic(found: re.Match[str], tool: str) -> Diagnostic:
    fields = found.groupdict()
    severity = fields.get("severity") or "error"
    line, column = fields.get("line"), fields.get("column")
    message = fields["message"].strip()
    if tool == "ninja" and not fields.get("severity"):
        message = f"build step failed: {message}"
    return Diagnostic(
        severity=_SEVERITY.get(severity, severity),
        message=message,
        file=fields.get("file"),
        line=int(line) if line else None,
        column=int(column) if column else None,
        tool=tool,
    )


# ------------------------------------------------------------------------------------------ ptxas

_PTXAS_ENTRY = re.compile(r"Compiling entry function '(?P<kernel>[^']+)' for '(?P<arch>[^']+)'")
_PTXAS_PROPERTIES = re.compile(r"Function properties for (?P<kernel>\S+)")
_PTXAS_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_PTXAS_USED = re.compile(r"Used (\d+) registers")
_PTXAS_SMEM = re.compile(r"(\d+) bytes smem")
_PTXAS_CMEM = re.compile(r"(\d+) bytes cmem\[\d+\]")


def parse_ptxas(log: str, source: str | None = None) -> list[KernelResources]:
    """Per-kernel resources from `-Xptxas -v` output, with demangled names.

    In a build log, each kernel is attributed to the source of the ninja edge that printed it; otherwise to
    `source`.
    """
    kernels = []
    for edge in edge_logs(log):
        kernels += _ptxas_kernels(edge.text, edge.subject or source)
    readable = demangle([k.kernel for k in kernels])
    for kernel in kernels:
        kernel.kernel = readable.get(kernel.kernel, kernel.kernel)
    return kernels


def _ptxas_kernels(text: str, source: str | None) -> list[KernelResources]:
    kernels: list[KernelResources] = []
    described: KernelResources | None = None  # the entry whose "Function properties" block we are in
    for line in text.splitlines():
        if entry := _PTXAS_ENTRY.search(line):
            described = KernelResources(kernel=entry["kernel"], arch=entry["arch"], source=source)
            kernels.append(described)
        elif properties := _PTXAS_PROPERTIES.search(line):
            # Device functions get properties blocks too; only an entry's are kept.
            is_current = kernels and kernels[-1].kernel == properties["kernel"]
            described = kernels[-1] if is_current else None
        elif described and (frame := _PTXAS_FRAME.search(line)):
            described.stack_bytes, described.spill_stores, described.spill_loads = map(int, frame.groups())
        elif described and (used := _PTXAS_USED.search(line)):
            described.registers = int(used.group(1))
            described.shared_bytes = sum(int(n) for n in _PTXAS_SMEM.findall(line))
            described.constant_bytes = sum(int(n) for n in _PTXAS_CMEM.findall(line))
    return kernels


def demangle(names: list[str]) -> dict[str, str]:
    """Mangled -> readable, in one call of cu++filt (CUDA toolkit) or c++filt; names stay as-is without either."""
    mangled = sorted({n for n in names if n.startswith("_Z")})
    tool = _demangler()
    if not mangled or tool is None:
        return {}
    run = subprocess.run([tool], input="\n".join(mangled) + "\n", capture_output=True, text=True, check=False)
    readable = run.stdout.splitlines()
    if run.returncode != 0 or len(readable) != len(mangled):
        return {}
    return dict(zip(mangled, readable))


@functools.cache
def _demangler() -> str | None:
    with contextlib.suppress(BuildError):
        toolkit_filter = resolve_cuda_home() / "bin" / "cu++filt"
        if toolkit_filter.is_file():
            return str(toolkit_filter)
    return shutil.which("cu++filt") or shutil.which("c++filt")
