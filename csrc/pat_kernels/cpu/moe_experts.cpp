// The routed experts of a fast-mode step on the CPU, each expert whole on one thread.
//
//   moe_experts_cpu(rows, gate_up, down, offsets, row_weights) -> shares
//
//   rows         (N, H) float32 or bfloat16, the step's (token, expert) rows grouped by expert
//   gate_up[i]   oneDNN's pack (cpu_gemm.attach_pack) of the i-th listed expert's (2I, H) gate/up weight
//   down[i]      the pack of its (H, I) down weight (I: this rank's share of the expert's width)
//   offsets      n + 1 ascending row offsets: rows [offsets[i], offsets[i + 1]) go to expert i
//   row_weights  (N,) in rows' dtype: each row's routing weight
//   shares       (N, H): row r's  row_weights[r] * down(silu(gate(x)) * up(x)), before the TP group's sum
//
// Why: a decode step of an MoE layer is a few rows for each of many experts. Through torch each expert
// costs five kernels (two GEMMs, SiLU, product, weighting), each split over the cores with a fork and a
// join, each reading a weight too small to keep two cores streaming. Here each core takes whole experts
// (the heaviest first, dealt in turn), so the cores stream different weights at once and nothing waits
// between an expert's kernels (bench/results/cpu_moe_experts.md).
//
// Numerics: the same operations as the torch path over the same packs (oneDNN's GEMM, SiLU, products in
// the rows' dtype), on one thread each; oneDNN picks its kernel by the row count as it does there, so a
// row's bits follow its expert's row count, as in the torch path. The invariant mode never comes here.

#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/silu.h>
#include <torch/library.h>

#include <algorithm>
#include <numeric>
#include <vector>

namespace {

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                                         c10::string_view, c10::List<std::optional<at::Scalar>>,
                                         std::optional<c10::string_view>)>();
  return op.call(x, packed, std::nullopt, "none", c10::List<std::optional<at::Scalar>>(), std::nullopt);
}

at::Tensor moe_experts_cpu(const at::Tensor& rows, const std::vector<at::Tensor>& gate_up,
                           const std::vector<at::Tensor>& down, const std::vector<int64_t>& offsets,
                           const at::Tensor& row_weights) {
  const int64_t n = static_cast<int64_t>(gate_up.size());
  TORCH_CHECK(rows.dim() == 2 && rows.is_contiguous(), "rows must be a contiguous (N, H) tensor");
  TORCH_CHECK(static_cast<int64_t>(down.size()) == n && static_cast<int64_t>(offsets.size()) == n + 1,
              "one gate_up and one down pack per expert, and n + 1 offsets");
  TORCH_CHECK(n > 0 && offsets[0] == 0 && offsets[n] == rows.size(0), "offsets must span the rows from 0");
  TORCH_CHECK(row_weights.dim() == 1 && row_weights.size(0) == rows.size(0) &&
                  row_weights.scalar_type() == rows.scalar_type(),
              "row_weights must be (N,) in the rows' dtype");
  for (int64_t i = 0; i < n; ++i) TORCH_CHECK(offsets[i] < offsets[i + 1], "every listed expert needs a row");
  auto shares = at::empty_like(rows);
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
        at::Tensor h = packed_linear(rows.slice(0, lo, hi), gate_up[i]);  // (m, 2I)
        const int64_t width = h.size(1) / 2;
        at::Tensor act = at::silu(h.slice(1, 0, width)).mul_(h.slice(1, width, 2 * width));
        at::Tensor y = packed_linear(act, down[i]);  // (m, H)
        shares.slice(0, lo, hi).copy_(y.mul_(row_weights.slice(0, lo, hi).unsqueeze(1)));
      }
    }
  });
  return shares;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pat_kernels, m) {
  m.def("moe_experts_cpu(Tensor rows, Tensor[] gate_up, Tensor[] down, int[] offsets, Tensor row_weights) -> Tensor",
        &moe_experts_cpu);
}
