// The fast numerics mode's GEMM for decode steps of a few rows on the CPU: each weight row read once.
//
//   skinny_linear_cpu(x, w, bias) -> y
//
//   x     (R, K), 1 <= R <= kMaxRows, unit stride along K; float32 or bfloat16
//   w     (O, K) contiguous, x's dtype (the plain weight, not oneDNN's pack)
//   bias  (O,) in x's dtype, or an empty tensor
//   y     (R, O) in x's dtype
//
// Why: the long tail of an RL rollout decodes one or two rows per DP group, and such a step is a stream
// of the weights. oneDNN's packed GEMM reads them at 16-28 GB/s on this project's 2-core EPYC at one
// row, this kernel at 25-38, near what torch.sum reads (bench/results/cpu_skinny_gemm.md).
//
// Numerics. Output (r, o) is one fixed sequence in float32: lane j of 16 sums x[r, k] * w[o, k] for
// k = j (mod 16), k below K16 = K - K % 16, in increasing k; the lanes are added as a balanced tree of
// adjacent pairs ((0+1)+(2+3))+...; then the k >= K16 products are added in order, then the bias; the
// sum is rounded to x's dtype. Every product and sum is rounded on its own (contraction off, below), so
// no build's vector width or FMA changes a bit, and tests/test_cpu_skinny_gemm.py reproduces the
// sequence with torch ops. Nothing in it depends on R, the other rows or the thread count. It is not
// oneDNN's sequence: a fast-mode row rounds differently in a step of a few rows than in a larger one,
// as it already did between oneDNN's one-row and many-row kernels (the invariant mode never comes here).

#pragma GCC optimize("fp-contract=off")

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int kMaxRows = 8;
constexpr int kLanes = 16;
constexpr int64_t kGrain = 16;  // weight rows per work item at the least

inline float widen(float v) { return v; }
inline float widen(c10::BFloat16 v) {
  const uint32_t u = static_cast<uint32_t>(v.x) << 16;  // exact: a bfloat16 is a float32's high half
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// Adjacent pairs, level by level: ((0+1)+(2+3))+((4+5)+(6+7)) + ... over 16 lanes.
inline float tree(float* a) {
  for (int width = kLanes / 2; width >= 1; width /= 2)
    for (int j = 0; j < width; ++j) a[j] = a[2 * j] + a[2 * j + 1];
  return a[0];
}

// One weight row against the R rows of ``xf`` (float32, R x K): y[r] before the bias.
template <int R, typename T>
inline void dot_rows(const float* xf, const T* w, int64_t k_lanes, int64_t k, float* out) {
  float acc[R][kLanes] = {};
  for (int64_t k0 = 0; k0 < k_lanes; k0 += kLanes) {
    float wv[kLanes];
    for (int j = 0; j < kLanes; ++j) wv[j] = widen(w[k0 + j]);
    for (int r = 0; r < R; ++r) {
      const float* xr = xf + r * k + k0;
#pragma omp simd
      for (int j = 0; j < kLanes; ++j) acc[r][j] = acc[r][j] + xr[j] * wv[j];
    }
  }
  for (int r = 0; r < R; ++r) {
    float s = tree(acc[r]);
    for (int64_t i = k_lanes; i < k; ++i) s = s + xf[r * k + i] * widen(w[i]);
    out[r] = s;
  }
}

template <int R, typename T>
void skinny_rows(const float* xf, const T* w, const T* bias, T* y, int64_t k, int64_t o_count) {
  const int64_t k_lanes = k - k % kLanes;
  at::parallel_for(0, o_count, kGrain, [&](int64_t o0, int64_t o1) {
    float out[R];
    for (int64_t o = o0; o < o1; ++o) {
      dot_rows<R>(xf, w + o * k, k_lanes, k, out);
      for (int r = 0; r < R; ++r) y[r * o_count + o] = static_cast<T>(bias ? out[r] + widen(bias[o]) : out[r]);
    }
  });
}

template <typename T>
void dispatch_rows(const float* xf, const T* w, const T* bias, T* y, int64_t rows, int64_t k, int64_t o_count) {
  switch (rows) {
#define PAT_SKINNY_ROWS(n) \
  case n:                  \
    return skinny_rows<n>(xf, w, bias, y, k, o_count);
    PAT_SKINNY_ROWS(1)
    PAT_SKINNY_ROWS(2)
    PAT_SKINNY_ROWS(3)
    PAT_SKINNY_ROWS(4)
    PAT_SKINNY_ROWS(5)
    PAT_SKINNY_ROWS(6)
    PAT_SKINNY_ROWS(7)
    PAT_SKINNY_ROWS(8)
#undef PAT_SKINNY_ROWS
  }
}

at::Tensor skinny_linear_cpu(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.stride(1) == 1, "x must be CPU (rows, K), unit stride along K");
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= kMaxRows, "skinny_linear_cpu takes 1 to ", kMaxRows, " rows, not ",
              x.size(0));
  TORCH_CHECK(w.device().is_cpu() && w.dim() == 2 && w.is_contiguous() && w.size(1) == x.size(1),
              "w must be a contiguous CPU (O, K) with x's K");
  TORCH_CHECK(w.scalar_type() == x.scalar_type(), "x and w must share a dtype");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "float32 or bfloat16 only");
  const bool biased = bias.numel() > 0;
  TORCH_CHECK(!biased || (bias.scalar_type() == x.scalar_type() && bias.is_contiguous() && bias.numel() == w.size(0)),
              "bias must be contiguous (O,) in x's dtype, or empty");
  const int64_t rows = x.size(0), k = x.size(1), o_count = w.size(0);
  at::Tensor y = at::empty({rows, o_count}, x.options());
  auto run = [&](auto tag) {
    using T = decltype(tag);
    const T* xp = x.const_data_ptr<T>();
    std::vector<float> xf(static_cast<size_t>(rows * k));  // the rows widened once, not once per weight row
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t i = 0; i < k; ++i) xf[r * k + i] = widen(xp[r * x.stride(0) + i]);
    dispatch_rows<T>(xf.data(), w.const_data_ptr<T>(), biased ? bias.const_data_ptr<T>() : nullptr,
                     y.mutable_data_ptr<T>(), rows, k, o_count);
  };
  if (x.scalar_type() == at::kFloat)
    run(float{});
  else
    run(c10::BFloat16{});
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pat_kernels, m) {
  m.def("skinny_linear_cpu(Tensor x, Tensor w, Tensor bias) -> Tensor", &skinny_linear_cpu);
}
