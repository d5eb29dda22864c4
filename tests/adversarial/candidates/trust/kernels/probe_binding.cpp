// The torch operators of probe.cu for the trust-boundary candidates. Nothing here calls torch compute: outputs
// and scratch space come from torch::empty*, everything else from the launchers.
#include <torch/types.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <vector>

#include "kp_registry.h"

void kp_touch_launch(const float* x, cudaStream_t stream);
void kp_fingerprint(const float* x, int64_t n, float* device_samples, float* host_samples, int64_t count,
                    cudaStream_t stream);
void kp_noise_launch(float* y, int64_t n, float center, float spread, uint32_t seed, cudaStream_t stream);
void kp_relu_unjoined_launch(const float* x, float* y, int64_t n);

namespace {

void check_float_cuda(const torch::Tensor& x, const char* op) {
  TORCH_CHECK(x.is_cuda() && x.scalar_type() == torch::kFloat32 && x.is_contiguous() && x.numel() > 0, op,
              ": x must be a non-empty contiguous float32 CUDA tensor");
}

cudaStream_t current_stream() { return c10::cuda::getCurrentCUDAStream().stream(); }

void touch(const torch::Tensor& x) {
  check_float_cuda(x, "touch");
  const c10::cuda::CUDAGuard guard(x.device());
  kp_touch_launch(x.data_ptr<float>(), current_stream());
}

std::vector<double> fingerprint(const torch::Tensor& x, int64_t count) {
  check_float_cuda(x, "fingerprint");
  TORCH_CHECK(count > 0, "fingerprint: count must be positive");
  const c10::cuda::CUDAGuard guard(x.device());
  torch::Tensor samples = torch::empty({count}, x.options());
  std::vector<float> host(static_cast<size_t>(count));
  kp_fingerprint(x.data_ptr<float>(), x.numel(), samples.data_ptr<float>(), host.data(), count, current_stream());
  return std::vector<double>(host.begin(), host.end());  // a schema's float[] is a list of doubles
}

torch::Tensor noise_like(const torch::Tensor& x, double center, double spread, int64_t seed) {
  check_float_cuda(x, "noise_like");
  const c10::cuda::CUDAGuard guard(x.device());
  torch::Tensor y = torch::empty_like(x);
  kp_noise_launch(y.data_ptr<float>(), y.numel(), static_cast<float>(center), static_cast<float>(spread),
                  static_cast<uint32_t>(seed), current_stream());
  return y;
}

torch::Tensor relu_unjoined(const torch::Tensor& x) {
  check_float_cuda(x, "relu_unjoined");
  const c10::cuda::CUDAGuard guard(x.device());
  torch::Tensor y = torch::empty_like(x);
  kp_relu_unjoined_launch(x.data_ptr<float>(), y.data_ptr<float>(), x.numel());
  return y;
}

}  // namespace

// reads x[0] in a one-thread kernel: a launch of the workspace, no work
KP_OP("touch(Tensor x) -> ()", touch);
// `count` evenly spaced elements of x, copied to the host without torch
KP_OP("fingerprint(Tensor x, int count) -> float[]", fingerprint);
// uniform values around `center`, `spread` wide, seeded; x is not read
KP_OP("noise_like(Tensor x, float center, float spread, int seed) -> Tensor", noise_like);
// y = max(x, 0) on a stream of its own that is never joined
KP_OP("relu_unjoined(Tensor x) -> Tensor", relu_unjoined);
