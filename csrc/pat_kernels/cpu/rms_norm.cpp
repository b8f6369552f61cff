// RMSNorm on the CPU in one pass per row, optionally fused with the residual add before it
// (float32 and bfloat16; float64 models keep the torch formula, which mirrors transformers').
//
//   rms_norm_cpu(x, weight, eps)                 -> y
//   add_rms_norm_cpu(x, residual, weight, eps)   -> (y, s)   with s = x + residual, y = rms_norm(s)
//
// x, residual: (rows, n) with unit stride along n; weight: (n,). The arithmetic is the torch
// path's (layers/norm.py): sum of squares and scale in float, y = (x * r) * w in float for float32;
// for bfloat16 the normalised row is rounded to bfloat16 before the weight multiplies it. Only the
// order of the sum of squares differs (vector lanes), a last-bit change in the scale.
// torch's RMSNorm runs 6-7 kernels here (pow, mean, add, rsqrt, mul, mul, plus the residual add),
// each with its own dispatch and pass over memory; at decode sizes that overhead is the cost.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <tuple>

namespace {

// Below this many elements a call runs on one thread: forking the OpenMP team costs more.
constexpr int64_t kSerialElements = 1 << 16;

inline float to_float(float v) { return v; }
inline float to_float(c10::BFloat16 v) { return static_cast<float>(v); }

template <typename T>
inline void norm_row(const T* __restrict x, const T* __restrict w, T* __restrict y, int64_t n, float eps) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < n; ++i) {
    const float v = to_float(x[i]);
    ss += v * v;
  }
  const float r = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    // bfloat16: the normalised value is rounded to bfloat16 first, as `weight * x32.to(dtype)` does
    const float normed = to_float(static_cast<T>(to_float(x[i]) * r));
    y[i] = static_cast<T>(normed * to_float(w[i]));
  }
}

template <typename T>
inline void add_row(const T* __restrict x, const T* __restrict res, T* __restrict s, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) s[i] = static_cast<T>(to_float(x[i]) + to_float(res[i]));
}

void check(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "CPU tensors expected");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be (rows, n) with unit stride along n");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous(), "weight must be (n,)");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "x and weight dtypes differ");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "float32 or bfloat16 expected");
}

template <typename F>
void each_row_block(int64_t rows, int64_t n, F&& body) {
  const int64_t grain = rows * n < kSerialElements ? rows : 1;
  at::parallel_for(0, rows, grain, body);
}

template <typename T>
void norm_rows(const at::Tensor& x, const at::Tensor& w, at::Tensor& y, double eps) {
  const int64_t rows = x.size(0), n = x.size(1), xs = x.stride(0);
  const T* xp = x.const_data_ptr<T>();
  const T* wp = w.const_data_ptr<T>();
  T* yp = y.mutable_data_ptr<T>();
  each_row_block(rows, n, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) norm_row(xp + r * xs, wp, yp + r * n, n, static_cast<float>(eps));
  });
}

template <typename T>
void add_norm_rows(const at::Tensor& x, const at::Tensor& res, const at::Tensor& w, at::Tensor& y, at::Tensor& s,
                   double eps) {
  const int64_t rows = x.size(0), n = x.size(1), xs = x.stride(0), rs = res.stride(0);
  const T* xp = x.const_data_ptr<T>();
  const T* rp = res.const_data_ptr<T>();
  const T* wp = w.const_data_ptr<T>();
  T* yp = y.mutable_data_ptr<T>();
  T* sp = s.mutable_data_ptr<T>();
  each_row_block(rows, n, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      add_row(xp + r * xs, rp + r * rs, sp + r * n, n);
      norm_row(sp + r * n, wp, yp + r * n, n, static_cast<float>(eps));
    }
  });
}

at::Tensor rms_norm_cpu(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check(x, weight);
  at::Tensor y = at::empty({x.size(0), x.size(1)}, x.options());
  if (x.scalar_type() == at::kFloat) {
    norm_rows<float>(x, weight, y, eps);
  } else {
    norm_rows<c10::BFloat16>(x, weight, y, eps);
  }
  return y;
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm_cpu(const at::Tensor& x, const at::Tensor& residual,
                                                     const at::Tensor& weight, double eps) {
  check(x, weight);
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.stride(1) == 1 && residual.scalar_type() == x.scalar_type(),
              "residual must match x");
  at::Tensor y = at::empty({x.size(0), x.size(1)}, x.options());
  at::Tensor s = at::empty({x.size(0), x.size(1)}, x.options());
  if (x.scalar_type() == at::kFloat) {
    add_norm_rows<float>(x, residual, weight, y, s, eps);
  } else {
    add_norm_rows<c10::BFloat16>(x, residual, weight, y, s, eps);
  }
  return {y, s};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pat_kernels, m) {
  m.def("rms_norm_cpu(Tensor x, Tensor weight, float eps) -> Tensor", &rms_norm_cpu);
  m.def("add_rms_norm_cpu(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)",
        &add_rms_norm_cpu);
}
