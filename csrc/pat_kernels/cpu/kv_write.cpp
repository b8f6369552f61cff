// Stores the new tokens' K and V into the paged pool on the CPU: one copy of each token's
// KV heads (contiguous in both places) instead of two `index_copy_` kernels over strided views.
//
//   write_kv_cpu_(kv_cache, k, v, slots)
//     kv_cache (2, num_blocks, block_size, KVH, D) contiguous; [0] keys, [1] values
//     k, v     (T, KVH, D), each token's heads contiguous (views into the fused projection are fine)
//     slots    (N,) int64, N <= T: token i goes to slot slots[i] (= block * block_size + offset)
//
// A plain copy, so every dtype keeps its bits. Every slot is checked against the pool first.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <cstring>

namespace {

constexpr int64_t kSerialBytes = 1 << 20;

void write_kv_cpu_(at::Tensor& kv_cache, const at::Tensor& k, const at::Tensor& v, const at::Tensor& slots) {
  TORCH_CHECK(kv_cache.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu() && slots.device().is_cpu(),
              "CPU tensors expected");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous(),
              "kv_cache must be (2, num_blocks, block_size, KVH, D), contiguous");
  const int64_t KVH = kv_cache.size(3), D = kv_cache.size(4);
  for (const at::Tensor* t : {&k, &v}) {
    TORCH_CHECK(t->dim() == 3 && t->size(1) == KVH && t->size(2) == D && t->stride(2) == 1 && t->stride(1) == D,
                "k and v must be (T, KVH, D) with each token's heads contiguous");
    TORCH_CHECK(t->scalar_type() == kv_cache.scalar_type(), "k/v and kv_cache dtypes differ");
  }
  TORCH_CHECK(slots.dim() == 1 && slots.scalar_type() == at::kLong && slots.is_contiguous(), "slots must be (N,) int64");
  const int64_t n = slots.size(0), pool_slots = kv_cache.size(1) * kv_cache.size(2);
  TORCH_CHECK(n <= k.size(0) && n <= v.size(0), "more slots than new tokens");
  const int64_t* sp = slots.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(sp[i] >= 0 && sp[i] < pool_slots, "slots[", i, "] = ", sp[i], " outside the pool");
  }
  const int64_t token_bytes = KVH * D * kv_cache.element_size();
  char* keys = static_cast<char*>(kv_cache.data_ptr());
  char* values = keys + pool_slots * token_bytes;
  const char* kp = static_cast<const char*>(k.const_data_ptr());
  const char* vp = static_cast<const char*>(v.const_data_ptr());
  const int64_t ks = k.stride(0) * k.element_size(), vs = v.stride(0) * v.element_size();
  const int64_t grain = 2 * n * token_bytes < kSerialBytes ? n : 1;
  at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      std::memcpy(keys + sp[i] * token_bytes, kp + i * ks, token_bytes);
      std::memcpy(values + sp[i] * token_bytes, vp + i * vs, token_bytes);
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pat_kernels, m) {
  m.def("write_kv_cpu_(Tensor(a!) kv_cache, Tensor k, Tensor v, Tensor slots) -> ()", &write_kv_cpu_);
}
