// The sampling rule's arithmetic, shared by the plain draw (sample.cpp) and the top_k / top_p draw
// (sample_prefix.cpp). For a row of logits x, an inverse temperature and a floor, with every float
// operation rounded on its own (FMA contraction off) so that pat_engine/sampling/inverse_cdf.py computes
// the same bits in torch:
//   m   = max_i float(x_i)
//   z_i = (float(x_i) - m) * inv_temp                     (<= 0)
//   e_i = z_i >= floor ? pexp(z_i) : 0                    (floor: log(min_p), or -inf)
//   Z   = blocks of kZBlock tokens, block k's total T_k summed in eight lanes (lane j adding e_{8b+j} of
//         the block in double, in order, from 0.0) combined ((0+1)+(2+3))+((4+5)+(6+7)); Z = the T_k
//         added in order from 0.0 (blocks let a GPU walk a row's lanes in parallel: its chain of dependent
//         adds is kZBlock / 8 long, not V / 8)
//   draw: token = the first i whose running double sum of e exceeds u * Z (else the last i with e_i > 0)
// pexp is a fixed polynomial (Cephes' expf: 1-2 ulp) rather than a library exp, so torch can reproduce
// it exactly. The max runs in sixteen lanes (exact: the same value, ties to the lowest id) and a thread
// scans up to eight of its rows together (each row's running sum still its own sequence of roundings):
// the result depends on the row alone, never on the batch, the thread count or the row's alignment.

#pragma once

// no-trapping-math lets the weight loop run in SIMD lanes (GCC keeps it scalar otherwise, for the
// floor's inexact flag); it changes no result: every operation still rounds on its own, in order. (It
// holds for the rest of each file that includes this one.)
#pragma GCC optimize("fp-contract=off", "no-trapping-math")

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>
#include <utility>
#include <vector>

namespace pat_sample {

constexpr int kLanes = 8;
constexpr float kExpMin = -87.33654f;  // below this expf underflows: e = 0

inline float to_float(float v) { return v; }
inline float to_float(double v) { return static_cast<float>(v); }
inline float to_float(c10::BFloat16 v) { return static_cast<float>(v); }

// Cephes expf on z <= 0: 2^n * p(r), n = floor(z log2 e + 1/2), r = z - n ln 2 (in two parts).
inline float pexp(float z) {
  const float zc = z < kExpMin ? kExpMin : z;  // keeps n in range; the result is masked below
  const float n = std::floor(zc * 1.44269504088896341f + 0.5f);
  float r = zc - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  const float r2 = r * r;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = p * r2 + r + 1.0f;
  const float scale = __builtin_bit_cast(float, (static_cast<int32_t>(n) + 127) << 23);  // 2^n
  return z >= kExpMin ? y * scale : 0.0f;
}

// The row's maximum and the first index holding it. Sixteen lanes (lane k takes i = k mod 16) keep
// their own maximum and its first index, so the pass runs in SIMD instead of one compare chain; max
// is exact, so the value is the sequential one, and ties across lanes go to the lowest index.
constexpr int kMaxLanes = 16;

template <typename T>
inline std::pair<float, int64_t> row_argmax(const T* x, int64_t n) {
  float m[kMaxLanes];
  int64_t at[kMaxLanes];
  for (int k = 0; k < kMaxLanes; ++k) m[k] = -std::numeric_limits<float>::infinity(), at[k] = 0;
  int64_t i = 0;
  for (; i + kMaxLanes <= n; i += kMaxLanes)
    for (int k = 0; k < kMaxLanes; ++k) {
      const float v = to_float(x[i + k]);
      const bool more = v > m[k];
      m[k] = more ? v : m[k];
      at[k] = more ? i + k : at[k];
    }
  for (int k = 0; i + k < n; ++k) {
    const float v = to_float(x[i + k]);
    if (v > m[k]) m[k] = v, at[k] = i + k;
  }
  float best = m[0];
  int64_t first = at[0];
  for (int k = 1; k < kMaxLanes; ++k)
    if (m[k] > best || (m[k] == best && at[k] < first)) best = m[k], first = at[k];
  return {best, first};
}

template <typename T>
inline float row_max(const T* x, int64_t n) {
  return row_argmax(x, n).first;
}

template <typename T>
inline float weight(const T* x, int64_t i, float m, float it, float floor) {
  const float z = (to_float(x[i]) - m) * it;
  return z >= floor ? pexp(z) : 0.0f;
}

constexpr int64_t kBlock = 256;  // weights computed a block at a time, in SIMD lanes (a multiple of kLanes)

// Lane k of ``acc`` takes w[j] for j = k (mod kLanes), in increasing j (``w`` starts at a multiple of kLanes).
inline void add_to_lanes(double* acc, const float* w, int64_t len) {
  int64_t j = 0;
  for (; j + kLanes <= len; j += kLanes)
    for (int k = 0; k < kLanes; ++k) acc[k] += static_cast<double>(w[j + k]);
  for (int k = 0; j + k < len; ++k) acc[k] += static_cast<double>(w[j + k]);
}

// A block's total from its lanes, in the rule's one order.
inline double combine_lanes(const double* acc) {
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

constexpr int64_t kZBlock = 1024;  // tokens per block of Z (pat_engine/sampling/inverse_cdf.py: Z_BLOCK)
static_assert(kZBlock % kBlock == 0 && kZBlock % kLanes == 0, "a weight chunk lies in one block of Z");

// Z taken in the rule's blocks from weights given in increasing token order (each at most once); a block
// none is given for has total 0.0, and adding it would change nothing.
class BlockedSum {
 public:
  // The weights of tokens i0 .. i0 + len - 1, all in one block, i0 a multiple of kLanes.
  void add_run(int64_t i0, const float* w, int64_t len) {
    enter(i0 / kZBlock);
    add_to_lanes(acc_, w, len);
  }
  void add(int64_t i, float w) {
    enter(i / kZBlock);
    acc_[i % kLanes] += static_cast<double>(w);
  }
  double total() const { return z_ + combine_lanes(acc_); }

 private:
  void enter(int64_t block) {
    if (block == block_) return;
    z_ += combine_lanes(acc_);
    for (double& a : acc_) a = 0.0;
    block_ = block;
  }
  double z_ = 0.0;
  double acc_[kLanes] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t block_ = 0;
};

// Z of a row of weights.
inline double blocked_sum(const float* w, int64_t n) {
  BlockedSum z;
  for (int64_t i0 = 0; i0 < n; i0 += kZBlock) z.add_run(i0, w + i0, std::min<int64_t>(kZBlock, n - i0));
  return z.total();
}

template <typename T>
inline double lane_sum(const T* x, int64_t n, float m, float it, float floor, float* e = nullptr) {
  // ``e``, when given, keeps every weight for the scan that follows (computed once). Each weight is
  // computed on its own (vector lanes round exactly as the scalar code: no contraction, no
  // reassociation), then added to its block's lanes.
  BlockedSum z;
  float block[kBlock];
  for (int64_t i0 = 0; i0 < n; i0 += kBlock) {
    const int64_t len = std::min<int64_t>(kBlock, n - i0);
    float* w = e != nullptr ? e + i0 : block;
#pragma omp simd
    for (int64_t j = 0; j < len; ++j) w[j] = weight(x, i0 + j, m, it, floor);
    z.add_run(i0, w, len);
  }
  return z.total();
}

// The scan of up to kGroup rows at once: token r = the first i whose running double sum of e_r
// (added one by one in id order) exceeds target[r]. One row's sum is a chain of dependent adds;
// several rows' chains interleaved keep the adder busy. Each row's sum is still its own sequence
// of roundings: a chunk is summed ahead from the row's running sum, and only a chunk that passes
// the target is walked again, from the same starting sum, to find the token.
constexpr int kGroup = 8;
constexpr int64_t kChunk = 64;

inline void scan_group(const float* const* e, int g, int64_t n, const double* target, int64_t* token) {
  double s[kGroup];
  int active[kGroup];
  int live = g;
  for (int k = 0; k < g; ++k) s[k] = 0.0, active[k] = k, token[k] = -1;
  for (int64_t i0 = 0; i0 < n && live > 0; i0 += kChunk) {
    const int64_t len = std::min<int64_t>(kChunk, n - i0);
    double ahead[kGroup];
    for (int a = 0; a < live; ++a) ahead[a] = s[active[a]];
    for (int64_t j = 0; j < len; ++j)
      for (int a = 0; a < live; ++a) ahead[a] += static_cast<double>(e[active[a]][i0 + j]);
    for (int a = 0; a < live;) {
      const int r = active[a];
      if (!(ahead[a] > target[r])) {
        s[r] = ahead[a++];
        continue;
      }
      double run = s[r];
      for (int64_t j = 0; j < len; ++j) {
        run += static_cast<double>(e[r][i0 + j]);
        if (run > target[r]) {
          token[r] = i0 + j;
          break;
        }
      }
      active[a] = active[--live];  // done: its slot takes the last live row
      ahead[a] = ahead[live];
    }
  }
  for (int k = 0; k < g; ++k) {
    if (token[k] >= 0) continue;
    // rounding left u * Z at or above the whole sum: the last token that has mass
    int64_t last = n - 1;
    while (last > 0 && !(e[k][last] > 0.0f)) --last;
    token[k] = last;
  }
}

// ---- the entry points' shared checks and outputs ---------------------------------------------------------

inline void check_vector(const at::Tensor& t, at::ScalarType dtype, int64_t rows, const char* what) {
  TORCH_CHECK(t.scalar_type() == dtype && t.is_contiguous() && t.numel() == rows, what);
}

inline void check_rows(const at::Tensor& x, const at::Tensor& inv_temp, const at::Tensor& floor) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.stride(1) == 1, "x must be CPU (rows, vocab), unit stride");
  TORCH_CHECK(x.size(1) > 0, "an empty vocabulary");
  check_vector(inv_temp, at::kFloat, x.size(0), "inv_temp must be float32 (rows,)");
  check_vector(floor, at::kFloat, x.size(0), "floor must be float32 (rows,)");
}

// What a draw answers per row, and the raw pointers a row loop writes through.
struct Draws {
  at::Tensor token, z_token, z_sum;
  explicit Draws(const at::Tensor& x)
      : token(at::empty({x.size(0)}, x.options().dtype(at::kLong))),
        z_token(at::empty({x.size(0)}, x.options().dtype(at::kFloat))),
        z_sum(at::empty({x.size(0)}, x.options().dtype(at::kDouble))) {}
  std::tuple<at::Tensor, at::Tensor, at::Tensor> out() const { return {token, z_token, z_sum}; }
};

// One row's read-only inputs (logits, inverse temperature, floor, uniform) and its outputs.
template <typename T>
struct RowArgs {
  const T* x;
  int64_t n, stride;
  const float* inv_temp;
  const float* floor;
  const double* u;
  int64_t* token;
  float* z_token;
  double* z_sum;
  RowArgs(const at::Tensor& logits, const at::Tensor& it, const at::Tensor& fl, const at::Tensor& uniforms, Draws& d)
      : x(logits.const_data_ptr<T>()), n(logits.size(1)), stride(logits.stride(0)),
        inv_temp(it.const_data_ptr<float>()), floor(fl.const_data_ptr<float>()), u(uniforms.const_data_ptr<double>()),
        token(d.token.mutable_data_ptr<int64_t>()), z_token(d.z_token.mutable_data_ptr<float>()),
        z_sum(d.z_sum.mutable_data_ptr<double>()) {}
  const T* row(int64_t r) const { return x + r * stride; }
};

}  // namespace pat_sample
