"""Trace: a problem's forward as an aten graph on meta tensors (shapes and dtypes, no memory) with `make_fx`,
whatever Python spelling the problem used, and the Source of each of its placeholders.

The trace is functionalised (`torch.func.functionalize`, mutations removed, views kept): `x.relu_()` and `x += y`
become relu and add, and a write through a view becomes a scatter into its base, so every later reader of either
sees the written value. A write into a forward argument or a parameter stays, as a `copy_` into it at the end.

A forward of more than MAX_FORWARD_OPS aten ops is not traced: a recurrent network unrolls its loop over the
sequence into tens of thousands of ops (an LSTM of 6 layers over 512 steps), which make_fx takes minutes to
record, and the policy would write thousands of kernels for it. Counting ops on the eager meta run that checks
the return type costs about a second at the limit."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kernelpilot.policy.ir import Source, dtype_name

if TYPE_CHECKING:
    import torch

    from kernelpilot.problem import Problem

# The most aten ops a forward may run to be traced. KernelBench's largest networks run about 600, a vanilla RNN
# over 256 steps about 2,000; make_fx records a few hundred ops a second, so a forward at the limit is traced in
# well under ten seconds.
MAX_FORWARD_OPS = 3000


class ForwardTooLong(Exception):
    """The forward ran more than MAX_FORWARD_OPS aten ops on meta tensors."""


def trace(problem: Problem, model: torch.nn.Module, inputs: list) -> tuple[Any, list[Source], str]:
    """The aten graph of forward on meta tensors, the Source of each placeholder, and its output container."""
    import torch
    from torch.func import functional_call, functionalize
    from torch.fx.experimental.proxy_tensor import make_fx

    state = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    tensor_positions = [i for i, value in enumerate(inputs) if isinstance(value, torch.Tensor)]

    def forward(state: dict, *tensors: torch.Tensor) -> Any:
        arguments = list(inputs)
        for position, tensor in zip(tensor_positions, tensors):
            arguments[position] = tensor
        return functional_call(model, state, tuple(arguments))

    tensors = [inputs[i] for i in tensor_positions]
    with _op_budget(MAX_FORWARD_OPS):
        returned = model(*inputs)
    if not (isinstance(returned, torch.Tensor) or is_flat_tuple_of_tensors(returned)):
        raise TypeError(f"forward returns {type(returned).__name__}, not a tensor or a tuple of tensors")
    with _numbers_on_cpu():
        try:
            graph_module = make_fx(functionalize(forward, remove="mutations"))(state, *tensors)
        except Exception:  # noqa: BLE001 - functionalisation fails on a few forwards (torch asserts): trace as
            graph_module = make_fx(forward)(state, *tensors)  # written, where in-place ops stay and are named
    graph_module.graph.eliminate_dead_code()
    names = forward_names(problem)
    sources = [Source("parameter", name, tuple(t.shape), dtype_name(t.dtype)) for name, t in state.items()]
    sources += [Source("input", names[i], tuple(inputs[i].shape), dtype_name(inputs[i].dtype)) for i in tensor_positions]
    return graph_module.graph, sources, "tensor" if isinstance(returned, torch.Tensor) else type(returned).__name__


def _numbers_on_cpu() -> Any:
    """A function mode that makes torch.tensor(number, device=x.device) on the CPU while tracing: on the meta device
    its value would be lost, while a CPU 0-d tensor mixes with meta tensors as a number does and the trace keeps it
    as a constant with its value (analysis.py reads it as that number)."""
    import torch
    from torch.overrides import TorchFunctionMode

    makers = (torch.tensor, torch.as_tensor, torch.scalar_tensor)

    class NumbersOnCpu(TorchFunctionMode):
        def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
            kwargs = kwargs or {}
            if func in makers and args and isinstance(args[0], (bool, int, float)):
                kwargs = {**kwargs, "device": "cpu"}
            return func(*args, **kwargs)

    return NumbersOnCpu()


def _op_budget(limit: int) -> Any:
    """A dispatch mode that raises ForwardTooLong at the (limit + 1)-th aten op run under it."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class OpBudget(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.count = 0

        def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
            self.count += 1
            if self.count > limit:
                raise ForwardTooLong(f"runs more than {limit} aten ops")
            return func(*args, **(kwargs or {}))

    return OpBudget()


def meta_model_and_inputs(problem: Problem) -> tuple[torch.nn.Module, list]:
    """Model and its inputs on meta tensors. A Model whose __init__ needs values (`.item()` of a linspace) is built
    on the CPU, within the host memory available, then moved to meta, as loading the problem did."""
    import torch

    from kernelpilot.host_budget import HostBudget
    from kernelpilot.problem_size import host_memory_available

    with torch.device("meta"):
        inputs = problem.make_inputs()
        try:
            return problem.make_model(), inputs
        except Exception:  # noqa: BLE001 - retried on the CPU, whose failure is the one reported
            pass
    with HostBudget(host_memory_available()):
        model = problem.make_model()
    return model.to("meta"), inputs


def is_flat_tuple_of_tensors(value: Any) -> bool:
    import torch

    return type(value) in (tuple, list) and all(isinstance(item, torch.Tensor) for item in value)


def forward_names(problem: Problem) -> list[str]:
    return list(problem.forward_signature().parameters)
