#include <torch/types.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "kp_registry.h"

void kp_softmax_rows_launch(const float* x, float* y, int64_t rows, int64_t cols, cudaStream_t stream);

namespace {

torch::Tensor softmax_rows(const torch::Tensor& x) {
  TORCH_CHECK(x.is_cuda(), "softmax_rows: x must be a CUDA tensor");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32, "softmax_rows: x must be float32");
  TORCH_CHECK(x.is_contiguous() && x.dim() >= 1, "softmax_rows: x must be contiguous with at least one dimension");
  const c10::cuda::CUDAGuard device_guard(x.device());
  torch::Tensor y = torch::empty_like(x);
  const int64_t cols = x.size(-1);
  const int64_t rows = cols == 0 ? 0 : x.numel() / cols;
  kp_softmax_rows_launch(x.data_ptr<float>(), y.data_ptr<float>(), rows, cols, c10::cuda::getCurrentCUDAStream().stream());
  return y;
}

}  // namespace

// softmax over the last dim
KP_OP("softmax_rows(Tensor x) -> Tensor", softmax_rows);
