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
// A work item is a row (with >= 4 rows per thread) or a (row, KV head) pair; the G = H / KVH query
// heads of a GQA group share every K/V load. The items are shared out in contiguous runs of equal
// total context, so a batch of mixed lengths (a rollout's long tail) keeps every thread busy.
// Softmax is exact (all scores kept, max subtracted, then one pass over V), accumulated in float
// for float/bfloat16 and in double for double; float exponentials go 8 at a time through the SLEEF
// routine torch's own vectorised exp uses (libtorch_cpu exports it) where AVX2 is built in.

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
extern "C" __m256 Sleef_expf8_u10(__m256);
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

  // With enough rows to share out, one item takes a whole row: its K/V blocks (all KV heads,
  // contiguous in the pool) are then read front to back. Few rows: one item per (row, KV head).
  const int64_t hc = B >= 4 * at::get_num_threads() ? KVH : 1;  // KV heads per item
  const int64_t R = hc * G;  // query heads per item
  const int64_t items = B * (KVH / hc);
  const int64_t work = 2 * total_len * H * D;
  const int64_t parts = work < kSerialWork ? 1 : std::min<int64_t>(at::get_num_threads(), items);
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
      // Calls visit(t, row) for every context token t of this item, row = its K (or V) heads h0.. in
      // the pool, block by block through the table, prefetching the next block's token as it goes.
      auto each_token = [&](const scalar_t* pool, auto&& visit) {
        for (int64_t start = 0, i = 0; start < len; start += BS, ++i) {
          const scalar_t* block = pool + table[i] * block_stride + h0 * D;
          const scalar_t* next = start + BS < len ? pool + table[i + 1] * block_stride + h0 * D : nullptr;
          const int64_t n = std::min(BS, len - start);
          for (int64_t j = 0; j < n; ++j) {
            if (next) prefetch(next + j * tok_stride, hc * D);
            visit(start + j, block + j * tok_stride);
          }
        }
      };
      // scores[r * len + t] = scale * q_r . k_t, query head r reading KV head h0 + r / G
      each_token(kp, [&](int64_t t, const scalar_t* k) {
        for (int64_t r = 0; r < R; ++r) scores[r * len + t] = dot(qbuf.data() + r * D, k + (r / G) * D, D) * sc;
      });
      for (int64_t r = 0; r < R; ++r) {
        acc_t* s = scores.data() + r * len;
        acc_t m = -std::numeric_limits<acc_t>::infinity();
        for (int64_t t = 0; t < len; ++t) m = std::max(m, s[t]);
        inv[r] = acc_t(1) / exp_shifted(s, len, m);
      }
      std::fill(acc.begin(), acc.end(), acc_t(0));
      each_token(vp, [&](int64_t t, const scalar_t* v) {
        for (int64_t r = 0; r < R; ++r) axpy(acc.data() + r * D, scores[r * len + t], v + (r / G) * D, D);
      });
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
