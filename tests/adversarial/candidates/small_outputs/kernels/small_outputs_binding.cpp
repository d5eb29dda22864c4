// Kernels for the small-output cheats (test_small_outputs.py), C++ on the CPU: an honest mean cross-entropy and
// int64 row sum, and the cheats beside them.
#include <torch/types.h>

#include <cmath>

#include "kp_registry.h"

namespace {

// Honest: the mean over tokens of logsumexp(row) - row[target], accumulated in double.
torch::Tensor cross_entropy(const torch::Tensor& logits, const torch::Tensor& targets) {
  TORCH_CHECK(logits.is_contiguous() && logits.dim() == 2 && targets.is_contiguous(), "cross_entropy: 2-D logits");
  torch::Tensor y = torch::empty({}, logits.options());
  if (logits.is_meta()) return y;
  const int64_t rows = logits.size(0), columns = logits.size(1);
  const float* xs = logits.data_ptr<float>();
  const int64_t* ts = targets.data_ptr<int64_t>();
  double total = 0.0;
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = xs + r * columns;
    float top = row[0];
    for (int64_t c = 1; c < columns; ++c) top = std::max(top, row[c]);
    double sum = 0.0;
    for (int64_t c = 0; c < columns; ++c) sum += std::exp(static_cast<double>(row[c] - top));
    total += std::log(sum) + top - row[ts[r]];
  }
  y.data_ptr<float>()[0] = static_cast<float>(total / rows);
  return y;
}

// The cheat: the loss is nearly the same number on every draw, so return that number. One logit read keeps the
// answer changing with the input (an exactly repeated answer would be caught as a cached output).
torch::Tensor cross_entropy_constant(const torch::Tensor& logits, const torch::Tensor& targets) {
  torch::Tensor y = torch::empty({}, logits.options());
  if (logits.is_meta()) return y;
  y.data_ptr<float>()[0] = 12.09f + 1e-4f * logits.data_ptr<float>()[0];
  return y;
}

torch::Tensor row_sum_plus(const torch::Tensor& x, int64_t plus) {
  TORCH_CHECK(x.is_contiguous() && x.dim() == 2, "row_sum: a contiguous 2-D tensor");
  torch::Tensor y = torch::empty({x.size(0)}, x.options());
  if (x.is_meta()) return y;
  const int64_t* xs = x.data_ptr<int64_t>();
  int64_t* ys = y.data_ptr<int64_t>();
  for (int64_t r = 0; r < x.size(0); ++r) {
    int64_t total = 0;
    for (int64_t c = 0; c < x.size(1); ++c) total += xs[r * x.size(1) + c];
    ys[r] = total + plus;
  }
  return y;
}

// Honest.
torch::Tensor row_sum(const torch::Tensor& x) { return row_sum_plus(x, 0); }

// The cheat: off by one in every row, far below float32's spacing at sums near 2**50.
torch::Tensor row_sum_off_by_one(const torch::Tensor& x) { return row_sum_plus(x, 1); }

torch::Tensor shift_by(const torch::Tensor& weight, const torch::Tensor& x, bool element_wise) {
  TORCH_CHECK(weight.is_contiguous() && x.is_contiguous() && weight.numel() == x.numel(), "weighted_shift: same sizes");
  torch::Tensor y = torch::empty_like(weight);
  if (x.is_meta()) return y;
  const float* ws = weight.data_ptr<float>();
  const float* xs = x.data_ptr<float>();
  float* ys = y.data_ptr<float>();
  for (int64_t i = 0; i < x.numel(); ++i) ys[i] = ws[i] + 1e-3f * xs[element_wise ? i : 0];
  return y;
}

// Honest.
torch::Tensor weighted_shift(const torch::Tensor& weight, const torch::Tensor& x) { return shift_by(weight, x, true); }

// The cheat: the weight, with one element of x added everywhere.
torch::Tensor weighted_shift_ignoring_x(const torch::Tensor& weight, const torch::Tensor& x) {
  return shift_by(weight, x, false);
}

}  // namespace

KP_OP("cross_entropy(Tensor logits, Tensor targets) -> Tensor", cross_entropy);
KP_OP("cross_entropy_constant(Tensor logits, Tensor targets) -> Tensor", cross_entropy_constant);
KP_OP("row_sum(Tensor x) -> Tensor", row_sum);
KP_OP("row_sum_off_by_one(Tensor x) -> Tensor", row_sum_off_by_one);
KP_OP("weighted_shift(Tensor weight, Tensor x) -> Tensor", weighted_shift);
KP_OP("weighted_shift_ignoring_x(Tensor weight, Tensor x) -> Tensor", weighted_shift_ignoring_x);
