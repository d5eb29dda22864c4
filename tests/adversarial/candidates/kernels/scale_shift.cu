// y = x * scale + shift, elementwise over float32, for the adversarial suite's honest and
// wrong-on-the-second-seed candidates.
#include <cstdint>

#include "kp_cuda.h"

namespace {

constexpr int kThreadsPerBlock = 256;
constexpr int kMaxBlocks = 4096;

__global__ void scale_shift_kernel(const float* x, float* y, int64_t n, float scale, float shift) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    y[i] = fmaf(x[i], scale, shift);
  }
}

}  // namespace

void kp_scale_shift_launch(const float* x, float* y, int64_t n, float scale, float shift, cudaStream_t stream) {
  if (n == 0) return;
  const int64_t blocks = kp::ceil_div(n, kThreadsPerBlock);
  scale_shift_kernel<<<static_cast<unsigned>(blocks > kMaxBlocks ? kMaxBlocks : blocks), kThreadsPerBlock, 0, stream>>>(
      x, y, n, scale, shift);
  KP_CHECK_LAUNCH();
}
