// Paged decode attention on the CPU: one query token per sequence, K/V read in place from the
// block pool (no padded copy of the context).
//
// Shapes (one layer):
//   q            (B, H, D)                       stride(-1) == 1
//   kv_cache     (2, num_blocks, block_size, KVH, D)   contiguous; [0] keys, [1] values
//   block_tables (B, max_blocks) int64, context_lens (B,) int64 (each in 1 .. max_blocks * block_size)
//   out          (B, H, D), q's dtype
// Token p of row b lives at kv_cache[:, block_tables[b, p / block_size], p % block_size].
//
// A work item is a row, or a run of its KV heads where the threads need the long rows cut
// (`heads_per_item`); the G = H / KVH query heads of a GQA group share every K/V load. The items are
// shared out in contiguous runs of equal total context, so a batch of mixed lengths (a rollout's long
// tail) keeps every thread busy.
// Softmax is exact (all scores kept, max subtracted, then one pass over V), accumulated in float
// for float/bfloat16 and in double for double; float exponentials go 8 at a time through the SLEEF
// routine torch's own vectorised exp uses (libtorch_cpu exports it) where AVX2 is built in.
//
// Where AVX2 and FMA are built in and head_dim is a multiple of 8, float and bfloat16 K/V go through register
// tiles (`tiles::`): q.k for two tokens x up to four query heads at once (eight independent FMA
// chains, each q load serving two tokens) and p.v for sixteen dims x up to four heads, held in
// registers across a block's tokens. One accumulator per (token, head) dot, one per (head, dim) sum
// over the tokens in order: how the work is tiled changes no result's bits, so each (row, KV head)
// stays a function of its own query, K/V and length, as the invariant mode needs (docs/numerics.md).
// The next block's lines are asked for into L2 as this block's are read. The scalar loops (double,
// other head dims, builds without AVX2 and FMA) run one dependent sum per dot and a multiply-add per
// element per token; bench/cpu_decode_attention_ab.py times the tiles against them (the tree before).

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
extern "C" __m256 Sleef_expf8_u10(__m256);
#endif

// The register tiles (namespace tiles) need AVX2's loads and FMA's multiply-adds.
#if defined(__AVX2__) && defined(__FMA__)
#define PAT_ATTENTION_TILES 1
#else
#define PAT_ATTENTION_TILES 0
#endif

namespace {

template <typename T>
struct Accum {
  using type = float;
};
template <>
struct Accum<double> {
  using type = double;
};

// `omp simd reduction` lets the compiler reorder the sum into vector lanes (plain -O3 may not
// reassociate floating-point adds); needs -fopenmp or -fopenmp-simd.
template <typename acc_t, typename kv_t>
inline acc_t dot(const acc_t* __restrict q, const kv_t* __restrict k, int64_t n) {
  acc_t s = 0;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += q[i] * static_cast<acc_t>(k[i]);
  return s;
}

// Asks for the next block's copy of token j while token j of this block is used: the block table
// jumps, so the hardware prefetcher cannot see the next block coming.
template <typename kv_t>
inline void prefetch(const kv_t* p, int64_t n) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t off = 0; off < n * static_cast<int64_t>(sizeof(kv_t)); off += 64) __builtin_prefetch(c + off);
}

template <typename acc_t, typename kv_t>
inline void axpy(acc_t* __restrict y, acc_t a, const kv_t* __restrict x, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += a * static_cast<acc_t>(x[i]);
}

// s[t] = exp(s[t] - m) for t < n; returns their sum.
template <typename acc_t>
inline acc_t exp_shifted(acc_t* s, int64_t n, acc_t m) {
  acc_t sum = 0;
  for (int64_t t = 0; t < n; ++t) {
    s[t] = std::exp(s[t] - m);
    sum += s[t];
  }
  return sum;
}

#if defined(__AVX2__)
template <>
inline float exp_shifted<float>(float* s, int64_t n, float m) {
  const __m256 vm = _mm256_set1_ps(m);
  __m256 vsum = _mm256_setzero_ps();
  int64_t t = 0;
  for (; t + 8 <= n; t += 8) {
    const __m256 e = Sleef_expf8_u10(_mm256_sub_ps(_mm256_loadu_ps(s + t), vm));
    _mm256_storeu_ps(s + t, e);
    vsum = _mm256_add_ps(vsum, e);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, vsum);
  float sum = 0;
  for (float v : lanes) sum += v;
  for (; t < n; ++t) {
    s[t] = std::exp(s[t] - m);
    sum += s[t];
  }
  return sum;
}
#endif

#if PAT_ATTENTION_TILES
namespace tiles {

// Eight K/V elements as floats.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {  // bfloat16 is float's upper half
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// The lanes' sum in one fixed order: (l0 + l4) + (l2 + l6) + ((l1 + l5) + (l3 + l7)).
inline float lane_sum(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_add_ss(x, _mm_shuffle_ps(x, x, 1)));
}

// Whether dim d is a whole number of 64-byte lines past the head slice's start: the loops ask for the next
// block at those dims only, once per line where the slice starts a line (D x element size a multiple of 64).
template <typename kv_t>
inline bool line_start(int64_t d) {
  return (d * static_cast<int64_t>(sizeof(kv_t))) % 64 == 0;
}

// Asks for the line at p one block ahead of its use with prefetcht2 (into L2 on the Zen cores here, not
// L1): a block of K or V (block size x KV heads x head dim) often outgrows L1, and requests for L1 hold the
// few L1 miss buffers the loads need (chosen by measurement on the 2-core EPYC here: with prefetcht0 the
// long-context float32 rows read K/V slower).
template <typename kv_t>
inline void ask_ahead(const kv_t* p) {
  __builtin_prefetch(p, 0, 1);
}

// out[t * NH + h] = q_h . k_t for NT tokens; q: NH rows of D floats, k[t]: token t's D elements. Where
// `ahead` is given, each line of ahead[t]'s D elements is prefetched as the same line of k[t] is read.
template <int NH, int NT, typename kv_t>
inline void dots(const float* __restrict q, int64_t D, const kv_t* const* k, const kv_t* const* ahead, float* out) {
  __m256 acc[NT][NH];
#pragma GCC unroll 8
  for (int t = 0; t < NT; ++t)
#pragma GCC unroll 8
    for (int h = 0; h < NH; ++h) acc[t][h] = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; d += 8) {
    if (ahead && line_start<kv_t>(d))
#pragma GCC unroll 8
      for (int t = 0; t < NT; ++t) ask_ahead(ahead[t] + d);
    __m256 kv[NT];
#pragma GCC unroll 8
    for (int t = 0; t < NT; ++t) kv[t] = load8(k[t] + d);
#pragma GCC unroll 8
    for (int h = 0; h < NH; ++h) {
      const __m256 qv = _mm256_loadu_ps(q + h * D + d);
#pragma GCC unroll 8
      for (int t = 0; t < NT; ++t) acc[t][h] = _mm256_fmadd_ps(qv, kv[t], acc[t][h]);
    }
  }
#pragma GCC unroll 8
  for (int t = 0; t < NT; ++t)
#pragma GCC unroll 8
    for (int h = 0; h < NH; ++h) out[t * NH + h] = lane_sum(acc[t][h]);
}

// s[h * s_stride + t] = scale * q_h . k_t (h < NH) for NT tokens, token t's K at k[t].
template <int NH, int NT, typename kv_t>
inline void score_tokens(const float* q, int64_t D, const kv_t* const* k, const kv_t* const* ahead, float scale,
                         float* s, int64_t s_stride) {
  float out[NT * NH];
  dots<NH, NT>(q, D, k, ahead, out);
  for (int t = 0; t < NT; ++t)
    for (int h = 0; h < NH; ++h) s[h * s_stride + t] = out[t * NH + h] * scale;
}

// NT tokens' scores for every query head of the item: hc KV heads of G query heads each, four at a time;
// `ahead` (or null): the same tokens of the next block, prefetched once (with the first four heads).
template <int NT, typename kv_t>
inline void score_item_tokens(const float* q, int64_t hc, int64_t G, int64_t D, const kv_t* const* k,
                              const kv_t* const* ahead, float scale, float* s, int64_t s_stride) {
  for (int64_t hh = 0; hh < hc; ++hh) {
    const kv_t *kh[NT], *ah[NT];
    for (int t = 0; t < NT; ++t) {
      kh[t] = k[t] + hh * D;
      ah[t] = ahead ? ahead[t] + hh * D : nullptr;
    }
    for (int64_t g = hh * G; g < (hh + 1) * G; g += 4) {
      const kv_t* const* a = ahead && g == hh * G ? ah : nullptr;
      switch (std::min<int64_t>(4, (hh + 1) * G - g)) {
        case 4: score_tokens<4, NT>(q + g * D, D, kh, a, scale, s + g * s_stride, s_stride); break;
        case 3: score_tokens<3, NT>(q + g * D, D, kh, a, scale, s + g * s_stride, s_stride); break;
        case 2: score_tokens<2, NT>(q + g * D, D, kh, a, scale, s + g * s_stride, s_stride); break;
        default: score_tokens<1, NT>(q + g * D, D, kh, a, scale, s + g * s_stride, s_stride); break;
      }
    }
  }
}

// The scores of one block's n tokens (token j's hc x D K row at k + j * tok_stride) for every query head
// of the item: s[r * s_stride + j] = scale * q_r . k_j. Token by token, two at a time, so the block is
// read front to back; the next block's same tokens are asked for line by line meanwhile (`next`, null at
// the last block).
template <typename kv_t>
void score_block(const float* q, int64_t hc, int64_t G, int64_t D, const kv_t* k, const kv_t* next,
                 int64_t tok_stride, int64_t n, float scale, float* s, int64_t s_stride) {
  int64_t j = 0;
  for (; j + 2 <= n; j += 2) {
    const kv_t* pair[2] = {k + j * tok_stride, k + (j + 1) * tok_stride};
    const kv_t* ahead[2] = {};
    if (next) {  // no offset is ever added to a null pointer
      ahead[0] = next + j * tok_stride;
      ahead[1] = next + (j + 1) * tok_stride;
    }
    score_item_tokens<2>(q, hc, G, D, pair, next ? ahead : nullptr, scale, s + j, s_stride);
  }
  if (j < n) {
    const kv_t* one[1] = {k + j * tok_stride};
    const kv_t* ahead[1] = {next ? next + j * tok_stride : nullptr};
    score_item_tokens<1>(q, hc, G, D, one, next ? ahead : nullptr, scale, s + j, s_stride);
  }
}

// acc[h * D + d + i] += p[h * p_stride + j] * v_j[d + i] (i < 8 NC) over the n tokens of one block, in token
// order: a dim's running sum stays in a register across the block. `next` (or null): the next block, whose
// same lines are prefetched as these are read.
template <int NH, int NC, typename kv_t>
inline void accumulate_dims(float* acc, int64_t D, int64_t d, const float* p, int64_t p_stride, const kv_t* v,
                            const kv_t* next, int64_t tok_stride, int64_t n) {
  __m256 a[NH][NC];
#pragma GCC unroll 8
  for (int h = 0; h < NH; ++h)
#pragma GCC unroll 8
    for (int c = 0; c < NC; ++c) a[h][c] = _mm256_loadu_ps(acc + h * D + d + 8 * c);
  const bool ahead = next && line_start<kv_t>(d);
  for (int64_t j = 0; j < n; ++j) {
    if (ahead) ask_ahead(next + j * tok_stride + d);
    __m256 x[NC];
#pragma GCC unroll 8
    for (int c = 0; c < NC; ++c) x[c] = load8(v + j * tok_stride + d + 8 * c);
#pragma GCC unroll 8
    for (int h = 0; h < NH; ++h) {
      const __m256 w = _mm256_broadcast_ss(p + h * p_stride + j);
#pragma GCC unroll 8
      for (int c = 0; c < NC; ++c) a[h][c] = _mm256_fmadd_ps(w, x[c], a[h][c]);
    }
  }
#pragma GCC unroll 8
  for (int h = 0; h < NH; ++h)
#pragma GCC unroll 8
    for (int c = 0; c < NC; ++c) _mm256_storeu_ps(acc + h * D + d + 8 * c, a[h][c]);
}

template <int NH, typename kv_t>
void accumulate_heads(float* acc, int64_t D, const float* p, int64_t p_stride, const kv_t* v, const kv_t* next,
                      int64_t tok_stride, int64_t n) {
  int64_t d = 0;
  for (; d + 16 <= D; d += 16) accumulate_dims<NH, 2>(acc, D, d, p, p_stride, v, next, tok_stride, n);
  if (d < D) accumulate_dims<NH, 1>(acc, D, d, p, p_stride, v, next, tok_stride, n);
}

// The G query heads of one KV head over one block's n tokens (token j's V at v + j * tok_stride), four at
// a time; the next block's lines (`next`, or null) are prefetched with the first four.
template <typename kv_t>
void accumulate_block(float* acc, int64_t G, int64_t D, const float* p, int64_t p_stride, const kv_t* v,
                      const kv_t* next, int64_t tok_stride, int64_t n) {
  for (int64_t g = 0; g < G; g += 4) {
    float* ag = acc + g * D;
    const float* pg = p + g * p_stride;
    const kv_t* ahead = g == 0 ? next : nullptr;
    switch (std::min<int64_t>(4, G - g)) {
      case 4: accumulate_heads<4>(ag, D, pg, p_stride, v, ahead, tok_stride, n); break;
      case 3: accumulate_heads<3>(ag, D, pg, p_stride, v, ahead, tok_stride, n); break;
      case 2: accumulate_heads<2>(ag, D, pg, p_stride, v, ahead, tok_stride, n); break;
      default: accumulate_heads<1>(ag, D, pg, p_stride, v, ahead, tok_stride, n); break;
    }
  }
}

}  // namespace tiles
#endif

// Item boundaries for `parts` threads: contiguous runs of items whose context lengths add up to
// about the same work. bounds[p] .. bounds[p + 1] is part p's run.
std::vector<int64_t> split_by_work(const int64_t* lens, int64_t items, int64_t items_per_row, int64_t parts) {
  std::vector<int64_t> bounds(parts + 1, items);
  bounds[0] = 0;
  int64_t total = 0;
  for (int64_t item = 0; item < items; ++item) total += lens[item / items_per_row];
  int64_t before = 0, p = 1;
  for (int64_t item = 0; item < items && p < parts; ++item) {
    while (p < parts && before * parts >= p * total) bounds[p++] = item;
    before += lens[item / items_per_row];
  }
  return bounds;
}

// Below this many multiply-adds (q.k and p.v together) a call runs on one thread: forking the
// OpenMP team costs more than it saves.
constexpr int64_t kSerialWork = 1 << 18;

// KV heads per work item: the most (a divisor of KVH) that keep the largest item, the longest row's,
// within one thread's share of the work. An item reads its heads' slice of every token row of its
// blocks, so whole rows (all KV heads, contiguous in the pool) stream front to back where a row per
// thread is enough, and one long row is cut by heads only as far as the threads need (one head's
// slice of a row is 128-512 bytes, a stride apart: read that way, a long tail's rows stream slower;
// bench/results/cpu_decode_attention_ab.md). Each (row, KV head) is computed whole by one item, so the
// cut changes no bits.
int64_t heads_per_item(int64_t KVH, int64_t max_len, int64_t total_len, int64_t threads) {
  for (int64_t hc = KVH; hc > 1; --hc)
    if (KVH % hc == 0 && max_len * hc * threads <= total_len * KVH) return hc;
  return 1;
}

// kD > 0: head_dim known at compile time (the dot and axpy loops unroll fully); 0: read from q.
template <typename scalar_t, int64_t kD>
void decode(const at::Tensor& q, const at::Tensor& kv, const int64_t* tables, int64_t table_stride,
            const int64_t* lens, int64_t max_len, int64_t total_len, double scale, at::Tensor& out) {
  using acc_t = typename Accum<scalar_t>::type;
  const int64_t B = q.size(0), H = q.size(1), D = kD > 0 ? kD : q.size(2);
  const int64_t num_blocks = kv.size(1), BS = kv.size(2), KVH = kv.size(3);
  const int64_t G = H / KVH;
  const int64_t tok_stride = KVH * D, block_stride = BS * tok_stride;
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1);
  const scalar_t* qp = q.const_data_ptr<scalar_t>();
  const scalar_t* kp = kv.const_data_ptr<scalar_t>();
  const scalar_t* vp = kp + num_blocks * block_stride;
  scalar_t* op = out.mutable_data_ptr<scalar_t>();
  const acc_t sc = static_cast<acc_t>(scale);
#if PAT_ATTENTION_TILES
  const bool tiled = std::is_same_v<acc_t, float> && D % 8 == 0;  // the register tiles (tiles::)
#else
  const bool tiled = false;
#endif

  const int64_t work = 2 * total_len * H * D;
  const int64_t threads = work < kSerialWork ? 1 : at::get_num_threads();
  const int64_t hc = heads_per_item(KVH, max_len, total_len, threads);  // KV heads per item
  const int64_t R = hc * G;  // query heads per item
  const int64_t items = B * (KVH / hc);
  const int64_t parts = std::min<int64_t>(threads, items);
  const std::vector<int64_t> bounds = split_by_work(lens, items, KVH / hc, parts);
  at::parallel_for(0, parts, 1, [&](int64_t part_begin, int64_t part_end) {
    std::vector<acc_t> qbuf(R * D), acc(R * D), scores(R * max_len), inv(R);
    for (int64_t item = bounds[part_begin]; item < bounds[part_end]; ++item) {
      const int64_t b = item / (KVH / hc), h0 = (item % (KVH / hc)) * hc;
      const int64_t len = lens[b];
      const int64_t* table = tables + b * table_stride;
      for (int64_t r = 0; r < R; ++r) {
        const scalar_t* src = qp + b * qs0 + (h0 * G + r) * qs1;
        for (int64_t d = 0; d < D; ++d) qbuf[r * D + d] = static_cast<acc_t>(src[d]);
      }
      // Calls visit(block, next, start, n) for every block of this item's context: its first token's K (or V)
      // heads h0.. in the pool, the next block's (null at the last), the block's first position and size.
      auto each_block = [&](const scalar_t* pool, auto&& visit) {
        for (int64_t start = 0, i = 0; start < len; start += BS, ++i) {
          const scalar_t* block = pool + table[i] * block_stride + h0 * D;
          const scalar_t* next = start + BS < len ? pool + table[i + 1] * block_stride + h0 * D : nullptr;
          visit(block, next, start, std::min(BS, len - start));
        }
      };
      // Calls visit(t, row) for every context token t of this item, row = its K (or V) heads h0.. in the
      // pool, prefetching the next block's same token as it goes (the scalar loops).
      auto each_token = [&](const scalar_t* pool, auto&& visit) {
        each_block(pool, [&](const scalar_t* block, const scalar_t* next, int64_t start, int64_t n) {
          for (int64_t j = 0; j < n; ++j) {
            if (next) prefetch(next + j * tok_stride, hc * D);
            visit(start + j, block + j * tok_stride);
          }
        });
      };
      // scores[r * len + t] = scale * q_r . k_t, query head r reading KV head h0 + r / G
      if (tiled) {
#if PAT_ATTENTION_TILES
        if constexpr (std::is_same_v<acc_t, float>) {
          each_block(kp, [&](const scalar_t* block, const scalar_t* next, int64_t start, int64_t n) {
            tiles::score_block(qbuf.data(), hc, G, D, block, next, tok_stride, n, sc, scores.data() + start, len);
          });
        }
#endif
      } else {
        each_token(kp, [&](int64_t t, const scalar_t* k) {
          for (int64_t r = 0; r < R; ++r) scores[r * len + t] = dot(qbuf.data() + r * D, k + (r / G) * D, D) * sc;
        });
      }
      for (int64_t r = 0; r < R; ++r) {
        acc_t* s = scores.data() + r * len;
        acc_t m = -std::numeric_limits<acc_t>::infinity();
        for (int64_t t = 0; t < len; ++t) m = std::max(m, s[t]);
        inv[r] = acc_t(1) / exp_shifted(s, len, m);
      }
      std::fill(acc.begin(), acc.end(), acc_t(0));
      if (tiled) {
#if PAT_ATTENTION_TILES
        if constexpr (std::is_same_v<acc_t, float>) {
          each_block(vp, [&](const scalar_t* block, const scalar_t* next, int64_t start, int64_t n) {
            for (int64_t hh = 0; hh < hc; ++hh)
              tiles::accumulate_block(acc.data() + hh * G * D, G, D, scores.data() + hh * G * len + start, len,
                                      block + hh * D, next ? next + hh * D : nullptr, tok_stride, n);
          });
        }
#endif
      } else {
        each_token(vp, [&](int64_t t, const scalar_t* v) {
          for (int64_t r = 0; r < R; ++r) axpy(acc.data() + r * D, scores[r * len + t], v + (r / G) * D, D);
        });
      }
      for (int64_t r = 0; r < R; ++r) {
        scalar_t* dst = op + (b * H + h0 * G + r) * D;
        for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<scalar_t>(acc[r * D + d] * inv[r]);
      }
    }
  });
}

template <typename scalar_t, typename... Args>
void dispatch_head_dim(const at::Tensor& q, Args&&... args) {
  switch (q.size(2)) {
    case 64:
      return decode<scalar_t, 64>(q, args...);
    case 128:
      return decode<scalar_t, 128>(q, args...);
    default:
      return decode<scalar_t, 0>(q, args...);
  }
}

at::Tensor paged_decode_attention_cpu(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& block_tables,
                                      const at::Tensor& context_lens, double scale) {
  TORCH_CHECK(q.device().is_cpu() && kv_cache.device().is_cpu(), "CPU tensors expected");
  TORCH_CHECK(q.dim() == 3 && kv_cache.dim() == 5 && kv_cache.size(0) == 2, "q (B, H, D), kv_cache (2, N, BS, KVH, D)");
  TORCH_CHECK(q.scalar_type() == kv_cache.scalar_type(), "q and kv_cache dtypes differ");
  TORCH_CHECK(kv_cache.is_contiguous(), "kv_cache must be contiguous");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t num_blocks = kv_cache.size(1), BS = kv_cache.size(2), KVH = kv_cache.size(3);
  TORCH_CHECK(kv_cache.size(4) == D && H % KVH == 0, "head_dim mismatch or heads not a multiple of kv heads");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) >= B && context_lens.size(0) >= B,
              "block_tables (B, max_blocks) and context_lens (B,) expected");
  const at::Tensor qc = q.stride(2) == 1 ? q : q.contiguous();
  const at::Tensor tables = block_tables.to(at::kLong).contiguous();
  const at::Tensor lens_t = context_lens.to(at::kLong).contiguous();
  const int64_t* tp = tables.const_data_ptr<int64_t>();
  const int64_t* lp = lens_t.const_data_ptr<int64_t>();
  const int64_t width = tables.size(1);
  // Validate every index up front: a bad one would read outside the pool.
  int64_t max_len = 0, total_len = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t len = lp[b];
    TORCH_CHECK(len >= 1 && len <= width * BS, "context_lens[", b, "] = ", len, " outside 1..", width * BS);
    for (int64_t i = 0; i < (len + BS - 1) / BS; ++i) {
      const int64_t blk = tp[b * width + i];
      TORCH_CHECK(blk >= 0 && blk < num_blocks, "block_tables[", b, ", ", i, "] = ", blk, " outside the pool");
    }
    max_len = std::max(max_len, len);
    total_len += len;
  }
  at::Tensor out = at::empty({B, H, D}, q.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, q.scalar_type(), "paged_decode_attention_cpu", [&] {
    dispatch_head_dim<scalar_t>(qc, kv_cache, tp, width, lp, max_len, total_len, scale, out);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(pat_kernels, m) {
  m.def("paged_decode_attention_cpu(Tensor q, Tensor kv_cache, Tensor block_tables, Tensor context_lens, float scale) -> Tensor",
        &paged_decode_attention_cpu);
}
