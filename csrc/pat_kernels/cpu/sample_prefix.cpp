// top_k / top_p: the draw among the kept prefix of the tokens by descending logit (ties: lower id first).
//
//   inverse_cdf_prefix_cpu(x, inv_temp, floor, u, top_k, top_p) -> (token, z_token, Z_kept)
//
// top_k: int64 (B,), <= 0 off; top_p: float64 (B,), >= 1 off; the rest as inverse_cdf_cpu's (sample.cpp).
// The prefix is the first top_k tokens of that order, cut to the first ones whose running float64 sum
// of weights (taken without the floor) reaches top_p * Z (Z over every token); the draw is then
// sample_rule.h's rule over the kept tokens alone (as if every other logit were -inf).
//
// A 4096-bucket histogram of the logits' ordered bits (their order as unsigned integers) finds the
// bucket where the prefix ends, and only that bucket's tokens are sorted (``exact_cut``); where the
// bucket sums cannot be shown to be the walk's own sums, every token of the highest buckets holding
// the prefix is sorted instead (``sorted_cut``). Either way the kept tokens are those whose key is at
// most the last kept one's, and the draw reads them in id order (``draw_kept``). Neither changes a bit
// of the rule: tests/test_sampler.py checks both against the torch path, which sorts the row.

#include "sample_rule.h"

namespace {

using namespace pat_sample;

inline uint32_t ordered_bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, sizeof b);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);  // unsigned order = float order
}

// A token's place in the prefix order: ascending keys = descending logits, ties by ascending id.
template <typename T>
inline uint64_t order_key(const T* row, int64_t i) {
  return (static_cast<uint64_t>(~ordered_bits(to_float(row[i]))) << 32) | static_cast<uint64_t>(i);
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

constexpr int kBucketShift = 20, kBuckets = 1 << (32 - kBucketShift);
inline int bucket_of(uint32_t ordered) { return static_cast<int>(ordered >> kBucketShift); }
inline int bucket_of_key(uint64_t key) { return bucket_of(~static_cast<uint32_t>(key >> 32)); }

// Every token's bucket, in SIMD lanes: the passes after it read two bytes a token instead of
// converting and reordering the logit each time.
template <typename T>
void buckets_of(const T* row, int64_t n, uint16_t* bucket) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) bucket[i] = static_cast<uint16_t>(bucket_of(ordered_bits(to_float(row[i]))));
}

// One row's prefix question: the first ``k_cap`` tokens, cut where the running sum of ``e`` reaches
// ``target`` (``nucleus``). ``e``: every token's weight without the floor (a nucleus only).
template <typename T>
struct PrefixQuery {
  const T* row;
  int64_t n, k_cap;
  bool nucleus;
  double target, z_all;
  const float* e;
  const uint16_t* bucket;  // every token's (``buckets_of``)
};

// Per bucket (highest = largest logits) how many tokens and how much weight it holds. Four copies,
// token i in copy i % 4: LM logits crowd a few buckets, and one copy would make every update wait on
// the last one to the same bucket; ``fold`` adds a bucket's copies in copy order.
struct Histogram {
  static constexpr int kCopies = 4;
  std::vector<int64_t> count;
  std::vector<double> mass;

  // The counts where top_k cuts, the masses where top_p does (neither: no limit, every token is kept).
  template <typename T>
  explicit Histogram(const PrefixQuery<T>& q)
      : count(q.k_cap < q.n ? kCopies * kBuckets : 0, 0), mass(q.nucleus ? kCopies * kBuckets : 0, 0.0) {
    if (!mass.empty() && !count.empty())
      fill<true, true>(q);
    else if (!mass.empty())
      fill<true, false>(q);
    else if (!count.empty())
      fill<false, true>(q);
  }
  template <bool kMass, bool kCount, typename T>
  void fill(const PrefixQuery<T>& q) {
    for (int64_t i = 0; i < q.n; ++i) {
      const int b = q.bucket[i] + static_cast<int>(i % kCopies) * kBuckets;
      if constexpr (kMass) mass[b] += q.e[i];
      if constexpr (kCount) count[b] += 1;
    }
  }
  std::pair<int64_t, double> fold(int b) const {
    int64_t c = 0;
    double m = 0.0;
    for (int k = 0; k < kCopies; ++k) {
      if (!count.empty()) c += count[k * kBuckets + b];
      if (!mass.empty()) m += mass[k * kBuckets + b];
    }
    return {c, m};
  }
};

// The prefix as ``keep`` tokens, the last of them ``last_key`` (every kept key is <= it); keep 0: none found.
// They are the tokens of ``above`` (ids, ascending) and the first keep - above.size() of ``cand``
// (keys, ascending).
struct Cut {
  int64_t keep = 0;
  uint64_t last_key = 0;
};

// Per thread: the vectors one row's prefix is found in.
struct PrefixScratch {
  std::vector<float> e;         // every weight without the floor (a nucleus), later the draw's masked weights
  std::vector<uint16_t> bucket;  // every token's bucket
  std::vector<uint64_t> cand, sort, above, ids;
  explicit PrefixScratch(int64_t n) : e(n), bucket(n) { cand.reserve(n); }
};

// Walks ``cand`` (sorted keys, all after ``count_above`` tokens of mass ``mass_above``) to the cut.
template <typename T>
Cut walk_to_cut(const PrefixQuery<T>& q, const std::vector<uint64_t>& cand, int64_t count_above, double mass_above) {
  double running = mass_above;
  int64_t pos = count_above;
  for (const uint64_t key : cand) {
    ++pos;
    if (q.nucleus) {
      running += q.e[static_cast<int64_t>(key & 0xffffffffu)];
      if (!(running < q.target)) return {pos, key};
    }
    if (pos == q.k_cap) return {pos, key};
  }
  return {};
}

// The prefix from the bucket it ends in, sorting that bucket alone. The running sum of a nucleus is
// then taken from bucket totals, in another order than the walk token by token: that is only the
// walk's value if every partial sum is exact. It is when every weight at or above the cut bucket is a
// float whose last bit is worth at least q = 2^(k - 53), k such that 2 Z < 2^k: each such weight is a
// multiple of q, and every sum of them is a multiple of q below 2^k (Z over every token is within
// 2^-30 of the exact total), which a double holds exactly. Where a weight is smaller, keep 0 (the
// caller sorts instead). A weight of 0 is always exact.
template <typename T>
Cut exact_cut(const PrefixQuery<T>& q, const Histogram& h, PrefixScratch& s) {
  int64_t count_above = 0;  // (where top_k cuts)
  double mass_above = 0.0;
  int cut = -1;
  const bool counted = q.k_cap < q.n;
  for (int b = kBuckets - 1; b >= 0 && cut < 0; --b) {
    const auto [c, m] = h.fold(b);
    if ((counted && count_above + c >= q.k_cap) || (q.nucleus && mass_above + m >= q.target)) {
      cut = b;
    } else {
      count_above += c;
      mass_above += m;
    }
  }
  if (cut < 0) return {};  // a sum that never reaches its target, or no limit at all
  int exponent = 0;
  std::frexp(2.0 * q.z_all, &exponent);  // 2 Z < 2^exponent
  const float smallest_exact = q.nucleus ? std::ldexp(1.0f, exponent - 30) : 0.0f;
  float smallest = std::numeric_limits<float>::infinity();
  int64_t above = 0;  // the tokens of the buckets above the cut (counted here: the histogram may not count)
  const size_t listed = static_cast<size_t>(q.n / 8);  // more kept tokens than this: the draw masks the row
  s.cand.clear();
  s.above.clear();
  for (int64_t i = 0; i < q.n; ++i) {
    const int b = q.bucket[i];
    if (b < cut) continue;
    if (q.nucleus && q.e[i] != 0.0f) smallest = std::min(smallest, q.e[i]);
    if (b == cut) {
      s.cand.push_back(order_key(q.row, i));
    } else {
      ++above;
      if (s.above.size() <= listed) s.above.push_back(static_cast<uint64_t>(i));
    }
  }
  if (smallest < smallest_exact) return {};
  sort_keys(s.cand, s.sort);
  return walk_to_cut(q, s.cand, above, mass_above);
}

// The prefix by sorting every token of the highest buckets that hold it (with a margin against the
// bucket sums' rounding, and a retry over every token): the walk token by token, whatever the weights.
template <typename T>
Cut sorted_cut(const PrefixQuery<T>& q, const Histogram& h, PrefixScratch& s) {
  std::vector<uint64_t>& cand = s.cand;
  s.above.clear();
  int low = 0;
  double acc_mass = 0.0;
  int64_t acc_count = 0;
  for (int b = kBuckets - 1; b >= 0; --b) {
    const auto [c, m] = h.fold(b);
    acc_count += c;
    acc_mass += m;
    if ((q.k_cap == q.n || acc_count >= q.k_cap) && (!q.nucleus || acc_mass >= q.target * (1.0 + 1e-9))) {
      low = b;
      break;
    }
  }
  for (int pass = 0; pass < 2; ++pass) {  // pass 1 (rounding beat the margin): every token
    cand.clear();
    for (int64_t i = 0; i < q.n; ++i)
      if (pass == 1 || q.bucket[i] >= low) cand.push_back(order_key(q.row, i));
    sort_keys(cand, s.sort);
    const Cut c = walk_to_cut(q, cand, 0, 0.0);
    if (c.keep > 0) return c;
    if (pass == 1 || static_cast<int64_t>(cand.size()) == q.n) break;  // the prefix may run past the candidates
  }
  return {static_cast<int64_t>(cand.size()), cand.back()};  // the sum never reached its target: every token
}

// The kept tokens' ids in ascending order: ``above`` merged with the kept keys of ``cand``.
void kept_ids(const Cut& cut, PrefixScratch& s) {
  const int64_t from_cand = cut.keep - static_cast<int64_t>(s.above.size());
  s.sort.clear();
  for (int64_t j = 0; j < from_cand; ++j) s.sort.push_back(s.cand[j] & 0xffffffffu);
  std::sort(s.sort.begin(), s.sort.end());
  s.ids.resize(static_cast<size_t>(cut.keep));
  std::merge(s.above.begin(), s.above.end(), s.sort.begin(), s.sort.end(), s.ids.begin());
}

// The draw over the kept tokens, in id order, with the floor: as the masked row in rows() would.
// ``w_ready``: ``s.e`` holds every weight with this floor (a nucleus without min_p), else the weights
// are computed here. Up to n / 8 kept tokens are visited by id; more through a row of weights with the
// others zeroed (adding 0.0 leaves every block's lanes and the running sum as they were).
template <typename T>
void draw_kept(const T* row, int64_t n, float m, float it, float fl, double u, const Cut& cut, bool w_ready,
               PrefixScratch& s, int64_t* token, float* z_token, double* z_kept) {
  float* w = s.e.data();
  auto weight_at = [&](int64_t i) { return w_ready ? w[i] : weight(row, i, m, it, fl); };
  int64_t t = -1;
  double goal = 0.0;
  if (cut.keep * 8 <= n) {
    kept_ids(cut, s);
    BlockedSum z;
    for (const uint64_t i : s.ids) z.add(static_cast<int64_t>(i), weight_at(static_cast<int64_t>(i)));
    *z_kept = z.total();
    goal = u * *z_kept;
    double sum = 0.0;
    int64_t last = 0;
    for (const uint64_t id : s.ids) {
      const int64_t i = static_cast<int64_t>(id);
      const float wi = weight_at(i);
      if (wi > 0.0f) last = i;
      sum += static_cast<double>(wi);
      if (sum > goal) {
        t = i;
        break;
      }
    }
    if (t < 0) t = last;
  } else {
    const int last_bucket = bucket_of_key(cut.last_key);
    const uint16_t* bucket = s.bucket.data();
    for (int64_t i = 0; i < n; ++i) {
      const bool kept = (bucket[i] > last_bucket) | ((bucket[i] == last_bucket) & (order_key(row, i) <= cut.last_key));
      w[i] = kept ? weight_at(i) : 0.0f;
    }
    *z_kept = blocked_sum(w, n);
    goal = u * *z_kept;
    const float* rows_w[1] = {w};
    scan_group(rows_w, 1, n, &goal, &t);  // the first passing token, else the last with mass
  }
  *token = t;
  *z_token = (to_float(row[t]) - m) * it;
}

template <typename T>
void prefix_row(const T* row, int64_t n, float it, float fl, double u, int64_t top_k, double top_p,
                int64_t* token, float* z_token, double* z_kept, PrefixScratch& s) {
  const float m = row_max(row, n);
  const float no_floor = -std::numeric_limits<float>::infinity();
  buckets_of(row, n, s.bucket.data());
  PrefixQuery<T> q{row, n, top_k > 0 && top_k < n ? top_k : n, top_p < 1.0, 0.0, 0.0, s.e.data(), s.bucket.data()};
  // top_p reads every weight (one exp pass, kept in ``e``: Z and the prefix mass from the same floats);
  // top_k alone needs none but the kept tokens' in the draw
  if (q.nucleus) {
    q.z_all = lane_sum(row, n, m, it, no_floor, s.e.data());
    q.target = top_p * q.z_all;
  }
  const Histogram h(q);
  Cut cut = exact_cut(q, h, s);
  if (cut.keep == 0) cut = sorted_cut(q, h, s);
  draw_kept(row, n, m, it, fl, u, cut, q.nucleus && fl == no_floor, s, token, z_token, z_kept);
}

template <typename T>
void prefix_rows(const RowArgs<T>& a, int64_t b, const int64_t* top_k, const double* top_p) {
  at::parallel_for(0, b, 1, [&](int64_t begin, int64_t end) {
    PrefixScratch s(a.n);
    for (int64_t r = begin; r < end; ++r)
      prefix_row(a.row(r), a.n, a.inv_temp[r], a.floor[r], a.u[r], top_k[r], top_p[r], a.token + r, a.z_token + r,
                 a.z_sum + r, s);
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
  m.def("inverse_cdf_prefix_cpu(Tensor x, Tensor inv_temp, Tensor floor, Tensor u, Tensor top_k, Tensor top_p) -> "
        "(Tensor, Tensor, Tensor)", &inverse_cdf_prefix_cpu);
}
