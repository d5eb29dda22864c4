// The kernel of the precomputing cheat (test_computed_ahead.py): an honest, plain C++ matrix product on the CPU.
#include <torch/types.h>

#include "kp_registry.h"

namespace {

torch::Tensor matmul(const torch::Tensor& a, const torch::Tensor& b) {
  TORCH_CHECK(a.is_contiguous() && b.is_contiguous() && a.dim() == 2 && b.dim() == 2 && a.size(1) == b.size(0),
              "matmul: contiguous 2-D float32 operands");
  torch::Tensor c = torch::zeros({a.size(0), b.size(1)}, a.options());
  if (a.is_meta()) return c;
  const int64_t n = a.size(0), k = a.size(1), m = b.size(1);
  const float* as = a.data_ptr<float>();
  const float* bs = b.data_ptr<float>();
  float* cs = c.data_ptr<float>();
  for (int64_t i = 0; i < n; ++i)
    for (int64_t p = 0; p < k; ++p) {
      const float x = as[i * k + p];
      for (int64_t j = 0; j < m; ++j) cs[i * m + j] += x * bs[p * m + j];
    }
  return c;
}

}  // namespace

KP_OP("matmul(Tensor a, Tensor b) -> Tensor", matmul);
