// The registry through which each kernels/*_binding.cpp adds its functions to the one extension
// module, kp_kernels (protected: do not edit).
//
// A binding file defines a function that takes the module and calls m.def(...), then registers it:
//
//   static void register_my_op(pybind11::module_& m) { m.def("my_op", &my_op, "what it computes"); }
//   KP_REGISTER(register_my_op);
//
// kp_module.cpp runs every registered function when Python imports kp_kernels, so adding a kernel
// never means editing a shared file. Only the slim pybind header is included: torch/extension.h
// would add seconds to every binding's compile.
#pragma once

#include <torch/csrc/utils/pybind.h>

#include <vector>

namespace kp {

using Registration = void (*)(pybind11::module_&);

// Hidden, so that two builds of kp_kernels loaded into one process (each build is a new .so) keep
// separate registries instead of the dynamic linker merging them into one.
__attribute__((visibility("hidden"))) std::vector<Registration>& registrations();

struct Registrar {
  explicit Registrar(Registration registration) { registrations().push_back(registration); }
};

}  // namespace kp

#define KP_CONCAT_INNER_(a, b) a##b
#define KP_CONCAT_(a, b) KP_CONCAT_INNER_(a, b)

// Runs `fn(module)` when kp_kernels is imported; use once per registration function.
#define KP_REGISTER(fn) static const ::kp::Registrar KP_CONCAT_(kp_registrar_, __LINE__)(fn)
