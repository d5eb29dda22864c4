// The torch operator of row_softmax.cu.
#include <torch/types.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "kp_registry.h"

void kp_row_softmax_launch(const float* x, float* y, int64_t rows, int64_t cols, cudaStream_t stream);

namespace {

torch::Tensor row_softmax(const torch::Tensor& x) {
  TORCH_CHECK(x.is_cuda() && x.scalar_type() == torch::kFloat32 && x.is_contiguous() && x.dim() >= 1,
              "row_softmax: x must be a contiguous float32 CUDA tensor");
  const c10::cuda::CUDAGuard guard(x.device());
  torch::Tensor y = torch::empty_like(x);
  const int64_t cols = x.size(-1);
  kp_row_softmax_launch(x.data_ptr<float>(), y.data_ptr<float>(), cols ? x.numel() / cols : 0, cols,
                        c10::cuda::getCurrentCUDAStream().stream());
  return y;
}

}  // namespace

// softmax over the last dimension
KP_OP("row_softmax(Tensor x) -> Tensor", row_softmax);
