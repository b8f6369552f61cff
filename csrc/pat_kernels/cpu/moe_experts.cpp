// The routed experts of a fast-mode step on the CPU: each expert whole on one thread, then each token's
// shares added up.
//
//   moe_experts_cpu(x, order, weights, gate_up, down, offsets) -> out
//
//   x            (T, H) float32 or bfloat16, the step's tokens
//   order        (T * k,) int64: the (token, choice) rows grouped by expert; grouped row r is choice
//                order[r], of token order[r] / k (a stable argsort of the chosen experts)
//   weights      (T, k) in x's dtype: each choice's routing weight
//   gate_up[i]   oneDNN's pack (cpu_gemm.attach_pack) of the i-th listed expert's (2I, H) gate/up weight
//   down[i]      the pack of its (H, I) down weight (I: this rank's share of the expert's width)
//   offsets      n + 1 ascending offsets: grouped rows [offsets[i], offsets[i + 1]) go to expert i
//   gemm_rows    n row counts, each at least its expert's: expert i's GEMMs run on that many rows, zeros
//                after its own (cpu_gemm.expert_rows: few distinct counts, so oneDNN builds few kernels)
//   out          (T, H): sum over a token's choices, in choice order (ascending expert), of its weight times
//                down(silu(gate(x)) * up(x)): the rank's share, before the TP group's sum
//
// Why: a decode step of an MoE layer is a few rows for each of many experts. Through torch each expert
// costs five kernels (two GEMMs, SiLU, product, weighting), each split over the cores with a fork and a
// join, each reading a weight too small to keep two cores streaming. Here each core takes whole experts
// (the heaviest first, dealt in turn), so the cores stream different weights at once and nothing waits
// between an expert's kernels (bench/results/cpu_moe_experts.md). Each expert's rows are gathered on its
// thread and the shares are added up here, so a step allocates no (T * k, H) copy of its rows and no
// zeroed output: at a 2048-token prefill of a 768-wide model with four experts a token those were two
// 25 MB buffers a layer, each faulted in afresh.
//
// Numerics: the same operations as the torch path over the same packs (oneDNN's GEMM, SiLU-mul with
// torch's formula's bits, products in x's dtype, then transformers' index_add_ into zeros: a token's
// shares added one by one in ascending expert order, in float, rounded once), on one thread each; oneDNN
// picks its kernel by the row count as it does there, so a row's bits follow its expert's row count,
// as in the torch path. The invariant mode never comes here.

#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <vector>

#include "silu_mul.h"

namespace {

// silu(h[:, :I]) * h[:, I:] of a (m, 2I) h, row by row on this thread (torch's formula's bits: silu_mul.h).
at::Tensor silu_mul(const at::Tensor& h) {
  const int64_t m = h.size(0), stride = h.stride(0), width = h.size(1) / 2;
  at::Tensor act = at::empty({m, width}, h.options());
  if (h.scalar_type() == at::kFloat) {
    const float* in = h.const_data_ptr<float>();
    float* out = act.mutable_data_ptr<float>();
    for (int64_t r = 0; r < m; ++r) {
      pat_silu::row_f32(in + r * stride, in + r * stride + width, out + r * width, width);
    }
  } else {
    const auto* in = h.const_data_ptr<c10::BFloat16>();
    auto* out = act.mutable_data_ptr<c10::BFloat16>();
    for (int64_t r = 0; r < m; ++r) {
      pat_silu::row_bf16(in + r * stride, in + r * stride + width, out + r * width, width);
    }
  }
  return act;
}

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                                         c10::string_view, c10::List<std::optional<at::Scalar>>,
                                         std::optional<c10::string_view>)>();
  return op.call(x, packed, std::nullopt, "none", c10::List<std::optional<at::Scalar>>(), std::nullopt);
}

// Each of an expert's output rows times its routing weight, in the dtype (torch's mul_: the product in
// float, rounded), written to the expert's rows of `shares`.
void weigh_into(const at::Tensor& y, const int64_t* choices, const at::Tensor& weights, at::Tensor& shares,
                int64_t lo) {
  const int64_t m = y.size(0), h = y.size(1);
  if (y.scalar_type() == at::kFloat) {
    const float* src = y.const_data_ptr<float>();
    const float* w = weights.const_data_ptr<float>();
    float* dst = shares.mutable_data_ptr<float>() + lo * h;
    for (int64_t r = 0; r < m; ++r) {
      const float wr = w[choices[r]];
#pragma omp simd
      for (int64_t c = 0; c < h; ++c) dst[r * h + c] = src[r * h + c] * wr;
    }
  } else {
    const auto* src = y.const_data_ptr<c10::BFloat16>();
    const auto* w = weights.const_data_ptr<c10::BFloat16>();
    auto* dst = shares.mutable_data_ptr<c10::BFloat16>() + lo * h;
    for (int64_t r = 0; r < m; ++r) {
      const float wr = static_cast<float>(w[choices[r]]);
      for (int64_t c = 0; c < h; ++c) dst[r * h + c] = c10::BFloat16(static_cast<float>(src[r * h + c]) * wr);
    }
  }
}

// out[t] = the token's k shares added in choice order (ascending expert) in float from zero, rounded once to
// the dtype: what torch's index_add_ into zeros gives (it sums a bfloat16 destination in float).
template <typename T>
void combine(const T* shares, const int64_t* position, T* out, int64_t tokens, int64_t k, int64_t h) {
  const int64_t grain = std::max<int64_t>(1, (1 << 14) / std::max<int64_t>(h * k, 1));
  at::parallel_for(0, tokens, grain, [&](int64_t first, int64_t last) {
    std::vector<float> acc(h);
    for (int64_t t = first; t < last; ++t) {
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t j = 0; j < k; ++j) {
        const T* s = shares + position[t * k + j] * h;
#pragma omp simd
        for (int64_t c = 0; c < h; ++c) acc[c] += static_cast<float>(s[c]);
      }
      T* o = out + t * h;
      for (int64_t c = 0; c < h; ++c) o[c] = static_cast<T>(acc[c]);
    }
  });
}

at::Tensor moe_experts_cpu(const at::Tensor& x, const at::Tensor& order, const at::Tensor& weights,
                           const std::vector<at::Tensor>& gate_up, const std::vector<at::Tensor>& down,
                           const std::vector<int64_t>& offsets, const std::vector<int64_t>& gemm_rows) {
  const int64_t n = static_cast<int64_t>(gate_up.size());
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous (T, H) tensor");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "moe_experts_cpu serves float32 and bfloat16, not ", x.scalar_type());
  TORCH_CHECK(weights.dim() == 2 && weights.is_contiguous() && weights.size(0) == x.size(0) &&
                  weights.scalar_type() == x.scalar_type(),
              "weights must be a contiguous (T, k) tensor in x's dtype");
  const int64_t tokens = x.size(0), k = weights.size(1), rows = tokens * k, h = x.size(1);
  TORCH_CHECK(order.dim() == 1 && order.is_contiguous() && order.scalar_type() == at::kLong && order.size(0) == rows,
              "order must be a contiguous int64 (T * k,) tensor");
  TORCH_CHECK(static_cast<int64_t>(down.size()) == n && static_cast<int64_t>(offsets.size()) == n + 1,
              "one gate_up and one down pack per expert, and n + 1 offsets");
  TORCH_CHECK(n > 0 && offsets[0] == 0 && offsets[n] == rows, "offsets must span the rows from 0");
  TORCH_CHECK(static_cast<int64_t>(gemm_rows.size()) == n, "one gemm_rows entry per expert");
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(offsets[i] < offsets[i + 1], "every listed expert needs a row");
    TORCH_CHECK(gemm_rows[i] >= offsets[i + 1] - offsets[i], "gemm_rows must hold each expert's rows");
  }
  const int64_t* choice = order.const_data_ptr<int64_t>();
  std::vector<int64_t> position(rows, -1);  // where each (token, choice) row sits in the grouped order
  for (int64_t r = 0; r < rows; ++r) {
    TORCH_CHECK(choice[r] >= 0 && choice[r] < rows && position[choice[r]] < 0, "order must be a permutation of T * k");
    position[choice[r]] = r;
  }
  auto shares = at::empty({rows, h}, x.options());
  // the heaviest experts first, dealt to the threads in turn
  std::vector<int64_t> by_rows(n);
  std::iota(by_rows.begin(), by_rows.end(), 0);
  std::stable_sort(by_rows.begin(), by_rows.end(), [&](int64_t a, int64_t b) {
    return offsets[a + 1] - offsets[a] > offsets[b + 1] - offsets[b];
  });
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), n);
  const at::ThreadLocalState caller;  // inference mode and the like, which the pool's threads lack
  at::parallel_for(0, threads, 1, [&](int64_t first, int64_t last) {
    at::ThreadLocalStateGuard as_caller(caller);
    for (int64_t t = first; t < last; ++t) {
      for (int64_t j = t; j < n; j += threads) {
        const int64_t i = by_rows[j], lo = offsets[i], hi = offsets[i + 1];
        // the expert's token rows, gathered on this thread (a few hundred KiB at most a prefill's expert), then
        // zeros up to its GEMM rows
        at::Tensor in = at::empty({gemm_rows[i], h}, x.options());
        const int64_t bytes = h * static_cast<int64_t>(x.element_size());
        const char* src = static_cast<const char*>(x.const_data_ptr());
        char* dst = static_cast<char*>(in.mutable_data_ptr());
        for (int64_t r = lo; r < hi; ++r) std::memcpy(dst + (r - lo) * bytes, src + choice[r] / k * bytes, bytes);
        std::memset(dst + (hi - lo) * bytes, 0, (gemm_rows[i] - (hi - lo)) * bytes);
        at::Tensor act = silu_mul(packed_linear(in, gate_up[i]));  // (m, I)
        weigh_into(packed_linear(act, down[i]).slice(0, 0, hi - lo), choice + lo, weights, shares, lo);
      }
    }
  });
  auto out = at::empty_like(x);
  if (x.scalar_type() == at::kFloat) {
    combine(shares.const_data_ptr<float>(), position.data(), out.mutable_data_ptr<float>(), tokens, k, h);
  } else {
    combine(shares.const_data_ptr<c10::BFloat16>(), position.data(), out.mutable_data_ptr<c10::BFloat16>(), tokens,
            k, h);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pat_kernels, m) {
  m.def("moe_experts_cpu(Tensor x, Tensor order, Tensor weights, Tensor[] gate_up, Tensor[] down, int[] offsets, "
        "int[] gemm_rows) -> Tensor",
        &moe_experts_cpu);
}
