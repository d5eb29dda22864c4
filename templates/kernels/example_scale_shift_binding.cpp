// Worked example (edit or delete it): the torch operator of kernels/example_scale_shift.cu.
//
// A binding checks its tensors, allocates outputs, calls the torch-free launcher on torch's current
// stream and registers itself as an operator with KP_OP. Only slim headers: torch/types.h, the CUDA
// stream and guard headers of c10, and kp_registry.h (never torch/extension.h, which costs seconds per
// compile).
#include <torch/types.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "kp_registry.h"

// Defined in example_scale_shift.cu.
void kp_scale_shift_launch(const float* x, float* y, int64_t n, float a, float b, cudaStream_t stream);

namespace {

torch::Tensor scale_shift(const torch::Tensor& x, double a, double b) {
  TORCH_CHECK(x.is_cuda() || x.is_meta(), "scale_shift: x must be a CUDA tensor, got one on ", x.device());
  TORCH_CHECK(x.scalar_type() == torch::kFloat32, "scale_shift: x must be float32, got ", x.scalar_type());
  TORCH_CHECK(x.is_contiguous(), "scale_shift: x must be contiguous");

  torch::Tensor y = torch::empty_like(x);
  // A meta tensor has a shape and no data: torch.compile and opcheck call the op on one to learn the
  // output's shape and dtype, so the function returns before the launch.
  if (x.is_meta()) return y;

  // Launch on x's device even when another device is current.
  const c10::cuda::CUDAGuard device_guard(x.device());
  kp_scale_shift_launch(x.data_ptr<float>(), y.data_ptr<float>(), x.numel(), static_cast<float>(a),
                        static_cast<float>(b), c10::cuda::getCurrentCUDAStream().stream());
  return y;
}

}  // namespace

// y = x * a + b, elementwise, for a contiguous float32 CUDA tensor x.
KP_OP("scale_shift(Tensor x, float a, float b) -> Tensor", scale_shift);
