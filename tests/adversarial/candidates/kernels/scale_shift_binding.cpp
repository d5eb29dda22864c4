// The torch operator of scale_shift.cu.
#include <torch/types.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "kp_registry.h"

void kp_scale_shift_launch(const float* x, float* y, int64_t n, float scale, float shift, cudaStream_t stream);

namespace {

torch::Tensor scale_shift(const torch::Tensor& x, double scale, double shift) {
  TORCH_CHECK(x.is_cuda() && x.scalar_type() == torch::kFloat32 && x.is_contiguous(),
              "scale_shift: x must be a contiguous float32 CUDA tensor");
  const c10::cuda::CUDAGuard guard(x.device());
  torch::Tensor y = torch::empty_like(x);
  kp_scale_shift_launch(x.data_ptr<float>(), y.data_ptr<float>(), x.numel(), static_cast<float>(scale),
                        static_cast<float>(shift), c10::cuda::getCurrentCUDAStream().stream());
  return y;
}

}  // namespace

// y = x * scale + shift
KP_OP("scale_shift(Tensor x, float scale, float shift) -> Tensor", scale_shift);
