// The invariant numerics mode's row-parallel product on the CPU (docs/numerics.md): one rank's node of
// the fixed reduction tree, x @ W.T summed over the rank's chunks of the input dim, in one call.
//
//   chunk_gemm_cpu(x, panels, n, chunks) -> out
//
//   x       (M, K) contiguous, the rows of the step, in the weight's dtype
//   panels  the (n, K) weight shard as panels of 16 output columns, zero past n, contiguous
//           (pat_kernels/cpu_chunk_gemm.py builds them):
//             float32 / float64: (P, K, 16), panels[p, k, j] = W[16 p + j, k]
//             bfloat16:          (P, K / 2, 32), panels[p, h, 2 j + t] = W[16 p + j, 2 h + t] (k in pairs)
//   chunks  a power of two dividing K (bfloat16: into even widths): the rank's chunks, K / chunks wide
//   out     (M, n) float32 (float64 for float64): the node over the chunks, as reduction_tree.py sums it
//
// Numerics contract. Output (m, j) is computed by one thread in one fixed sequence: for each chunk c,
// its leaf is one float32 (float64) accumulator that starts at 0 and takes every k of the chunk in
// ascending order, then the leaves are added pairwise, level by level, left + right, as the tree's
// nodes are. A k step is fma(x[m, k], W[j, k], acc), except on CPUs with AVX512-BF16, where a
// bfloat16 model takes k two at a time with vdpbf16ps (the same products, exact in float32; its own
// fixed order and denormal rule). Which of the two runs is a property of the CPU; nothing in the
// sequence depends on M, the row's position, the other rows, n or the thread count, so a row alone
// and the same row in any batch get the same bits, and a TP rank holding some of the chunks
// computes the same leaves.
//
// Speed: one call per product (not a GEMM call per chunk); the weight is read in its own dtype
// (bfloat16 stays bfloat16), once per tile of up to kTileRows rows; each k step loads one panel row
// and broadcasts one value (pair) of x to each of kBlockRows accumulators.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#define PAT_CHUNK_GEMM_VECTOR
#endif

namespace {

constexpr int64_t kCols = 16;      // output columns per panel
constexpr int64_t kTileRows = 64;  // rows per work item: the weight is read once per tile
constexpr int64_t kMaxLevels = 32;  // tree levels (chunks <= 2^31)
constexpr int64_t kSerialWork = 1 << 20;  // multiply-adds below which one thread runs the call (no fork)
#if defined(__AVX512F__)
constexpr int kBlockRows = 8;  // rows sharing each panel load: 8 independent fma chains
#else
constexpr int kBlockRows = 4;  // (AVX2: 4 rows x 2 registers)
#endif

inline float widen(uint16_t bf16) {
  uint32_t u = static_cast<uint32_t>(bf16) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// ---- one leaf for R rows and one panel: acc[r * 16 + j] over k in [k0, k1) ---------------------------

// float32 / float64 panels (K, 16): acc = fma(x[k], W[k], acc) for k ascending (the scalar reference).
template <int R, typename A>
void leaf_scalar(const A* x, int64_t ldx, const A* panel, int64_t k0, int64_t k1, A* acc) {
  A a[R][kCols] = {};
  for (int64_t k = k0; k < k1; ++k) {
    const A* p = panel + k * kCols;
    for (int r = 0; r < R; ++r)
      for (int64_t j = 0; j < kCols; ++j) a[r][j] = std::fma(x[r * ldx + k], p[j], a[r][j]);
  }
  std::memcpy(acc, a, sizeof(a));
}

// bfloat16 pair panels (K / 2, 32), x widened to float32: the same fma chain, k ascending.
template <int R>
void pairs_scalar(const float* x, int64_t ldx, const uint16_t* panel, int64_t k0, int64_t k1, float* acc) {
  float a[R][kCols] = {};
  for (int64_t k = k0; k < k1; k += 2) {
    const uint16_t* p = panel + k * kCols;  // (k / 2) * 32
    for (int r = 0; r < R; ++r)
      for (int64_t j = 0; j < kCols; ++j) {
        a[r][j] = std::fma(x[r * ldx + k], widen(p[2 * j]), a[r][j]);
        a[r][j] = std::fma(x[r * ldx + k + 1], widen(p[2 * j + 1]), a[r][j]);
      }
  }
  std::memcpy(acc, a, sizeof(a));
}

#ifdef PAT_CHUNK_GEMM_VECTOR
// The scalar chains in vector registers: 16 lanes (one per output column), one fma per lane and step.
#if defined(__AVX512F__)
struct Lanes {
  __m512 v;
  static Lanes zero() { return {_mm512_setzero_ps()}; }
  static Lanes load(const float* p) { return {_mm512_loadu_ps(p)}; }
  static void load_pairs(const uint16_t* p, Lanes& even, Lanes& odd) {  // 16 (even, odd) bfloat16 pairs
    const __m512i u = _mm512_loadu_si512(p);
    even.v = _mm512_castsi512_ps(_mm512_slli_epi32(u, 16));
    odd.v = _mm512_castsi512_ps(_mm512_and_si512(u, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
  }
  void fma(float x, const Lanes& w) { v = _mm512_fmadd_ps(_mm512_set1_ps(x), w.v, v); }
  void store(float* p) const { _mm512_storeu_ps(p, v); }
};
#else
struct Lanes {
  __m256 lo, hi;
  static Lanes zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
  static Lanes load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
  static void load_pairs(const uint16_t* p, Lanes& even, Lanes& odd) {
    const __m256i mask = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16));
    even = {_mm256_castsi256_ps(_mm256_slli_epi32(a, 16)), _mm256_castsi256_ps(_mm256_slli_epi32(b, 16))};
    odd = {_mm256_castsi256_ps(_mm256_and_si256(a, mask)), _mm256_castsi256_ps(_mm256_and_si256(b, mask))};
  }
  void fma(float x, const Lanes& w) {
    const __m256 b = _mm256_set1_ps(x);
    lo = _mm256_fmadd_ps(b, w.lo, lo);
    hi = _mm256_fmadd_ps(b, w.hi, hi);
  }
  void store(float* p) const {
    _mm256_storeu_ps(p, lo);
    _mm256_storeu_ps(p + 8, hi);
  }
};
#endif

template <int R>
void leaf_vector(const float* x, int64_t ldx, const float* panel, int64_t k0, int64_t k1, float* acc) {
  Lanes a[R];
  for (int r = 0; r < R; ++r) a[r] = Lanes::zero();
  for (int64_t k = k0; k < k1; ++k) {
    const Lanes w = Lanes::load(panel + k * kCols);
    for (int r = 0; r < R; ++r) a[r].fma(x[r * ldx + k], w);
  }
  for (int r = 0; r < R; ++r) a[r].store(acc + r * kCols);
}

template <int R>
void pairs_vector(const float* x, int64_t ldx, const uint16_t* panel, int64_t k0, int64_t k1, float* acc) {
  Lanes a[R], even, odd;
  for (int r = 0; r < R; ++r) a[r] = Lanes::zero();
  for (int64_t k = k0; k < k1; k += 2) {
    Lanes::load_pairs(panel + k * kCols, even, odd);
    for (int r = 0; r < R; ++r) {
      a[r].fma(x[r * ldx + k], even);
      a[r].fma(x[r * ldx + k + 1], odd);
    }
  }
  for (int r = 0; r < R; ++r) a[r].store(acc + r * kCols);
}
#endif

#if defined(__AVX512F__)
// AVX512-BF16: k two at a time, x as bfloat16 pairs broadcast to every lane.
template <int R>
__attribute__((target("avx512f,avx512bf16"))) void pairs_dot(const uint16_t* x, int64_t ldx, const uint16_t* panel,
                                                             int64_t k0, int64_t k1, float* acc) {
  __m512 a[R];
  for (int r = 0; r < R; ++r) a[r] = _mm512_setzero_ps();
  for (int64_t k = k0; k < k1; k += 2) {
    const __m512bh w = (__m512bh)_mm512_loadu_si512(panel + k * kCols);
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, x + r * ldx + k, sizeof pair);
      a[r] = _mm512_dpbf16_ps(a[r], (__m512bh)_mm512_set1_epi32(pair), w);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(acc + r * kCols, a[r]);
}

bool has_bf16_dot() {
  static const bool yes = __builtin_cpu_supports("avx512bf16");
  return yes;
}
#else
bool has_bf16_dot() { return false; }
#endif

// The path a call takes; one per (dtype, CPU), fixed for the process.
enum class Path { kScalar, kPairs, kDot };

template <int R, Path P, typename X, typename W, typename A>
void leaf(const X* x, int64_t ldx, const W* panel, int64_t k0, int64_t k1, A* acc) {
  if constexpr (P == Path::kDot) {
#if defined(__AVX512F__)
    pairs_dot<R>(x, ldx, panel, k0, k1, acc);
#endif
  } else if constexpr (P == Path::kPairs) {
#ifdef PAT_CHUNK_GEMM_VECTOR
    pairs_vector<R>(x, ldx, panel, k0, k1, acc);
#else
    pairs_scalar<R>(x, ldx, panel, k0, k1, acc);
#endif
  } else {
#ifdef PAT_CHUNK_GEMM_VECTOR
    if constexpr (std::is_same_v<A, float>) {
      leaf_vector<R>(x, ldx, panel, k0, k1, acc);
      return;
    }
#endif
    leaf_scalar<R>(x, ldx, panel, k0, k1, acc);
  }
}

// ---- the node over the chunks --------------------------------------------------------------------------

// Leaves in chunk order, each merged with the nodes it completes (a binary counter: for a power-of-two
// count, exactly the tree's pairs, left + right); R rows of one panel.
template <int R, Path P, typename X, typename W, typename A>
void node(const X* x, int64_t ldx, const W* panel, int64_t chunks, int64_t width, A* out, int64_t ldo,
          int64_t cols, std::vector<A>& stack) {
  constexpr int64_t size = R * kCols;
  stack.resize(kMaxLevels * size + size);
  A* cur = stack.data() + kMaxLevels * size;
  int64_t depth = 0;
  for (int64_t c = 0; c < chunks; ++c) {
    leaf<R, P>(x, ldx, panel, c * width, (c + 1) * width, cur);
    for (int64_t done = c; done & 1; done >>= 1) {  // cur completes the node whose left half is on top
      const A* left = stack.data() + (--depth) * size;
      for (int64_t i = 0; i < size; ++i) cur[i] = left[i] + cur[i];
    }
    std::memcpy(stack.data() + (depth++) * size, cur, size * sizeof(A));
  }
  for (int r = 0; r < R; ++r) std::memcpy(out + r * ldo, stack.data() + r * kCols, cols * sizeof(A));
}

// node<R> with R = rows (1 .. kBlockRows) as a compile-time constant.
template <Path P, typename X, typename W, typename A, int R = kBlockRows>
void block(int64_t rows, const X* x, int64_t ldx, const W* panel, int64_t chunks, int64_t width, A* out,
           int64_t ldo, int64_t cols, std::vector<A>& stack) {
  if constexpr (R > 1) {
    if (rows < R) return block<P, X, W, A, R - 1>(rows, x, ldx, panel, chunks, width, out, ldo, cols, stack);
  }
  node<R, P>(x, ldx, panel, chunks, width, out, ldo, cols, stack);
}

// One work item = (row tile, panel); every output element belongs to exactly one and is computed whole.
template <Path P, typename X, typename W, typename A>
void run(const X* xp, int64_t M, int64_t K, const W* pp, int64_t col_panels, int64_t n, int64_t chunks, A* op) {
  const int64_t width = K / chunks, tiles = (M + kTileRows - 1) / kTileRows, items = tiles * col_panels;
  at::parallel_for(0, items, M * K * n < kSerialWork ? items : 1, [&](int64_t begin, int64_t end) {
    std::vector<A> stack;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t tile = item / col_panels, p = item % col_panels;
      const int64_t cols = std::min(kCols, n - p * kCols), last = std::min(M, (tile + 1) * kTileRows);
      for (int64_t r = tile * kTileRows; r < last; r += kBlockRows)
        block<P>(std::min<int64_t>(kBlockRows, last - r), xp + r * K, K, pp + p * K * kCols, chunks, width,
                 op + r * n + p * kCols, n, cols, stack);
    }
  });
}

at::Tensor chunk_gemm_cpu(const at::Tensor& x, const at::Tensor& panels, int64_t n, int64_t chunks) {
  TORCH_CHECK(x.device().is_cpu() && panels.device().is_cpu(), "CPU tensors expected");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == panels.scalar_type(),
              "x must be a contiguous (M, K) of the panels' dtype");
  const int64_t M = x.size(0), K = x.size(1);
  const bool bf16 = panels.scalar_type() == at::kBFloat16;
  TORCH_CHECK(panels.dim() == 3 && panels.is_contiguous() && n > 0 && panels.size(0) * kCols >= n &&
                  panels.size(1) == (bf16 ? K / 2 : K) && panels.size(2) == (bf16 ? 2 * kCols : kCols),
              "panels must be a contiguous (ceil(n / 16), K, 16), bfloat16 (ceil(n / 16), K / 2, 32)");
  TORCH_CHECK(chunks >= 1 && (chunks & (chunks - 1)) == 0 && K % chunks == 0 && (!bf16 || (K / chunks) % 2 == 0),
              "chunks must be a power of two dividing K (into even widths for bfloat16)");
  at::Tensor out = at::empty({M, n}, x.options().dtype(panels.scalar_type() == at::kDouble ? at::kDouble : at::kFloat));
  if (M == 0) return out;
  const int64_t P = panels.size(0);
  switch (panels.scalar_type()) {
    case at::kFloat:
      run<Path::kScalar>(x.const_data_ptr<float>(), M, K, panels.const_data_ptr<float>(), P, n, chunks,
                         out.mutable_data_ptr<float>());
      break;
    case at::kDouble:
      run<Path::kScalar>(x.const_data_ptr<double>(), M, K, panels.const_data_ptr<double>(), P, n, chunks,
                         out.mutable_data_ptr<double>());
      break;
    case at::kBFloat16: {
      const auto* pp = reinterpret_cast<const uint16_t*>(panels.const_data_ptr<c10::BFloat16>());
      if (has_bf16_dot()) {
        run<Path::kDot>(reinterpret_cast<const uint16_t*>(x.const_data_ptr<c10::BFloat16>()), M, K, pp, P, n, chunks,
                        out.mutable_data_ptr<float>());
      } else {
        const at::Tensor xf = x.to(at::kFloat);  // exact
        run<Path::kPairs>(xf.const_data_ptr<float>(), M, K, pp, P, n, chunks, out.mutable_data_ptr<float>());
      }
      break;
    }
    default:
      TORCH_CHECK(false, "panels must be float32, bfloat16 or float64");
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pat_kernels, m) {
  m.def("chunk_gemm_cpu(Tensor x, Tensor panels, int n, int chunks) -> Tensor", &chunk_gemm_cpu);
}
