"""Where torch.compile's time goes on examples/conv2d_relu_bias.py (a diagnostic script, GPU only).

Prints the CUDA kernels of one call, with the median of 20 event-timed calls, for eager, torch.compile, and torch's
own convolution on NCHW and on channels-last (NHWC) tensors, cuDNN benchmark mode off and on. Run from the repo root:

    python3 scripts/diag_conv2d_relu_bias.py
"""

import importlib.util
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "conv2d_relu_bias.py"


def load_example():
    spec = importlib.util.spec_from_file_location("conv2d_relu_bias", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def median_ms(fn, calls: int = 20) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(calls):
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[calls // 2]


def show_kernels(fn, label: str, top: int = 6) -> None:
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    print(f"-- {label}: median {median_ms(fn):.3f} ms")
    for row in sorted(prof.key_averages(), key=lambda row: -row.device_time_total)[:top]:
        if row.device_time_total > 0:
            print(f"   {row.device_time_total / 1e3:8.3f} ms  x{row.count}  {row.key[:110]}")


def main() -> None:
    example = load_example()
    torch.manual_seed(0)
    model = example.Model(*example.get_init_inputs()).cuda()
    x = example.get_inputs()[0].cuda()
    weight, bias = model.conv.weight, model.conv.bias
    x_nhwc = x.contiguous(memory_format=torch.channels_last)
    weight_nhwc = weight.contiguous(memory_format=torch.channels_last)
    print("cudnn.allow_tf32", torch.backends.cudnn.allow_tf32, "cudnn.benchmark", torch.backends.cudnn.benchmark)
    with torch.no_grad():
        compiled = torch.compile(model)
        show_kernels(lambda: model(x), "eager")
        show_kernels(lambda: compiled(x), "torch.compile")
        show_kernels(lambda: F.conv2d(x, weight, bias, padding=1), "conv NCHW")
        show_kernels(lambda: F.conv2d(x_nhwc, weight_nhwc, bias, padding=1), "conv NHWC (input already NHWC)")
        show_kernels(lambda: x.contiguous(memory_format=torch.channels_last), "input to NHWC")
        torch.backends.cudnn.benchmark = True
        show_kernels(lambda: F.conv2d(x, weight, bias, padding=1), "conv NCHW benchmark=True")
        show_kernels(lambda: F.conv2d(x_nhwc, weight_nhwc, bias, padding=1), "conv NHWC benchmark=True")


if __name__ == "__main__":
    main()
