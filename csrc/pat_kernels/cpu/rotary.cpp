// Rotary position embedding on the CPU, in place, rotate-half convention:
//
//   rotary_cpu_(x, cos, sin)
//     x   (T, heads, D): unit stride along D, heads D apart (q and k of a fused projection, viewed
//         as one run of heads); rotated in place
//     cos, sin (T, D) contiguous, in x's dtype
//
//   out[i]         = x[i] * cos[i] + (-x[i + D/2]) * sin[i]          i < D/2
//   out[i + D/2]   = x[i + D/2] * cos[i + D/2] + x[i] * sin[i + D/2]
//
// The products and the sum are rounded one by one, as torch's `x * cos + rotate_half(x) * sin`
// rounds them: fused multiply-adds are turned off below, so every dtype (float64 included) gets
// the torch path's bits. One pass instead of torch's six kernels (slices, neg, cat, two muls, add).

#pragma GCC optimize("fp-contract=off")

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <vector>

namespace {

constexpr int64_t kSerialElements = 1 << 16;

template <typename T>
struct Compute {  // the type torch computes T's products in (bfloat16: float, each result rounded)
  using type = T;
};
template <>
struct Compute<c10::BFloat16> {
  using type = float;
};

template <typename T>
void rotate_rows(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  using C = typename Compute<T>::type;
  const int64_t tokens = x.size(0), heads = x.size(1), D = x.size(2), half = D / 2;
  const int64_t ts = x.stride(0), hs = x.stride(1);
  T* xp = x.mutable_data_ptr<T>();
  const T* cp = cos.const_data_ptr<T>();
  const T* sp = sin.const_data_ptr<T>();
  const int64_t grain = tokens * heads * D < kSerialElements ? tokens : 1;
  at::parallel_for(0, tokens, grain, [&](int64_t begin, int64_t end) {
    std::vector<T> lo(half);
    for (int64_t t = begin; t < end; ++t) {
      const T* c = cp + t * D;
      const T* s = sp + t * D;
      for (int64_t h = 0; h < heads; ++h) {
        T* v = xp + t * ts + h * hs;
        for (int64_t i = 0; i < half; ++i) lo[i] = v[i];
        for (int64_t i = 0; i < half; ++i) {
          // each product and the sum rounded to T, as separate torch kernels would
          const T a = static_cast<T>(static_cast<C>(v[i]) * static_cast<C>(c[i]));
          const T b = static_cast<T>(static_cast<C>(-v[i + half]) * static_cast<C>(s[i]));
          v[i] = static_cast<T>(static_cast<C>(a) + static_cast<C>(b));
        }
        for (int64_t i = 0; i < half; ++i) {
          const T a = static_cast<T>(static_cast<C>(v[i + half]) * static_cast<C>(c[i + half]));
          const T b = static_cast<T>(static_cast<C>(lo[i]) * static_cast<C>(s[i + half]));
          v[i + half] = static_cast<T>(static_cast<C>(a) + static_cast<C>(b));
        }
      }
    }
  });
}

at::Tensor& rotary_cpu_(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.device().is_cpu() && cos.device().is_cpu() && sin.device().is_cpu(), "CPU tensors expected");
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2) && x.size(2) % 2 == 0,
              "x must be (tokens, heads, head_dim) with heads head_dim apart and an even head_dim");
  TORCH_CHECK(cos.dim() == 2 && cos.sizes() == sin.sizes() && cos.size(0) == x.size(0) && cos.size(1) == x.size(2) &&
                  cos.is_contiguous() && sin.is_contiguous(),
              "cos and sin must be (tokens, head_dim), contiguous");
  TORCH_CHECK(cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(), "dtypes differ");
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "rotary_cpu_", [&] { rotate_rows<scalar_t>(x, cos, sin); });
  return x;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pat_kernels, m) {
  m.def("rotary_cpu_(Tensor(a!) x, Tensor cos, Tensor sin) -> Tensor(a!)", &rotary_cpu_);
}
