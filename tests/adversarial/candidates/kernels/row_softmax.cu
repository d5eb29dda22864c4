// Softmax over the last dimension of a float32 matrix: one block per row, max and sum reduced with
// warp shuffles and one shared-memory exchange between warps.
#include <cmath>
#include <cstdint>

#include "kp_cuda.h"

namespace {

constexpr int kThreadsPerBlock = 256;
constexpr int kWarpSize = 32;
constexpr unsigned kFullMask = 0xffffffffu;

struct Max {
  __device__ static float apply(float a, float b) { return fmaxf(a, b); }
  static constexpr float kIdentity = -INFINITY;
};

struct Sum {
  __device__ static float apply(float a, float b) { return a + b; }
  static constexpr float kIdentity = 0.0f;
};

template <typename Op>
__device__ float warp_reduce(float value) {
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    value = Op::apply(value, __shfl_xor_sync(kFullMask, value, offset));
  }
  return value;
}

// Every thread of the block gets the reduction of all threads' values.
template <typename Op>
__device__ float block_reduce(float value, float* warp_results) {
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  value = warp_reduce<Op>(value);
  if (lane == 0) warp_results[warp] = value;
  __syncthreads();
  const int warps = blockDim.x / kWarpSize;
  value = lane < warps ? warp_results[lane] : Op::kIdentity;
  value = warp_reduce<Op>(value);
  __syncthreads();  // warp_results is reused by the next reduction
  return value;
}

__global__ void row_softmax_kernel(const float* x, float* y, int64_t cols) {
  __shared__ float warp_results[kThreadsPerBlock / kWarpSize];
  const float* row = x + static_cast<int64_t>(blockIdx.x) * cols;
  float* out = y + static_cast<int64_t>(blockIdx.x) * cols;

  float row_max = -INFINITY;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) row_max = fmaxf(row_max, row[c]);
  row_max = block_reduce<Max>(row_max, warp_results);

  float row_sum = 0.0f;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) row_sum += expf(row[c] - row_max);
  row_sum = block_reduce<Sum>(row_sum, warp_results);

  const float inverse = 1.0f / row_sum;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) out[c] = expf(row[c] - row_max) * inverse;
}

}  // namespace

void kp_row_softmax_launch(const float* x, float* y, int64_t rows, int64_t cols, cudaStream_t stream) {
  if (rows == 0 || cols == 0) return;
  row_softmax_kernel<<<static_cast<unsigned>(rows), kThreadsPerBlock, 0, stream>>>(x, y, cols);
  KP_CHECK_LAUNCH();
}
