// zerocore::grad_stats on CPU: the sum of squares of a gradient shard and whether any element is
// inf or nan, in one read of the shard.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>

#include "../zerocore.h"
#include "vec_io.h"

namespace zerocore::cpu {
namespace {

struct Stats {
  double sum_sq = 0.0;
  bool nonfinite = false;
};

// Squares summed in float within a block of kGrain elements (fast, vectorised), blocks summed
// in double. A non-finite block sum means an inf/nan element or an overflowing square; the
// block is then re-read in double to tell the two apart and get the exact sum.
template <typename G>
Stats stats_range(const G* g, int64_t begin, int64_t end) {
  Vec acc0(0.0f), acc1(0.0f);
  int64_t i = begin;
  for (; i + kBlock <= end; i += kBlock) {
    Vec a, b;
    load2(g + i, a, b);
    acc0 = acc0 + a * a;
    acc1 = acc1 + b * b;
  }
  float tail = 0.0f;
  for (; i < end; ++i) {
    const float x = static_cast<float>(g[i]);
    tail += x * x;
  }
  const float block_sum = at::vec::vec_reduce_all<float>(
                              [](Vec x, Vec y) { return x + y; }, acc0 + acc1) +
                          tail;
  Stats s;
  if (std::isfinite(block_sum)) {
    s.sum_sq = block_sum;
    return s;
  }
  for (int64_t j = begin; j < end; ++j) {
    const double x = static_cast<double>(static_cast<float>(g[j]));
    s.nonfinite |= !std::isfinite(x);
    s.sum_sq += x * x;
  }
  return s;
}

void grad_stats_cpu(const at::Tensor& grad, at::Tensor stats) {
  check_grad_stats(grad, stats);
  TORCH_CHECK(grad.device().is_cpu(), "zerocore.grad_stats (CPU): grad must be on the CPU");
  TORCH_CHECK(stats.is_contiguous(), "zerocore.grad_stats: stats must be contiguous");
  const int64_t n = grad.numel();
  Stats total;
  dispatch_float(grad.scalar_type(), [&](auto* tag) {
    using G = std::remove_pointer_t<decltype(tag)>;
    const G* g = static_cast<const G*>(grad.data_ptr());
    total = at::parallel_reduce(
        0, n, kGrain, Stats{},
        [&](int64_t begin, int64_t end, Stats acc) {
          // Sub-blocks aligned to multiples of kGrain keep the float partial sums short and the
          // result independent of how many threads split the range.
          for (int64_t b = begin; b < end;) {
            const int64_t block_end = std::min(end, (b / kGrain + 1) * kGrain);
            const Stats s = stats_range(g, b, block_end);
            b = block_end;
            acc.sum_sq += s.sum_sq;
            acc.nonfinite |= s.nonfinite;
          }
          return acc;
        },
        [](Stats a, const Stats& b) {
          a.sum_sq += b.sum_sq;
          a.nonfinite |= b.nonfinite;
          return a;
        });
  });
  float* out = stats.data_ptr<float>();
  out[0] = static_cast<float>(static_cast<double>(out[0]) + total.sum_sq);
  if (total.nonfinite) out[1] = 1.0f;
}

}  // namespace

TORCH_LIBRARY_IMPL(zerocore, CPU, m) { m.impl("grad_stats", &grad_stats_cpu); }

}  // namespace zerocore::cpu
