// Helper kernels for the trust-boundary candidates (../*.py): the pieces a cheat needs to look busy to a
// profiler, read a few inputs without torch, make up plausible values, or compute where no event looks.
// Launchers are torch-free (raw pointers, sizes, a stream), as in a workspace.
#include <cstdint>

#include "kp_cuda.h"

namespace {

constexpr int kThreadsPerBlock = 256;
constexpr int kMaxBlocks = 4096;

__device__ float kp_touched = 0.0f;

__device__ __forceinline__ int64_t first_index() { return static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; }

__device__ __forceinline__ int64_t grid_stride() { return static_cast<int64_t>(gridDim.x) * blockDim.x; }

// One thread reads one element: a kernel of the workspace shows in the profile, and nothing is computed.
__global__ void touch_kernel(const float* x) { kp_touched = x[0]; }

// `count` elements spread evenly over x, for a content fingerprint.
__global__ void gather_kernel(const float* x, int64_t n, float* samples, int64_t count) {
  for (int64_t i = first_index(); i < count; i += grid_stride()) samples[i] = x[(i * n) / count];
}

// Uniform values in [center - spread/2, center + spread/2) from a hash of (seed, index); reads no input.
__global__ void noise_kernel(float* y, int64_t n, float center, float spread, uint32_t seed) {
  for (int64_t i = first_index(); i < n; i += grid_stride()) {
    uint32_t h = static_cast<uint32_t>(i) * 2654435761u ^ seed * 2246822519u;
    h ^= h >> 15;
    h *= 2246822519u;
    h ^= h >> 13;
    const float unit = static_cast<float>(h >> 8) * (1.0f / 16777216.0f);
    y[i] = center + spread * (unit - 0.5f);
  }
}

__global__ void side_relu_kernel(const float* x, float* y, int64_t n) {
  for (int64_t i = first_index(); i < n; i += grid_stride()) y[i] = x[i] > 0.0f ? x[i] : 0.0f;
}

unsigned blocks_for(int64_t n) {
  const int64_t blocks = kp::ceil_div(n, kThreadsPerBlock);
  return static_cast<unsigned>(blocks < 1 ? 1 : (blocks > kMaxBlocks ? kMaxBlocks : blocks));
}

cudaStream_t unjoined_stream() {
  static cudaStream_t stream = [] {
    cudaStream_t created = nullptr;
    KP_CUDA_CHECK(cudaStreamCreateWithFlags(&created, cudaStreamNonBlocking));
    return created;
  }();
  return stream;
}

}  // namespace

void kp_touch_launch(const float* x, cudaStream_t stream) {
  touch_kernel<<<1, 1, 0, stream>>>(x);
  KP_CHECK_LAUNCH();
}

void kp_fingerprint(const float* x, int64_t n, float* device_samples, float* host_samples, int64_t count,
                    cudaStream_t stream) {
  gather_kernel<<<blocks_for(count), kThreadsPerBlock, 0, stream>>>(x, n, device_samples, count);
  KP_CHECK_LAUNCH();
  KP_CUDA_CHECK(cudaMemcpyAsync(host_samples, device_samples, count * sizeof(float), cudaMemcpyDeviceToHost, stream));
  KP_CUDA_CHECK(cudaStreamSynchronize(stream));
}

void kp_noise_launch(float* y, int64_t n, float center, float spread, uint32_t seed, cudaStream_t stream) {
  noise_kernel<<<blocks_for(n), kThreadsPerBlock, 0, stream>>>(y, n, center, spread, seed);
  KP_CHECK_LAUNCH();
}

void kp_relu_unjoined_launch(const float* x, float* y, int64_t n) {
  side_relu_kernel<<<blocks_for(n), kThreadsPerBlock, 0, unjoined_stream()>>>(x, y, n);
  KP_CHECK_LAUNCH();
}
