// Sampling rows of logits by inverse CDF in token-id order: no sort, no float64 copy of the vocabulary.
//
//   inverse_cdf_cpu(x, inv_temp, floor, u, draw) -> (token int64 (B,), z_token f32 (B,), Z f64 (B,))
//
// x: (B, V) float32 / bfloat16 / float64 logits, unit stride along V; inv_temp, floor: float32 (B,);
// u: float64 (B,) uniforms in [0, 1). For each row, with every float operation rounded on its own
// (FMA contraction off) so that pat_engine/sampling/inverse_cdf.py computes the same bits in torch:
//   m   = max_i float(x_i)
//   z_i = (float(x_i) - m) * inv_temp                     (<= 0)
//   e_i = z_i >= floor ? pexp(z_i) : 0                    (floor: log(min_p), or -inf)
//   Z   = eight lanes, lane j summing e_{8b+j} in double in order, combined ((0+1)+(2+3))+((4+5)+(6+7))
//   draw: token = the first i whose running double sum of e exceeds u * Z (else the last i with e_i > 0)
//   without draw: token = argmax (the first maximum); Z and z_token = z of the token either way.
// The token's log-probability under the sampled distribution is z_token - log(Z), the log taken by the
// caller (a library log rounds differently in its vector and scalar paths). pexp is a fixed
// polynomial (Cephes' expf: 1-2 ulp) rather than a library exp, so torch can reproduce it exactly.
// The max runs in sixteen lanes (exact: the same value, ties to the lowest id) and a thread scans up to
// eight of its rows together (each row's running sum still its own sequence of roundings): the result
// depends on the row alone, never on the batch, the thread count or the row's alignment.

// no-trapping-math lets the weight loop run in SIMD lanes (GCC keeps it scalar otherwise, for the
// floor's inexact flag); it changes no result: every operation still rounds on its own, in order.
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

namespace {

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

template <typename T>
inline double lane_sum(const T* x, int64_t n, float m, float it, float floor, float* e = nullptr) {
  // ``e``, when given, keeps every weight for the scan that follows (computed once). Each weight is
  // computed on its own (vector lanes round exactly as the scalar code: no contraction, no
  // reassociation); lane j of ``acc`` sums the weights of i = j (mod kLanes) in increasing i.
  double acc[kLanes] = {0, 0, 0, 0, 0, 0, 0, 0};
  float block[kBlock];
  for (int64_t i0 = 0; i0 < n; i0 += kBlock) {
    const int64_t len = std::min<int64_t>(kBlock, n - i0);
    float* w = e != nullptr ? e + i0 : block;
#pragma omp simd
    for (int64_t j = 0; j < len; ++j) w[j] = weight(x, i0 + j, m, it, floor);
    int64_t j = 0;
    for (; j + kLanes <= len; j += kLanes)
      for (int k = 0; k < kLanes; ++k) acc[k] += static_cast<double>(w[j + k]);
    for (int k = 0; j + k < len; ++k) acc[k] += static_cast<double>(w[j + k]);
  }
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
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

void check_vector(const at::Tensor& t, at::ScalarType dtype, int64_t rows, const char* what) {
  TORCH_CHECK(t.scalar_type() == dtype && t.is_contiguous() && t.numel() == rows, what);
}

void check_rows(const at::Tensor& x, const at::Tensor& inv_temp, const at::Tensor& floor) {
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

template <typename T>
void rows(const RowArgs<T>& a, int64_t b, bool draw) {
  at::parallel_for(0, b, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> e(draw ? kGroup * a.n : 0);
    const float* weights[kGroup];
    double target[kGroup];
    int64_t token[kGroup];
    for (int64_t r0 = begin; r0 < end; r0 += kGroup) {
      const int g = static_cast<int>(std::min<int64_t>(kGroup, end - r0));
      for (int k = 0; k < g; ++k) {
        const int64_t r = r0 + k;
        const auto [m, first] = row_argmax(a.row(r), a.n);
        float* ek = draw ? e.data() + k * a.n : nullptr;
        const double z = lane_sum(a.row(r), a.n, m, a.inv_temp[r], a.floor[r], ek);
        weights[k] = ek;
        target[k] = a.u[r] * z;
        token[k] = first;
        a.z_sum[r] = z;
        a.z_token[r] = m;  // the max until the token is known
      }
      if (draw) scan_group(weights, g, a.n, target, token);
      for (int k = 0; k < g; ++k) {
        const int64_t r = r0 + k;
        a.token[r] = token[k];
        a.z_token[r] = (to_float(a.row(r)[token[k]]) - a.z_token[r]) * a.inv_temp[r];
      }
    }
  });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> inverse_cdf_cpu(const at::Tensor& x, const at::Tensor& inv_temp,
                                                               const at::Tensor& floor, const at::Tensor& u,
                                                               bool draw) {
  check_rows(x, inv_temp, floor);
  check_vector(u, at::kDouble, x.size(0), "u must be float64 (rows,)");
  Draws d(x);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "inverse_cdf_cpu", [&] {
    rows(RowArgs<scalar_t>(x, inv_temp, floor, u, d), x.size(0), draw);
  });
  return d.out();
}

// The first maximum of every row (torch.argmax's answer for rows without NaN), int64 (B,).
at::Tensor argmax_cpu(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.stride(1) == 1 && x.size(1) > 0,
              "x must be CPU (rows, vocab), unit stride, a non-empty vocabulary");
  at::Tensor out = at::empty({x.size(0)}, x.options().dtype(at::kLong));
  int64_t* op = out.mutable_data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "argmax_cpu", [&] {
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    const int64_t n = x.size(1), xs = x.stride(0);
    at::parallel_for(0, x.size(0), 1, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) op[r] = row_argmax(xp + r * xs, n).second;
    });
  });
  return out;
}

template <typename T>
void weight_rows(const at::Tensor& x, const at::Tensor& inv_temp, const at::Tensor& floor, at::Tensor& e) {
  const int64_t b = x.size(0), n = x.size(1), xs = x.stride(0);
  const T* xp = x.const_data_ptr<T>();
  const float* itp = inv_temp.const_data_ptr<float>();
  const float* fp = floor.const_data_ptr<float>();
  float* ep = e.mutable_data_ptr<float>();
  at::parallel_for(0, b, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* row = xp + r * xs;
      const float m = row_max(row, n), it = itp[r], fl = fp[r];
      float* out = ep + r * n;
      for (int64_t i = 0; i < n; ++i) out[i] = weight(row, i, m, it, fl);
    }
  });
}

// Every token's weight e_i (the rule above), float32 (B, V): what top_p's prefix mass is read from.
at::Tensor weights_cpu(const at::Tensor& x, const at::Tensor& inv_temp, const at::Tensor& floor) {
  check_rows(x, inv_temp, floor);
  at::Tensor e = at::empty({x.size(0), x.size(1)}, x.options().dtype(at::kFloat));
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "weights_cpu", [&] {
    weight_rows<scalar_t>(x, inv_temp, floor, e);
  });
  return e;
}

// ---- top_k / top_p: the kept prefix of the tokens by descending logit (ties: lower id first) -------------
//
// inverse_cdf_prefix_cpu(x, inv_temp, floor, u, top_k, top_p) -> (token, z_token, Z_kept)
// top_k: int64 (B,), <= 0 off; top_p: float64 (B,), >= 1 off. The prefix is the first top_k tokens of
// that order, cut to the first ones whose running float64 sum of weights (taken without the floor)
// reaches top_p * Z (Z over every token); the draw is then the rule above over the kept tokens alone
// (as if every other logit were -inf). Only the tokens of the highest logit buckets holding that
// mass (or that count) are sorted: a 4096-bucket histogram of the logits' ordered bits finds them.

inline uint32_t ordered_bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, sizeof b);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);  // unsigned order = float order
}

// Sorts keys whose low 32 bits (the token id) already ascend: a stable radix sort on the high 32
// bits (two passes of 16) keeps that order among equal logits; small sets take std::sort.
inline void sort_keys(std::vector<uint64_t>& keys, std::vector<uint64_t>& scratch) {
  if (keys.size() < 4096) {
    std::sort(keys.begin(), keys.end());
    return;
  }
  scratch.resize(keys.size());
  std::vector<uint32_t> start(1 << 16);
  for (int shift : {32, 48}) {
    std::fill(start.begin(), start.end(), 0u);
    for (uint64_t k : keys) ++start[(k >> shift) & 0xffff];
    uint32_t sum = 0;
    for (auto& c : start) {
      const uint32_t here = c;
      c = sum;
      sum += here;
    }
    for (uint64_t k : keys) scratch[start[(k >> shift) & 0xffff]++] = k;
    keys.swap(scratch);
  }
}

template <typename T>
void prefix_row(const T* row, int64_t n, float it, float fl, double u, int64_t top_k, double top_p,
                int64_t* token, float* z_token, double* z_kept, std::vector<float>& e, std::vector<char>& kept,
                std::vector<uint64_t>& cand, std::vector<uint64_t>& scratch) {
  const float m = row_max(row, n);
  const float no_floor = -std::numeric_limits<float>::infinity();
  const int64_t k_cap = top_k > 0 && top_k < n ? top_k : n;
  const bool nucleus = top_p < 1.0;
  // top_p reads every weight (one exp pass, kept in ``e``: Z and the prefix mass from the same floats);
  // top_k alone needs none but the kept tokens' in the draw
  const double target = nucleus ? top_p * lane_sum(row, n, m, it, no_floor, e.data()) : 0.0;
  // the highest buckets that hold the count and (with a margin against rounding) the mass
  // Four histograms, token i in copy i % 4: LM logits crowd a few buckets, and one copy would make
  // every update wait on the last one to the same bucket. Their sums only choose the buckets to
  // sort (with a margin, and a retry over every token): the bits of the draw never depend on them.
  constexpr int kBuckets = 4096, kCopies = 4;
  std::vector<double> mass(nucleus ? kCopies * kBuckets : 0, 0.0);
  std::vector<int64_t> count(kCopies * kBuckets, 0);
  for (int64_t i = 0; i < n; ++i) {
    const int b = static_cast<int>(ordered_bits(to_float(row[i])) >> 20) + static_cast<int>(i % kCopies) * kBuckets;
    if (nucleus) mass[b] += e[i];
    count[b] += 1;
  }
  int low = 0;
  double acc_mass = 0.0;
  int64_t acc_count = 0;
  for (int b = kBuckets - 1; b >= 0; --b) {
    for (int c = 0; c < kCopies; ++c) {
      if (nucleus) acc_mass += mass[c * kBuckets + b];
      acc_count += count[c * kBuckets + b];
    }
    // (top_p alone asks no count: k_cap is then the whole vocabulary, and every token would be sorted)
    if ((k_cap == n || acc_count >= k_cap) && (!nucleus || acc_mass >= target * (1.0 + 1e-9))) {
      low = b;
      break;
    }
  }
  int64_t keep = 0;
  for (int pass = 0; pass < 2 && keep == 0; ++pass) {  // pass 1 (rounding beat the margin): every token
    cand.clear();
    for (int64_t i = 0; i < n; ++i) {
      const uint32_t bits = ordered_bits(to_float(row[i]));
      if (pass == 1 || static_cast<int>(bits >> 20) >= low)
        cand.push_back((static_cast<uint64_t>(~bits) << 32) | static_cast<uint64_t>(i));  // ascending = x desc, id asc
    }
    sort_keys(cand, scratch);
    const int64_t c = static_cast<int64_t>(cand.size());
    int64_t cut = std::min(k_cap, c);
    if (nucleus) {
      double running = 0.0;
      int64_t reached = -1;
      for (int64_t j = 0; j < c; ++j) {
        running += e[static_cast<int64_t>(cand[j] & 0xffffffffu)];
        if (!(running < target)) {
          reached = j + 1;
          break;
        }
      }
      if (reached < 0 && c < n && pass == 0) continue;  // the prefix may run past the candidates
      cut = std::min(cut, reached < 0 ? c : reached);
    }
    keep = cut;
  }
  // the kept ids in increasing order: a few are sorted, many are swept from a mask in one pass
  std::vector<uint64_t>& ids = scratch;
  ids.clear();
  if (keep * 8 <= n) {
    for (int64_t j = 0; j < keep; ++j) ids.push_back(cand[j] & 0xffffffffu);
    std::sort(ids.begin(), ids.end());
  } else {
    std::fill(kept.begin(), kept.end(), 0);
    for (int64_t j = 0; j < keep; ++j) kept[static_cast<int64_t>(cand[j] & 0xffffffffu)] = 1;
    for (int64_t i = 0; i < n; ++i)
      if (kept[i]) ids.push_back(static_cast<uint64_t>(i));
  }
  // the draw over the kept tokens, in id order, with the floor: as the masked row in rows() would
  double acc[kLanes] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (const uint64_t i : ids) acc[i % kLanes] += static_cast<double>(weight(row, static_cast<int64_t>(i), m, it, fl));
  const double z = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
  const double goal = u * z;
  double s = 0.0;
  int64_t t = -1, last = 0;
  for (const uint64_t id : ids) {
    const int64_t i = static_cast<int64_t>(id);
    const float w = weight(row, i, m, it, fl);
    if (w > 0.0f) last = i;
    s += static_cast<double>(w);
    if (s > goal) {
      t = i;
      break;
    }
  }
  if (t < 0) t = last;
  *token = t;
  *z_token = (to_float(row[t]) - m) * it;
  *z_kept = z;
}

template <typename T>
void prefix_rows(const RowArgs<T>& a, int64_t b, const int64_t* top_k, const double* top_p) {
  at::parallel_for(0, b, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> e(a.n);
    std::vector<char> kept(a.n);
    std::vector<uint64_t> cand, scratch;
    cand.reserve(a.n);
    for (int64_t r = begin; r < end; ++r)
      prefix_row(a.row(r), a.n, a.inv_temp[r], a.floor[r], a.u[r], top_k[r], top_p[r], a.token + r, a.z_token + r,
                 a.z_sum + r, e, kept, cand, scratch);
  });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> inverse_cdf_prefix_cpu(const at::Tensor& x, const at::Tensor& inv_temp,
                                                                      const at::Tensor& floor, const at::Tensor& u,
                                                                      const at::Tensor& top_k, const at::Tensor& top_p) {
  check_rows(x, inv_temp, floor);
  check_vector(u, at::kDouble, x.size(0), "u must be float64 (rows,)");
  check_vector(top_k, at::kLong, x.size(0), "top_k must be int64 (rows,)");
  check_vector(top_p, at::kDouble, x.size(0), "top_p must be float64 (rows,)");
  Draws d(x);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "inverse_cdf_prefix_cpu", [&] {
    prefix_rows(RowArgs<scalar_t>(x, inv_temp, floor, u, d), x.size(0), top_k.const_data_ptr<int64_t>(),
                top_p.const_data_ptr<double>());
  });
  return d.out();
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pat_kernels, m) {
  m.def("weights_cpu(Tensor x, Tensor inv_temp, Tensor floor) -> Tensor", &weights_cpu);
  m.def("argmax_cpu(Tensor x) -> Tensor", &argmax_cpu);
  m.def("inverse_cdf_prefix_cpu(Tensor x, Tensor inv_temp, Tensor floor, Tensor u, Tensor top_k, Tensor top_p) -> "
        "(Tensor, Tensor, Tensor)", &inverse_cdf_prefix_cpu);
  m.def("inverse_cdf_cpu(Tensor x, Tensor inv_temp, Tensor floor, Tensor u, bool draw) -> (Tensor, Tensor, Tensor)",
        &inverse_cdf_cpu);
}
