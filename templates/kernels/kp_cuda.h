// Torch-free CUDA helpers for kernels/*.cu (protected: do not edit).
//
// .cu files include this header and never a torch header, so nvcc compiles one in about a second
// and a half instead of twenty-five. Errors are thrown as std::runtime_error; torch's dispatcher passes them
// on to Python as a RuntimeError that names the file, the line and the failing call.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>
#include <string>

namespace kp {

[[noreturn]] inline void throw_cuda_error(cudaError_t err, const char* call, const char* file, int line) {
  throw std::runtime_error(std::string(file) + ":" + std::to_string(line) + ": " + call + " failed: " +
                           cudaGetErrorName(err) + " (" + cudaGetErrorString(err) + ")");
}

}  // namespace kp

// Wrap every CUDA runtime call: KP_CUDA_CHECK(cudaMemsetAsync(ptr, 0, bytes, stream));
#define KP_CUDA_CHECK(call)                                                          \
  do {                                                                               \
    const cudaError_t kp_status_ = (call);                                           \
    if (kp_status_ != cudaSuccess) ::kp::throw_cuda_error(kp_status_, #call, __FILE__, __LINE__); \
  } while (0)

// Put right after a <<<...>>> launch: a bad launch configuration (too many threads, too much
// shared memory) is reported at its cause instead of surfacing later as an unrelated error.
#define KP_CHECK_LAUNCH() KP_CUDA_CHECK(cudaGetLastError())

namespace kp {

// Blocks needed to cover `n` items with `per_block` items each.
inline int64_t ceil_div(int64_t n, int64_t per_block) { return (n + per_block - 1) / per_block; }

// True when `ptr` may be accessed with `bytes`-wide vector loads and stores (float4: 16).
inline bool is_aligned(const void* ptr, std::uintptr_t bytes) {
  return reinterpret_cast<std::uintptr_t>(ptr) % bytes == 0;
}

// Streaming multiprocessors of the current device, to size grid-stride launches.
inline int sm_count() {
  int device = 0;
  int count = 0;
  KP_CUDA_CHECK(cudaGetDevice(&device));
  KP_CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device));
  return count;
}

// Blocks of `kernel` that run at once on the whole current device (one full wave) with `threads` threads and
// `dynamic_smem` bytes of dynamic shared memory each: the grid size of a grid-stride launch. A larger grid
// leaves blocks waiting for a second wave that then runs almost empty.
template <typename Kernel>
inline int64_t resident_blocks(Kernel kernel, int threads, size_t dynamic_smem = 0) {
  int per_sm = 0;
  KP_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, dynamic_smem));
  return static_cast<int64_t>(per_sm > 0 ? per_sm : 1) * sm_count();
}

}  // namespace kp
