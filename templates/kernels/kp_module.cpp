// The one Python module of this workspace, kp_kernels (protected: do not edit).
// It runs every registration added with KP_REGISTER in the kernels/*_binding.cpp files.
#include "kp_registry.h"

namespace kp {

std::vector<Registration>& registrations() {
  // A function-local static is built on first use, so bindings may register during static
  // initialisation in any order.
  static std::vector<Registration> all;
  return all;
}

}  // namespace kp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "CUDA kernels of this kernelpilot workspace (kernels/*.cu, bound in kernels/*_binding.cpp).";
  // Tensor arguments are converted by torch's pybind casters, which need torch's Python module.
  pybind11::module_::import("torch");
  for (const kp::Registration registration : kp::registrations()) registration(m);
}
