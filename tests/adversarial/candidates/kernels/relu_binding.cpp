// The torch operators of relu.cu for the adversarial suite: each function checks its tensor, allocates
// the output and calls one launcher on torch's current stream (relu_side_stream on its own stream).
#include <torch/types.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "kp_registry.h"

void kp_relu_launch(const float* x, float* y, int64_t n, cudaStream_t stream);
void kp_relu_scribble_launch(float* x, float* y, int64_t n, cudaStream_t stream);
void kp_relu_side_stream_launch(const float* x, float* y, int64_t n);
void kp_relu_bf16_launch(const float* x, float* y, int64_t n, cudaStream_t stream);
void kp_relu_partial_launch(const float* x, float* y, int64_t n, int64_t skipped, cudaStream_t stream);
void kp_relu_far_write_launch(const float* x, float* y, int64_t n, cudaStream_t stream);
void kp_spin_launch(float* y, cudaStream_t stream);

namespace {

void check_input(const torch::Tensor& x, const char* op) {
  TORCH_CHECK(x.is_cuda(), op, ": x must be a CUDA tensor, got one on ", x.device());
  TORCH_CHECK(x.scalar_type() == torch::kFloat32, op, ": x must be float32, got ", x.scalar_type());
  TORCH_CHECK(x.is_contiguous(), op, ": x must be contiguous");
}

cudaStream_t current_stream() { return c10::cuda::getCurrentCUDAStream().stream(); }

torch::Tensor relu(const torch::Tensor& x) {
  check_input(x, "relu");
  const c10::cuda::CUDAGuard guard(x.device());
  torch::Tensor y = torch::empty_like(x);
  kp_relu_launch(x.data_ptr<float>(), y.data_ptr<float>(), x.numel(), current_stream());
  return y;
}

torch::Tensor relu_into(const torch::Tensor& x, torch::Tensor out) {
  check_input(x, "relu_into");
  check_input(out, "relu_into");
  TORCH_CHECK(out.numel() == x.numel(), "relu_into: out must have as many elements as x");
  const c10::cuda::CUDAGuard guard(x.device());
  kp_relu_launch(x.data_ptr<float>(), out.data_ptr<float>(), x.numel(), current_stream());
  return out;
}

torch::Tensor relu_scribble(torch::Tensor x) {
  check_input(x, "relu_scribble");
  const c10::cuda::CUDAGuard guard(x.device());
  torch::Tensor y = torch::empty_like(x);
  kp_relu_scribble_launch(x.data_ptr<float>(), y.data_ptr<float>(), x.numel(), current_stream());
  return y;
}

torch::Tensor relu_side_stream(const torch::Tensor& x) {
  check_input(x, "relu_side_stream");
  const c10::cuda::CUDAGuard guard(x.device());
  torch::Tensor y = torch::empty_like(x);
  kp_relu_side_stream_launch(x.data_ptr<float>(), y.data_ptr<float>(), x.numel());
  return y;
}

torch::Tensor relu_bf16(const torch::Tensor& x) {
  check_input(x, "relu_bf16");
  const c10::cuda::CUDAGuard guard(x.device());
  torch::Tensor y = torch::empty_like(x);
  kp_relu_bf16_launch(x.data_ptr<float>(), y.data_ptr<float>(), x.numel(), current_stream());
  return y;
}

torch::Tensor relu_partial(const torch::Tensor& x, int64_t skipped) {
  check_input(x, "relu_partial");
  const c10::cuda::CUDAGuard guard(x.device());
  torch::Tensor y = torch::empty_like(x);
  kp_relu_partial_launch(x.data_ptr<float>(), y.data_ptr<float>(), x.numel(), skipped, current_stream());
  return y;
}

torch::Tensor relu_far_write(const torch::Tensor& x) {
  check_input(x, "relu_far_write");
  const c10::cuda::CUDAGuard guard(x.device());
  torch::Tensor y = torch::empty_like(x);
  kp_relu_far_write_launch(x.data_ptr<float>(), y.data_ptr<float>(), x.numel(), current_stream());
  return y;
}

torch::Tensor spin_forever(const torch::Tensor& x) {
  check_input(x, "spin_forever");
  const c10::cuda::CUDAGuard guard(x.device());
  torch::Tensor y = torch::empty_like(x);
  kp_spin_launch(y.data_ptr<float>(), current_stream());
  return y;
}

}  // namespace

// y = max(x, 0) (honest)
KP_OP("relu(Tensor x) -> Tensor", relu);
// writes max(x, 0) into out and returns out
KP_OP("relu_into(Tensor x, Tensor(a!) out) -> Tensor(a!)", relu_into);
// y = max(x, 0), then zeroes x
KP_OP("relu_scribble(Tensor(a!) x) -> Tensor", relu_scribble);
// y = max(x, 0), written late on another stream, unsynchronised
KP_OP("relu_side_stream(Tensor x) -> Tensor", relu_side_stream);
// y = max(x, 0) rounded to bf16
KP_OP("relu_bf16(Tensor x) -> Tensor", relu_bf16);
// y = max(x, 0) except the last `skipped` elements, left unwritten
KP_OP("relu_partial(Tensor x, int skipped) -> Tensor", relu_partial);
// y = max(x, 0), also written 1 TiB past the end
KP_OP("relu_far_write(Tensor x) -> Tensor", relu_far_write);
// never returns on the GPU
KP_OP("spin_forever(Tensor x) -> Tensor", spin_forever);
