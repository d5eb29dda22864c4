// This workspace's torch library (protected: do not edit): every operator added with KP_OP in the
// kernels/*_binding.cpp files, registered under the namespace kernelpilot's loader chooses.
//
// Loading the library registers nothing. kernelpilot calls kp_register_ops("kp_<name>_<hex>") once it is
// loaded, so the namespace is picked at load time (a second build of the workspace in the same process gets a
// namespace of its own) and never compiled in: a new build recompiles only what changed.
#include "kp_registry.h"

#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/stack.h>
#include <c10/core/GradMode.h>

#include <exception>
#include <string>
#include <vector>

namespace kp {

std::vector<Op>& ops() {
  // A function-local static is built on first use, so bindings may register during static
  // initialisation in any order.
  static std::vector<Op> all;
  return all;
}

}  // namespace kp

namespace {

bool requires_grad(const c10::IValue& value) {
  if (value.isTensor()) return value.toTensor().requires_grad();
  if (value.isList()) {  // Tensor[] and Tensor?[]
    for (const c10::IValue& element : value.toListRef()) {
      if (requires_grad(element)) return true;
    }
  }
  return false;
}

// The Autograd kernel of every op. None has a backward yet, so a call that would need one fails here, naming
// the op, rather than returning a result cut off from the graph; other calls go on to the device kernel.
// An op given a backward later registers its own Autograd kernel in place of this one.
void no_backward(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  if (c10::GradMode::is_enabled()) {
    for (const c10::IValue& argument : torch::jit::last(*stack, op.schema().arguments().size())) {
      TORCH_CHECK(!requires_grad(argument), "kp op ", op.schema().name(),
                  " has no backward yet; call it under torch.no_grad() or on tensors that do not require grad");
    }
  }
  const at::AutoDispatchBelowADInplaceOrView below_autograd;
  op.redispatchBoxed(keys & c10::after_ADInplaceOrView_keyset, stack);
}

// "my_op(Tensor x) -> Tensor" -> "my_op" (an overload keeps its name: "my_op.out").
std::string op_name(const char* schema) {
  const std::string text(schema);
  const size_t begin = text.find_first_not_of(" \t\n");
  const size_t end = text.find('(');
  if (begin == std::string::npos || end == std::string::npos || end <= begin) return text;
  return text.substr(begin, text.find_last_not_of(" \t\n", end - 1) + 1 - begin);
}

torch::Library registered_library(const char* ns) {
  torch::Library library(torch::Library::DEF, ns, std::nullopt, __FILE__, __LINE__);
  for (const kp::Op& op : kp::ops()) {
    library.def(op.schema);
    const std::string name = op_name(op.schema);
    for (const c10::DispatchKey key : {c10::DispatchKey::CUDA, c10::DispatchKey::CPU, c10::DispatchKey::Meta}) {
      op.add_kernel(library, name.c_str(), key);
    }
    library.impl(name.c_str(), torch::dispatch(c10::DispatchKey::Autograd,
                                               torch::CppFunction::makeFromBoxedFunction<&no_backward>()));
  }
  return library;
}

}  // namespace

// Registers the ops under `ns`; returns nullptr, or what went wrong (a schema that does not parse, a function
// whose types differ from its schema, a namespace already taken). Called once, by kernelpilot's loader.
extern "C" __attribute__((visibility("default"))) const char* kp_register_ops(const char* ns) {
  static std::string error;
  // Never deleted: torch keeps pointers to the registered kernels for the life of the process.
  static torch::Library* registered = nullptr;
  if (registered != nullptr) {
    error = "the ops of this library are registered already";
    return error.c_str();
  }
  try {
    registered = new torch::Library(registered_library(ns));
    return nullptr;
  } catch (const c10::Error& err) {
    error = err.what_without_backtrace();
  } catch (const std::exception& err) {
    error = err.what();
  }
  return error.c_str();
}
