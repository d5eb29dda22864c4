"""What a built extension links against: its undefined dynamic symbols, read from the ELF file, never executed.

A binding can call ATen from C++ with the Python dispatch keys excluded, out of sight of the op recorder, and a
comment can name `cublasLtMatmul(`; neither hides what the linker recorded. Every function the extension calls
in torch, cuBLAS or cuDNN is an undefined symbol of its `.so`, resolved by the loader. This module reads them
(pure Python, no binutils needed) and judges them: `find_torch_compute_symbols` fails ATen/torch compute,
`calls_library` says which GEMM/convolution libraries the extension really calls, and
`find_no_own_kernel` is the no-custom-kernel guard with that set in place of a search of the sources.

Trusted side: runs in the judge's process before the library is loaded anywhere; imports no torch.
Names are demangled with c++filt when one is installed; every matcher also accepts the mangled names.
"""

from __future__ import annotations

import functools
import re
import struct
from collections.abc import Iterable
from fnmatch import fnmatchcase
from pathlib import Path

from kernelpilot.compiler_output import demangle
from kernelpilot.errors import KernelpilotError
from kernelpilot.results import GuardFinding

TORCH_SYMBOLS = "torch-symbols"
NO_CUSTOM_KERNEL = "no-custom-kernel"  # the guard find_no_own_kernel replaces keeps its name


class SymbolReadError(KernelpilotError):
    """The file is not an ELF shared library whose dynamic symbols can be read."""


# ------------------------------------------------------------------------------------------- reading the ELF

_SHT_DYNSYM = 11
_SHN_UNDEF = 0


def undefined_symbols(library: Path) -> list[str]:
    """The undefined dynamic symbols of a built `.so`, sorted, demangled where a demangler is installed."""
    names = _undefined_dynamic_names(Path(library))
    readable = demangle(names)
    return sorted(readable.get(name, name) for name in names)


def _undefined_dynamic_names(library: Path) -> list[str]:
    """Names of `.dynsym` entries whose section index is SHN_UNDEF (what nm -D --undefined-only lists)."""
    try:
        data = library.read_bytes()
    except OSError as err:
        raise SymbolReadError(f"cannot read {library}: {err.strerror}.") from err
    if data[:4] != b"\x7fELF" or data[4] not in (1, 2) or data[5] not in (1, 2):
        raise SymbolReadError(f"{library} is not an ELF file.", hint="Pass the BuildResult.library of a build.")
    is_64, order = data[4] == 2, "<" if data[5] == 1 else ">"
    try:
        return _read_dynsym(data, is_64, order)
    except (struct.error, ValueError, IndexError) as err:
        raise SymbolReadError(f"{library} is a truncated or malformed ELF file ({err}).") from err


def _read_dynsym(data: bytes, is_64: bool, order: str) -> list[str]:
    header = struct.Struct(order + ("16xHHIQQQIHHHHHH" if is_64 else "16xHHIIIIIHHHHHH"))
    section = struct.Struct(order + ("IIQQQQIIQQ" if is_64 else "IIIIIIIIII"))
    symbol = struct.Struct(order + ("IBBHQQ" if is_64 else "IIIBBH"))
    (_, _, _, _, _, section_offset, _, _, _, _, section_size, section_count, _) = header.unpack_from(data)
    sections = [section.unpack_from(data, section_offset + i * section_size) for i in range(section_count)]
    dynsym = [s for s in sections if s[1] == _SHT_DYNSYM]
    if not dynsym:
        raise struct.error("no .dynsym section")
    (_, _, _, _, table_offset, table_size, link, _, _, entry_size) = dynsym[0]
    strings_offset = sections[link][4]
    names = []
    for offset in range(table_offset + entry_size, table_offset + table_size, entry_size):  # entry 0 is null
        fields = symbol.unpack_from(data, offset)
        name_index, section_index = fields[0], fields[3] if is_64 else fields[5]
        if section_index == _SHN_UNDEF and name_index:
            start = strings_offset + name_index
            names.append(data[start : data.index(b"\0", start)].decode("utf-8", "replace"))
    return names


# ---------------------------------------------------------------------------- qualified names, both forms

_SPECIAL_PREFIXES = ("vtable for ", "typeinfo name for ", "typeinfo for ", "VTT for ", "guard variable for ",
                     "construction vtable for ", "non-virtual thunk to ", "virtual thunk to ",
                     "covariant return thunk to ",
                     "TLS init function for ", "TLS wrapper function for ")  # fmt: skip
_OPERATOR = re.compile(
    r"operator\s*(?:\(\)|\[\]|->\*?|<<=|>>=|<=>|<<|>>|<=|>=|<|>|[-+*/%^&|~!=,]+|\s(?:new|delete)(?:\[\])?)"
)


def qualified_name(symbol: str) -> tuple[str, ...]:
    """The scope path of a symbol, mangled or demangled: `at::_ops::relu::call(at::Tensor const&)` and
    `_ZN2at4_ops4relu4callERKNS_6TensorE` both give ('at', '_ops', 'relu', 'call'). Template arguments,
    parameters, return types and symbol versions (`@GLIBC_2.2.5`) are dropped; C names give themselves."""
    symbol = symbol.split("@", 1)[0].strip()
    if symbol.startswith("_Z"):
        return _mangled_path(symbol)
    for prefix in _SPECIAL_PREFIXES:
        symbol = symbol.removeprefix(prefix)
    text = _OPERATOR.sub("operator", re.sub(r"\[abi:\w+\]", "", symbol))
    depth, outside = 0, []
    for char in text:  # template arguments may hold '::', spaces and parentheses
        depth += char == "<"
        if depth == 0:
            outside.append(char)
        depth -= char == ">" and depth > 0
    head = re.sub(r"::operator\s.*", "::operator", "".join(outside).split("(", 1)[0]).split()  # conversions
    return tuple(head[-1].rstrip("&*").split("::")) if head else ()


# St is std::; the others name std classes, spelled as demanglers spell them inside nested names.
_STD_ABBREVIATIONS = {"t": (), "a": ("allocator",), "b": ("basic_string",), "s": ("basic_string",),
                      "i": ("basic_istream",), "o": ("basic_ostream",), "d": ("basic_iostream",)}  # fmt: skip


def _mangled_path(symbol: str) -> tuple[str, ...]:
    """The scope path of an Itanium-mangled name: its nested source names, template arguments skipped."""
    rest = re.sub(r"^(?:T[VISTHW]|GV|Thn?\d+_|Tvn?\d+_n?\d+_|Z|L)", "", symbol[2:])  # vtables, typeinfo, guards, thunks
    nested = rest.startswith("N")
    rest = re.sub(r"^N[rVK]*[RO]?", "", rest) if nested else rest
    path: list[str] = []
    while rest:
        if rest[0] == "S" and rest[1:2] in _STD_ABBREVIATIONS:
            path += ["std", *_STD_ABBREVIATIONS[rest[1]]]
            rest = rest[2:]
        elif rest[0].isdigit():
            length = re.match(r"\d+", rest).group()
            path.append(rest[len(length) : len(length) + int(length)])
            rest = rest[len(length) + int(length) :]
        elif rest[0] == "I":
            rest = _after_template_arguments(rest)
        elif re.match(r"B\d", rest):  # an ABI tag ([abi:cxx11]), not part of the name
            rest = rest[1 + len(re.match(r"\d+", rest[1:]).group()) + int(re.match(r"\d+", rest[1:]).group()) :]
        elif re.match(r"[CD][0-5]", rest) and path:
            path.append(path[-1] if rest[0] == "C" else f"~{path[-1]}")
            rest = rest[2:]
        elif re.match(r"[a-z][a-z]", rest):  # an operator: ls is <<, pl is +, cv a conversion...
            path.append("operator")
            rest = "" if rest.startswith("cv") else rest[2:]
        else:
            break
        if not nested and not rest.startswith("I") and path != ["std"]:
            break
    return tuple(path)


def _after_template_arguments(rest: str) -> str:
    """`rest` past the template argument list it starts with (`I...E`, nested lists and literals included)."""
    depth, i = 0, 0
    while i < len(rest):
        char = rest[i]
        if char.isdigit():  # a source name: its length, then that many characters
            length = re.match(r"\d+", rest[i:]).group()
            i += len(length) + int(length)
            continue
        if char == "L" and not rest.startswith("L_Z", i):  # a literal: type and value up to E
            i = rest.index("E", i) + 1
            continue
        reference = re.match(r"[ST][0-9A-Z]*_", rest[i:])  # a substitution or template parameter: S3_, T_
        if reference:
            i += len(reference.group())
            continue
        depth += char in "INJXF"
        depth -= char == "E"
        i += 1
        if depth == 0:
            break
    return rest[i:]


# ------------------------------------------------------------------------------------------ torch compute

# ATen operators a binding may call (as `at::_ops::<op>::call`, which torch::empty, x.view() and the other inline
# wrappers compile to): allocation, initialisation and views, the same set the runtime op recorder allows
# (guards.ALLOWED_ATEN_OPS), plus two that are free when no copy is needed:
# - `contiguous` and `reshape` return their input (or a view) when its layout already fits, which is the idiom of a
#   defensive binding and of SKILL.md (".reshape where no copy is needed"). Whether they copy depends on strides a
#   static check cannot see; when they do, torch's copy kernel runs and the profiler guard (torch kernels in
#   forward) fails it. So they pass here.
# - `clone`, `copy_` and `to` are not allowed: copying or casting is their whole point, and a cast or a layout
#   change can be the entire answer of a problem.
# Any other operator is torch computing (part of) the answer.
ALLOWED_ATEN_OPS: dict[str, str] = {
    **dict.fromkeys(
        ("empty", "empty_like", "empty_strided", "empty_permuted", "new_empty", "new_empty_strided", "zeros",
         "zeros_like", "new_zeros", "ones", "ones_like", "new_ones", "full", "full_like", "new_full",
         "scalar_tensor", "resize_", "record_stream"),
        "allocation",
    ),
    **dict.fromkeys(("fill_", "zero_"), "initialisation (a memset, no compute of the result)"),
    **dict.fromkeys(
        ("view", "_unsafe_view", "_reshape_alias", "as_strided", "as_strided_", "alias", "detach", "t",
         "transpose", "permute", "unsqueeze", "squeeze", "expand", "expand_as", "view_as", "slice", "select",
         "narrow", "split", "split_with_sizes", "unbind", "chunk", "diagonal", "unfold", "view_as_real",
         "view_as_complex", "flatten", "unflatten", "movedim", "swapaxes"),
        "view (no data moves)",
    ),
    **dict.fromkeys(("contiguous", "reshape"), "a view when no copy is needed (see above)"),
    **dict.fromkeys(("sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "is_same_size"), "metadata"),
}  # fmt: skip

# Overload names of the allowed operators: `at::_ops::<op>_<overload>` (empty.memory_format -> empty_memory_format).
# Only these suffixes, so that `select_scatter` or `slice_copy`, operators of their own, are not taken for
# overloads of `select` and `slice` (tests check this against every operator torch registers).
_ALLOWED_OVERLOADS = frozenset(
    ("out", "memory_format", "names", "names_out", "Scalar", "Tensor", "int", "dim", "dims", "Dimname", "dimname",
     "dtype", "t", "str", "sizes", "using_ints", "using_names", "intlist", "Tensor_out", "Scalar_out")
)  # fmt: skip


def is_allowed_aten_op(op_struct: str) -> bool:
    """True when `at::_ops::<op_struct>` is an allowed operator or one of its overloads."""
    if op_struct in ALLOWED_ATEN_OPS:
        return True
    return any(
        op_struct.startswith(op + "_") and op_struct[len(op) + 1 :] in _ALLOWED_OVERLOADS for op in ALLOWED_ATEN_OPS
    )


# Functions and scopes of at:: and torch:: a binding may reference, as shell-style patterns over the scope path
# (a pattern also covers the members of what it names): tensor metadata and data pointers, allocation, the
# checks of ATen/TensorUtils.h, the global context (TF32 flags), handles for calling cuBLAS/cuDNN itself, and
# the machinery of custom-operator registration. Everything else in at:: and torch:: is compute: at::native,
# at::cuda's kernels and blas, the non-inline compute methods of at::Tensor (relu_, index, to, ...), torch::jit.
ALLOWED_TORCH_FUNCTIONS: dict[str, str] = {
    **dict.fromkeys(
        [f"at::TensorBase::{method}" for method in (
            "data_ptr", "const_data_ptr", "mutable_data_ptr", "data", "packed_accessor*", "generic_packed_accessor",
            "is_complex", "is_floating_point", "is_view", "is_leaf", "name", "output_nr", "_version", "_base",
            "enforce_invariants", "toString", "print", "grad_fn", "requires_grad_", "retains_grad", "tensor_data",
            "variable_data", "quantizer")],
        "tensor metadata and data pointers",
    ),
    "at::TensorBase::__dispatch_contiguous": "contiguous(): free when no copy is needed (see ALLOWED_ATEN_OPS)",
    "at::TensorBase::fill_": "initialisation",
    "at::TensorBase::zero_": "initialisation",
    **dict.fromkeys(
        [f"at::Tensor::{method}" for method in ("narrow", "select", "as_strided_symint", "expect_contiguous")], "views"
    ),
    **dict.fromkeys([f"at::Tensor::{method}" for method in ("new_empty", "new_full", "new_zeros", "new_zeros_symint")],
                    "allocation"),
    **dict.fromkeys(["at::detail::empty_cuda", "at::detail::empty_strided_cuda", "at::detail::empty_generic",
                     "at::detail::empty_strided_generic"], "allocation without the dispatcher"),
    **dict.fromkeys(["at::check*", "at::infer_size*", "at::has_internal_overlap", "at::assert_no_*overlap",
                     "at::geometry_is_contiguous"], "argument checks"),
    "at::Context": "global settings (TF32, deterministic algorithms)",
    "at::globalContext": "global settings",
    **dict.fromkeys(["at::cuda::getCurrentCUDAStream", "at::cuda::getCurrentDeviceProperties",
                     "at::cuda::getDeviceProperties", "at::cuda::warp_size"], "streams and device properties"),
    **dict.fromkeys(["at::cuda::getCurrentCUDABlasHandle", "at::cuda::getCurrentCUDABlasLtHandle",
                     "at::cuda::getCUDABlasLtWorkspace*", "at::cuda::getChosenWorkspaceSize",
                     "at::native::getCudnnHandle"], "handles and scratch space for calling cuBLAS/cuDNN itself"),
    "torch::autograd::AutogradMeta": "tensor metadata (its vtable is referenced by torch/types.h)",
    **dict.fromkeys(["torch::Library", "torch::CppFunction", "torch::detail::TorchLibraryInit",
                     "torch::detail::class_base", "torch::jit::parseSchema*"],
                    "custom operator and class registration (TORCH_LIBRARY, m.def's schema string)"),
    **dict.fromkeys(["at::RecordFunction", "at::getStepCallbacks*"], "profiler ranges around dispatcher calls"),
}  # fmt: skip

# c10 is metadata, errors, devices and streams, except the ways to find and call an operator by its name.
DENIED_C10_SCOPES = (
    ("c10", "Dispatcher", "findSchema"),
    ("c10", "Dispatcher", "findSchemaOrThrow"),
    ("c10", "Dispatcher", "findOp"),
    ("c10", "impl", "OperatorEntry", "kernelForDispatchKey"),
    ("c10", "impl", "OperatorEntry", "getKernelForDispatchKey"),
    ("c10", "impl", "OperatorEntry", "getComputedKernelForDispatchKey"),
)
# Run-time symbol lookup: a function found by name is a call the symbol table does not show.
RUNTIME_LOOKUP = frozenset({"dlsym", "dlvsym", "dlopen", "dlmopen"})

_MAX_LISTED = 8


def torch_compute_symbol(symbol: str) -> str | None:
    """What torch compute `symbol` references, readably (`relu`, `at::native::add_out`), or None when allowed."""
    path = qualified_name(symbol)
    if path[:2] == ("at", "_ops") and len(path) >= 3:
        return None if is_allowed_aten_op(path[2]) else path[2]
    if path[:1] in (("at",), ("torch",)):
        name = "::".join(path)
        return None if _is_allowed_torch_function(name) else name
    if any(path[: len(scope)] == scope for scope in DENIED_C10_SCOPES):
        return "::".join(path) + " (an operator looked up by name)"
    if len(path) == 1 and path[0] in RUNTIME_LOOKUP:
        return f"{path[0]} (functions looked up at run time)"
    return None


def _is_allowed_torch_function(name: str) -> bool:
    """True when `name` (at::TensorBase::data_ptr) is, or is a member of, a pattern of ALLOWED_TORCH_FUNCTIONS."""
    return any(fnmatchcase(name, pattern) or fnmatchcase(name, f"{pattern}::*") for pattern in ALLOWED_TORCH_FUNCTIONS)


def find_torch_compute_symbols(symbols: Iterable[str]) -> GuardFinding | None:
    """Fail when the extension references ATen/torch functions that compute; name up to 8 of them."""
    offending = sorted({found for symbol in symbols if (found := torch_compute_symbol(symbol)) is not None})
    if not offending:
        return None
    listed = ", ".join(offending[:_MAX_LISTED])
    if len(offending) > _MAX_LISTED:
        listed += f" and {len(offending) - _MAX_LISTED} more"
    return GuardFinding(
        TORCH_SYMBOLS,
        "fail",
        f"the extension calls torch to compute ({listed}); a binding may only check, allocate, take views and "
        "launch: the work must run in kernels/*.cu.",
    )


# ------------------------------------------------------------------------------ libraries really called

# Entry points that run a library's GEMM or convolution (the calls SKILL.md allows), per library. Creating a
# handle or a descriptor computes nothing, so only these count.
LIBRARY_ENTRY_POINTS: dict[str, re.Pattern[str]] = {
    "cuBLASLt": re.compile(r"cublasLtMatmul"),
    "cuBLAS": re.compile(r"cublas(?!Lt)\w*[Gg]em[mv]\w*"),
    # a transposed convolution is the data gradient of the convolution with its settings
    "cuDNN": re.compile(r"cudnn(?:Convolution\w*Forward|ConvolutionBiasActivationForward|ConvolutionBackwardData|BackendExecute)"),
}


def calls_library(symbols: Iterable[str]) -> set[str]:
    """Which of cuBLAS, cuBLASLt and cuDNN the extension calls to compute, from its undefined symbols."""
    names = {"::".join(qualified_name(symbol)) for symbol in symbols}
    return {library for library, entry in LIBRARY_ENTRY_POINTS.items() if any(entry.fullmatch(n) for n in names)}


def library_kernels_called(kernel_names: Iterable[str], libraries: set[str]) -> list[str]:
    """The profiled kernels that belong to a library the extension calls itself (none when `libraries` is empty):
    cuBLAS/cuDNN kernels launched by the workspace's own call, which count as its work."""
    if not libraries:
        return []
    return [name for name in kernel_names if _is_library_kernel(name) and not _is_torch_kernel(name)]


def find_no_own_kernel(kernel_names: list[str], workspace_source: str, libraries: set[str]) -> GuardFinding | None:
    """guards.find_no_custom_kernel with `calls_library`'s set in place of a search of the sources for calls.

    Fail when none of forward's kernels is the candidate's own: a kernel counts when its name is defined in the
    workspace's kernel sources, or when it is a cuBLAS/cuDNN kernel and the extension links a call into that
    library (a GEMM whose epilogue does all the work launches nothing else). A comment naming a call no longer
    counts.
    """
    own = [
        name
        for name in kernel_names
        if not _is_torch_kernel(name) and re.search(rf"\b{re.escape(_base_name(name))}\b", workspace_source)
    ]
    if own or library_kernels_called(kernel_names, libraries):
        return None
    seen = ", ".join(sorted({_base_name(name) for name in kernel_names})[:_MAX_LISTED]) or "none"
    return GuardFinding(
        NO_CUSTOM_KERNEL,
        "fail",
        f"forward launched no kernel of the workspace (kernels seen: {seen}); the work must run in kernels/*.cu.",
    )


# Kernel names of torch itself and of the GEMM/convolution libraries, kept in step with guards.py's markers
# (which this torch-free module cannot import: guards.py belongs to the worker).
_TORCH_KERNEL_MARKERS = ("at::", "at_cuda_detail", "c10::", "pytorch_flash", "fmha", "triton_")
_LIBRARY_KERNEL_MARKERS = ("cublas", "cudnn", "cutlass", "xmma", "gemm", "gemv", "nvjet", "sm80_", "sm90_", "cub::",
                           # cuDNN's legacy convolution kernels, which carry no library prefix (a transposed
                           # convolution's data gradient: convolveNd_dgrad_float_engine, dgrad_engine, and the
                           # setTensor5d/scaleTensor kernels around them)
                           "convolve", "dgrad", "wgrad", "fft2d", "winograd", "settensor", "scaletensor")


def _is_torch_kernel(name: str) -> bool:
    return any(marker in name for marker in _TORCH_KERNEL_MARKERS)


def _is_library_kernel(name: str) -> bool:
    return any(marker in name.lower() for marker in _LIBRARY_KERNEL_MARKERS)


@functools.cache
def _base_name(kernel: str) -> str:
    """`void kp::relu_kernel<float>(float const*, float*, long)` -> `relu_kernel`."""
    path = qualified_name(kernel.replace("(anonymous namespace)", "anonymous"))
    return path[-1] if path else kernel
