// Sampling rows of logits by inverse CDF in token-id order: no sort, no float64 copy of the vocabulary.
//
//   inverse_cdf_cpu(x, inv_temp, floor, u, draw) -> (token int64 (B,), z_token f32 (B,), Z f64 (B,))
//   argmax_cpu(x) -> the first maximum of every row (int64 (B,))
//   weights_cpu(x, inv_temp, floor) -> every token's e_i (float32 (B, V))
//
// x: (B, V) float32 / bfloat16 / float64 logits, unit stride along V; inv_temp, floor: float32 (B,);
// u: float64 (B,) uniforms in [0, 1). The rule is sample_rule.h's. Without draw: token = argmax (the
// first maximum); Z and z_token = z of the token either way. The token's log-probability under the
// sampled distribution is z_token - log(Z), the log taken by the caller (a library log rounds
// differently in its vector and scalar paths). top_k / top_p rows: sample_prefix.cpp.

#include "sample_rule.h"

namespace {

using namespace pat_sample;

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

}  // namespace

TORCH_LIBRARY_FRAGMENT(pat_kernels, m) {
  m.def("weights_cpu(Tensor x, Tensor inv_temp, Tensor floor) -> Tensor", &weights_cpu);
  m.def("argmax_cpu(Tensor x) -> Tensor", &argmax_cpu);
  m.def("inverse_cdf_cpu(Tensor x, Tensor inv_temp, Tensor floor, Tensor u, bool draw) -> (Tensor, Tensor, Tensor)",
        &inverse_cdf_cpu);
}
