// Softmax over the last dimension of a contiguous float32 tensor, reading each row from HBM once.
//
// Fast path (sm_90): a cluster of 8 blocks per row. Each block loads its eighth of the row into shared memory
// with float4 loads while keeping an online (max, sum of exp) pair per thread, reduces the pairs over the block,
// reads the other seven blocks' pairs through distributed shared memory, and writes exp(x - max) / sum from its
// shared copy. Short rows, and rows that do not split into 8 float4-aligned chunks fitting in shared memory, take
// the fallback: one block per row, two passes over HBM.
#include <cooperative_groups.h>

#include <climits>
#include <cstdint>
#include <stdexcept>

#include "kp_cuda.h"

namespace cg = cooperative_groups;

namespace {

constexpr int kThreads = 1024;
constexpr int kWarps = kThreads / 32;
constexpr int kClusterBlocks = 8;  // the portable maximum cluster size
constexpr int kLoadBatch = 4;      // float4 loads in flight per thread before they are consumed

// Running softmax statistics of a set of values: their max and the sum of exp(value - max).
struct Stats {
  float max;
  float sum;
};

constexpr Stats kEmpty{-INFINITY, 0.f};

__device__ __forceinline__ Stats merge(Stats a, Stats b) {
  const float max = fmaxf(a.max, b.max);
  // exp(-inf - -inf) would be NaN: an empty side (max = -inf, sum = 0) contributes nothing.
  const float a_part = a.max == -INFINITY ? 0.f : a.sum * __expf(a.max - max);
  const float b_part = b.max == -INFINITY ? 0.f : b.sum * __expf(b.max - max);
  return {max, a_part + b_part};
}

__device__ __forceinline__ Stats warp_merge(Stats stats) {
  for (int offset = 16; offset > 0; offset >>= 1) {
    const Stats other{__shfl_xor_sync(0xffffffff, stats.max, offset), __shfl_xor_sync(0xffffffff, stats.sum, offset)};
    stats = merge(stats, other);
  }
  return stats;
}

// Merges every thread's stats; the result is valid in warp 0 only. `warp_stats` holds kWarps entries.
__device__ __forceinline__ Stats block_merge(Stats stats, Stats* warp_stats) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  stats = warp_merge(stats);
  if (lane == 0) warp_stats[warp] = stats;
  __syncthreads();
  return warp == 0 ? warp_merge(warp_stats[lane]) : kEmpty;  // kWarps == 32: one partial per lane
}

__device__ __forceinline__ float max4(float4 v) { return fmaxf(fmaxf(v.x, v.y), fmaxf(v.z, v.w)); }

__device__ __forceinline__ float4 normalized(float4 v, float max, float inv_sum) {
  return {__expf(v.x - max) * inv_sum, __expf(v.y - max) * inv_sum, __expf(v.z - max) * inv_sum,
          __expf(v.w - max) * inv_sum};
}

// Grid: kClusterBlocks blocks per row; block b handles float4s [b * chunk4, (b + 1) * chunk4) of the tensor, so the
// cluster of blocks 8r .. 8r+7 covers row r. Dynamic shared memory: chunk4 float4s.
__global__ void __cluster_dims__(kClusterBlocks, 1, 1) __launch_bounds__(kThreads, 1)
    softmax_rows_cluster(const float4* __restrict__ x, float4* __restrict__ y, int64_t chunk4) {
  extern __shared__ float4 chunk[];
  __shared__ Stats warp_stats[kWarps];
  __shared__ Stats block_stats;  // read by the other blocks of the cluster
  __shared__ Stats row_stats;

  const int64_t first = static_cast<int64_t>(blockIdx.x) * chunk4;
  const float4* src = x + first;
  Stats stats = kEmpty;
  for (int64_t base = threadIdx.x; base < chunk4; base += kThreads * kLoadBatch) {
    float4 v[kLoadBatch];
    float batch_max = stats.max;
#pragma unroll
    for (int k = 0; k < kLoadBatch; ++k) {
      const int64_t i = base + k * kThreads;
      v[k] = i < chunk4 ? __ldcs(src + i) : make_float4(-INFINITY, -INFINITY, -INFINITY, -INFINITY);
      batch_max = fmaxf(batch_max, max4(v[k]));
    }
    // All values so far are -inf: they add nothing, and exp(-inf - -inf) would be NaN.
    if (batch_max != -INFINITY) {
      float sum = stats.max == -INFINITY ? 0.f : stats.sum * __expf(stats.max - batch_max);
#pragma unroll
      for (int k = 0; k < kLoadBatch; ++k) {
        sum += __expf(v[k].x - batch_max) + __expf(v[k].y - batch_max) + __expf(v[k].z - batch_max) +
               __expf(v[k].w - batch_max);
      }
      stats = {batch_max, sum};
    }
#pragma unroll
    for (int k = 0; k < kLoadBatch; ++k) {
      const int64_t i = base + k * kThreads;
      if (i < chunk4) chunk[i] = v[k];
    }
  }

  stats = block_merge(stats, warp_stats);
  if (threadIdx.x == 0) block_stats = stats;
  cg::cluster_group cluster = cg::this_cluster();
  cluster.sync();  // every block's block_stats is written and visible cluster-wide

  if (threadIdx.x < 32) {
    const int lane = threadIdx.x;
    const Stats remote = lane < kClusterBlocks ? *cluster.map_shared_rank(&block_stats, lane) : kEmpty;
    const Stats row = warp_merge(remote);
    if (lane == 0) row_stats = row;
  }
  // Arrive now, wait before exit: no block may exit (freeing its shared memory) while another still reads it.
  cluster.barrier_arrive();
  __syncthreads();  // row_stats is written

  const float row_max = row_stats.max, inv_sum = 1.f / row_stats.sum;
  float4* dst = y + first;
  for (int64_t i = threadIdx.x; i < chunk4; i += kThreads) __stcs(dst + i, normalized(chunk[i], row_max, inv_sum));
  cluster.barrier_wait();
}

// Adds one value to running stats; -inf adds nothing (and exp(-inf - -inf) would be NaN).
__device__ __forceinline__ Stats add(Stats stats, float value) {
  if (value == -INFINITY) return stats;
  if (value > stats.max) {
    return {value, (stats.max == -INFINITY ? 0.f : stats.sum * __expf(stats.max - value)) + 1.f};
  }
  return {stats.max, stats.sum + __expf(value - stats.max)};
}

// Fallback, one block per row: pass 1 merges the row's stats, pass 2 reads the row again and writes the result.
__global__ void __launch_bounds__(kThreads) softmax_rows_two_pass(const float* __restrict__ x, float* __restrict__ y,
                                                                  int64_t cols, bool vectorized) {
  const float* row = x + static_cast<int64_t>(blockIdx.x) * cols;
  float* out = y + static_cast<int64_t>(blockIdx.x) * cols;
  const int64_t vec_cols = vectorized ? cols / 4 : 0;
  const float4* row4 = reinterpret_cast<const float4*>(row);
  Stats stats = kEmpty;
  for (int64_t i = threadIdx.x; i < vec_cols; i += kThreads) {
    const float4 v = row4[i];
    stats = add(add(add(add(stats, v.x), v.y), v.z), v.w);
  }
  for (int64_t i = vec_cols * 4 + threadIdx.x; i < cols; i += kThreads) stats = add(stats, row[i]);

  __shared__ Stats warp_stats[kWarps];
  __shared__ Stats row_stats;
  stats = block_merge(stats, warp_stats);
  if (threadIdx.x == 0) row_stats = stats;
  __syncthreads();
  const float row_max = row_stats.max, inv_sum = 1.f / row_stats.sum;

  float4* out4 = reinterpret_cast<float4*>(out);
  for (int64_t i = threadIdx.x; i < vec_cols; i += kThreads) out4[i] = normalized(row4[i], row_max, inv_sum);
  for (int64_t i = vec_cols * 4 + threadIdx.x; i < cols; i += kThreads) out[i] = __expf(row[i] - row_max) * inv_sum;
}

// Shared memory one cluster block may use for its chunk on the current device, after its static shared memory.
int64_t cluster_chunk_capacity_bytes() {
  int device = 0, optin = 0;
  KP_CUDA_CHECK(cudaGetDevice(&device));
  KP_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  cudaFuncAttributes attributes{};
  KP_CUDA_CHECK(cudaFuncGetAttributes(&attributes, softmax_rows_cluster));
  return static_cast<int64_t>(optin) - static_cast<int64_t>(attributes.sharedSizeBytes);
}

// Rows shorter than one float4 per cluster thread take the fallback: its second read of a row that small mostly
// hits L2, and most of a cluster's threads would idle.
bool fits_cluster_path(const float* x, const float* y, int64_t rows, int64_t cols) {
  const int64_t chunk_bytes = cols / kClusterBlocks * static_cast<int64_t>(sizeof(float));
  return cols % (kClusterBlocks * 4) == 0 && cols >= int64_t{kClusterBlocks} * kThreads * 4 &&
         kp::is_aligned(x, 16) && kp::is_aligned(y, 16) && rows <= INT_MAX / kClusterBlocks &&
         chunk_bytes <= cluster_chunk_capacity_bytes();
}

}  // namespace

void kp_softmax_rows_launch(const float* x, float* y, int64_t rows, int64_t cols, cudaStream_t stream) {
  if (rows == 0 || cols == 0) return;
  if (fits_cluster_path(x, y, rows, cols)) {
    const int64_t chunk4 = cols / (kClusterBlocks * 4);
    const int chunk_bytes = static_cast<int>(chunk4 * sizeof(float4));
    KP_CUDA_CHECK(cudaFuncSetAttribute(softmax_rows_cluster, cudaFuncAttributeMaxDynamicSharedMemorySize, chunk_bytes));
    const unsigned blocks = static_cast<unsigned>(rows * kClusterBlocks);
    softmax_rows_cluster<<<blocks, kThreads, chunk_bytes, stream>>>(reinterpret_cast<const float4*>(x),
                                                                     reinterpret_cast<float4*>(y), chunk4);
    KP_CHECK_LAUNCH();
    return;
  }
  if (rows > INT_MAX) throw std::invalid_argument("softmax_rows: more than INT_MAX rows");
  const bool vectorized = kp::is_aligned(x, 16) && kp::is_aligned(y, 16) && cols % 4 == 0;
  softmax_rows_two_pass<<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(x, y, cols, vectorized);
  KP_CHECK_LAUNCH();
}
