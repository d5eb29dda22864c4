// ReLU kernels for the adversarial suite: one honest kernel and the broken or cheating variants that
// candidates in ../ call. Launchers are torch-free (raw pointers, sizes, a stream), as in a workspace.
#include <cuda_bf16.h>

#include <cstdint>

#include "kp_cuda.h"

namespace {

constexpr int kThreadsPerBlock = 256;
constexpr int kMaxBlocks = 4096;
// About 6 ms at H100 clocks: long enough that a reader on another stream sees the output unwritten.
constexpr long long kDelayCycles = 10'000'000;
// 2^38 floats (1 TiB) past the output: no allocation reaches that far.
constexpr int64_t kFarOffset = int64_t{1} << 38;

__device__ int kp_never_set = 0;

__device__ __forceinline__ float relu(float v) { return v > 0.0f ? v : 0.0f; }

__device__ __forceinline__ int64_t first_index() { return static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; }

__device__ __forceinline__ int64_t grid_stride() { return static_cast<int64_t>(gridDim.x) * blockDim.x; }

__global__ void relu_kernel(const float* x, float* y, int64_t n) {
  for (int64_t i = first_index(); i < n; i += grid_stride()) y[i] = relu(x[i]);
}

// Writes the result and then zeroes the input element it read.
__global__ void relu_scribble_kernel(float* x, float* y, int64_t n) {
  for (int64_t i = first_index(); i < n; i += grid_stride()) {
    y[i] = relu(x[i]);
    x[i] = 0.0f;
  }
}

// Correct values, written only after a delay.
__global__ void relu_slow_kernel(const float* x, float* y, int64_t n) {
  const long long start = clock64();
  while (clock64() - start < kDelayCycles) {
  }
  for (int64_t i = first_index(); i < n; i += grid_stride()) y[i] = relu(x[i]);
}

// Computes in bf16: every output is the fp32 result rounded to bf16.
__global__ void relu_bf16_kernel(const float* x, float* y, int64_t n) {
  for (int64_t i = first_index(); i < n; i += grid_stride()) {
    y[i] = __bfloat162float(__float2bfloat16(relu(x[i])));
  }
}

// Skips the last `skipped` elements, leaving whatever the allocator's memory held.
__global__ void relu_partial_kernel(const float* x, float* y, int64_t n, int64_t skipped) {
  for (int64_t i = first_index(); i < n - skipped; i += grid_stride()) y[i] = relu(x[i]);
}

// Writes each result far out of bounds as well.
__global__ void relu_far_write_kernel(const float* x, float* y, int64_t n) {
  for (int64_t i = first_index(); i < n; i += grid_stride()) {
    y[i] = relu(x[i]);
    y[i + kFarOffset] = relu(x[i]);
  }
}

// Waits for a flag nothing ever sets.
__global__ void spin_kernel(float* y) {
  while (atomicAdd(&kp_never_set, 0) == 0) {
  }
  y[0] = 0.0f;
}

unsigned blocks_for(int64_t n) {
  const int64_t blocks = kp::ceil_div(n, kThreadsPerBlock);
  return static_cast<unsigned>(blocks < 1 ? 1 : (blocks > kMaxBlocks ? kMaxBlocks : blocks));
}

cudaStream_t side_stream() {
  static cudaStream_t stream = [] {
    cudaStream_t created = nullptr;
    KP_CUDA_CHECK(cudaStreamCreateWithFlags(&created, cudaStreamNonBlocking));
    return created;
  }();
  return stream;
}

}  // namespace

void kp_relu_launch(const float* x, float* y, int64_t n, cudaStream_t stream) {
  relu_kernel<<<blocks_for(n), kThreadsPerBlock, 0, stream>>>(x, y, n);
  KP_CHECK_LAUNCH();
}

void kp_relu_scribble_launch(float* x, float* y, int64_t n, cudaStream_t stream) {
  relu_scribble_kernel<<<blocks_for(n), kThreadsPerBlock, 0, stream>>>(x, y, n);
  KP_CHECK_LAUNCH();
}

void kp_relu_side_stream_launch(const float* x, float* y, int64_t n) {
  relu_slow_kernel<<<blocks_for(n), kThreadsPerBlock, 0, side_stream()>>>(x, y, n);
  KP_CHECK_LAUNCH();
}

void kp_relu_bf16_launch(const float* x, float* y, int64_t n, cudaStream_t stream) {
  relu_bf16_kernel<<<blocks_for(n), kThreadsPerBlock, 0, stream>>>(x, y, n);
  KP_CHECK_LAUNCH();
}

void kp_relu_partial_launch(const float* x, float* y, int64_t n, int64_t skipped, cudaStream_t stream) {
  relu_partial_kernel<<<blocks_for(n), kThreadsPerBlock, 0, stream>>>(x, y, n, skipped);
  KP_CHECK_LAUNCH();
}

void kp_relu_far_write_launch(const float* x, float* y, int64_t n, cudaStream_t stream) {
  relu_far_write_kernel<<<blocks_for(n), kThreadsPerBlock, 0, stream>>>(x, y, n);
  KP_CHECK_LAUNCH();
}

void kp_spin_launch(float* y, cudaStream_t stream) {
  spin_kernel<<<1, 1, 0, stream>>>(y);
  KP_CHECK_LAUNCH();
}
