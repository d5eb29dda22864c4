// Worked example (edit or delete it): y = x * a + b over a float32 array.
//
// The pattern every kernel here follows: the .cu file holds the kernel and a launcher that takes raw
// pointers, sizes and a stream, and includes no torch header, so it recompiles in about a second
// and a half. Tensors are unpacked and checked in example_scale_shift_binding.cpp.
#include <algorithm>
#include <cstdint>

#include "kp_cuda.h"

namespace {

constexpr int kThreadsPerBlock = 256;
constexpr int kBlocksPerSm = 4;

// Grid-stride loop: each thread reads and writes 16 bytes at a time (one float4) over the first
// `vector_count` float4s, then the threads share the scalar tail (fewer than 4 elements when the
// pointers are 16-byte aligned, everything when they are not).
__global__ void scale_shift_kernel(const float* __restrict__ x, float* __restrict__ y, int64_t n,
                                   int64_t vector_count, float a, float b) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;

  const float4* x4 = reinterpret_cast<const float4*>(x);
  float4* y4 = reinterpret_cast<float4*>(y);
  for (int64_t i = first; i < vector_count; i += stride) {
    float4 v = x4[i];
    v.x = fmaf(v.x, a, b);
    v.y = fmaf(v.y, a, b);
    v.z = fmaf(v.z, a, b);
    v.w = fmaf(v.w, a, b);
    y4[i] = v;
  }
  for (int64_t i = vector_count * 4 + first; i < n; i += stride) {
    y[i] = fmaf(x[i], a, b);
  }
}

}  // namespace

void kp_scale_shift_launch(const float* x, float* y, int64_t n, float a, float b, cudaStream_t stream) {
  if (n == 0) return;
  const bool vectorizable = kp::is_aligned(x, 16) && kp::is_aligned(y, 16);
  const int64_t vector_count = vectorizable ? n / 4 : 0;
  const int64_t work_items = vectorizable ? vector_count + n % 4 : n;
  // Enough blocks to fill every SM a few times over; the grid-stride loop covers the rest.
  const int64_t blocks = std::min<int64_t>(kp::ceil_div(work_items, kThreadsPerBlock),
                                           static_cast<int64_t>(kp::sm_count()) * kBlocksPerSm);
  scale_shift_kernel<<<static_cast<unsigned>(blocks), kThreadsPerBlock, 0, stream>>>(x, y, n, vector_count, a, b);
  KP_CHECK_LAUNCH();
}
