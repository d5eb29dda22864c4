// The registry through which each kernels/*_binding.cpp adds its operators to this workspace's torch library
// (protected: do not edit).
//
// A binding defines a C++ function on tensors and registers it with the operator's schema:
//
//   torch::Tensor my_op(const torch::Tensor& x, double alpha) {
//     TORCH_CHECK(x.is_cuda() || x.is_meta(), "my_op: x must be a CUDA tensor, got one on ", x.device());
//     torch::Tensor y = torch::empty_like(x);
//     if (x.is_meta()) return y;  // torch.compile and opcheck ask only for the output's shape and dtype
//     ...launch the kernel...
//     return y;
//   }
//   KP_OP("my_op(Tensor x, float alpha) -> Tensor", my_op);
//
// kp_module.cpp registers each function as the op's CUDA, CPU and Meta kernel, so the same code answers a real
// call and a shape-only (meta) call. The schema's types must match the function's: Tensor is a
// `const torch::Tensor&`, float a double, int an int64_t, bool a bool, int[] a torch::IntArrayRef, Tensor? a
// `const std::optional<torch::Tensor>&`; `-> (Tensor, Tensor)` is a std::tuple, `-> ()` a void function. An op
// that writes into an argument says so: `my_op_into(Tensor x, Tensor(a!) out) -> ()`.
//
// Adding a kernel never means editing a shared file. Only torch/library.h is included, never torch/extension.h,
// which adds seconds to every binding's compile.
#pragma once

#include <torch/library.h>

#include <vector>

namespace kp {

// Adds an op's C++ function to `library` as the op's kernel for `key`; KP_OP writes one per op.
using AddKernel = void (*)(torch::Library& library, const char* name, c10::DispatchKey key);

struct Op {
  const char* schema;  // "my_op(Tensor x, float alpha) -> Tensor"
  AddKernel add_kernel;
};

// Hidden, so that two builds loaded into one process (each build is a new .so) keep separate registries instead
// of the dynamic linker merging them into one.
__attribute__((visibility("hidden"))) std::vector<Op>& ops();

struct OpRegistrar {
  OpRegistrar(const char* schema, AddKernel add_kernel) { ops().push_back(Op{schema, add_kernel}); }
};

}  // namespace kp

#define KP_CONCAT_INNER_(a, b) a##b
#define KP_CONCAT_(a, b) KP_CONCAT_INNER_(a, b)

// Registers `function` as the operator `schema` declares; use once per operator.
#define KP_OP(schema, function)                                                            \
  static const ::kp::OpRegistrar KP_CONCAT_(kp_op_, __LINE__)(                             \
      schema, [](torch::Library& library, const char* name, c10::DispatchKey key) {        \
        library.impl(name, torch::dispatch(key, TORCH_FN(function)));                       \
      })
