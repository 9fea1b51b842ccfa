// zerocore::quantize_blockwise and zerocore::dequantize_blockwise_ on CPU: symmetric int8
// quantization with one fp32 scale per block of consecutive elements. Frozen weights are stored and
// all-gathered as int8 and widened into the compute dtype right after the gather, straight into
// the gathered flat buffer whose slices are the parameters' views.
//
// Both kernels compute zerocore.reference's definitions bit for bit, as the CUDA kernels do: every
// division is an IEEE division (never a multiplication by a reciprocal, which can differ in the
// last bit), rounding to an integer is half to even, and a dequantized element is one fp32 product
// rounded once to the output dtype. The vector bodies and the scalar tails round alike.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <tuple>

#include "../zerocore.h"
#include "vec_io.h"

namespace zerocore::cpu {
namespace {

constexpr float kQMax = 127.0f;

// max(m, a) that is NaN when either is NaN (std::max keeps m when a is NaN), so that a block
// holding a NaN gets a NaN absmax, hence a NaN scale, which the op then reports.
inline float nan_max(float m, float a) { return (a > m || a != a) ? a : m; }

template <typename T>
float block_absmax(const T* x, int64_t n) {
  float m = 0.0f;
  int64_t i = 0;
  if (n >= kBlock) {
    Vec ma(0.0f), mb(0.0f);
    for (; i + kBlock <= n; i += kBlock) {
      Vec a, b;
      load2(x + i, a, b);
      // at::vec::maximum propagates NaN, like nan_max.
      ma = at::vec::maximum(ma, a.abs());
      mb = at::vec::maximum(mb, b.abs());
    }
    float lanes[Vec::size()];
    at::vec::maximum(ma, mb).store(lanes);
    for (const float v : lanes) m = nan_max(m, v);
  }
  for (; i < n; ++i) m = nan_max(m, std::abs(static_cast<float>(x[i])));
  return m;
}

template <typename T>
void quantize_block(const T* x, int8_t* q, float* scale_out, int64_t n) {
  const float scale = block_absmax(x, n) / kQMax;
  *scale_out = scale;
  // A zero scale (all zeros, or an absmax so small that absmax / 127 underflows to 0) gives q = 0.
  // A non-finite one (an inf or nan in the block) is reported after the kernel; zeros here keep
  // the float -> int8 conversions below defined.
  if (!(scale != 0.0f && std::isfinite(scale))) {
    std::memset(q, 0, n);
    return;
  }
  const Vec s(scale), lo(-kQMax), hi(kQMax);
  int64_t i = 0;
  for (; i + kBlock <= n; i += kBlock) {
    Vec a, b;
    load2(x + i, a, b);
    // Vec::round() rounds half to even (the default rounding mode), as std::nearbyint below.
    store2_int8(q + i, at::vec::clamp((a / s).round(), lo, hi),
                at::vec::clamp((b / s).round(), lo, hi));
  }
  for (; i < n; ++i) {
    const float r = std::nearbyint(static_cast<float>(x[i]) / scale);
    q[i] = static_cast<int8_t>(std::min(kQMax, std::max(-kQMax, r)));
  }
}

std::tuple<at::Tensor, at::Tensor> quantize_blockwise_cpu(const at::Tensor& x, int64_t block) {
  check_quantize_blockwise(x, block);
  TORCH_CHECK(x.device().is_cpu(), "zerocore.quantize_blockwise (CPU): x must be on the CPU");
  const int64_t n = x.numel();
  const int64_t n_blocks = n / block;
  at::Tensor q = at::empty({n}, x.options().dtype(at::kChar));
  at::Tensor scales = at::empty({n_blocks}, x.options().dtype(at::kFloat));
  int8_t* q_ptr = q.data_ptr<int8_t>();
  float* s_ptr = scales.data_ptr<float>();
  // Whole blocks per task, about kGrain elements of them.
  const int64_t grain = std::max<int64_t>(1, kGrain / block);
  dispatch_float(x.scalar_type(), [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T* x_ptr = static_cast<const T*>(x.data_ptr());
    at::parallel_for(0, n_blocks, grain, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        quantize_block(x_ptr + b * block, q_ptr + b * block, s_ptr + b, block);
      }
    });
  });
  check_quantized_finite(scales, block);
  return {q, scales};
}

// out[begin, end) one block at a time: for any block size, and for the tails of the vector path.
template <typename D>
void dequantize_scalar(const int8_t* q, const float* scales, D* out, int64_t block,
                       int64_t begin, int64_t end) {
  int64_t i = begin;
  for (int64_t b = begin / block; i < end; ++b) {
    const int64_t stop = std::min(end, (b + 1) * block);
    const float s = scales[b];
    for (; i < stop; ++i) out[i] = static_cast<D>(static_cast<float>(q[i]) * s);
  }
}

// out[begin, end) in steps of kBlock elements for block >= kBlock, so that one step spans at most
// two blocks: the lanes before the boundary take the first block's scale, the rest the next one's.
// The steps need not start at a block boundary, since out (a parameter's slice of a flat buffer)
// may start anywhere; with streaming stores they start where out is 32-byte aligned.
template <typename D>
void dequantize_vector(const int8_t* q, const float* scales, D* out, int64_t block,
                       int64_t begin, int64_t end, bool stream) {
  int64_t i = begin;
  const int64_t head = stream ? streaming_head(out + begin) : -1;
  const bool streaming = head >= 0 && head + kBlock <= end - begin;
  if (streaming) {
    dequantize_scalar(q, scales, out, block, i, i + head);
    i += head;
  }
  int64_t b = i / block;
  int64_t block_end = (b + 1) * block;
  for (; i + kBlock <= end; i += kBlock) {
    Vec qa, qb;
    load2_int8(q + i, qa, qb);
    const Vec s0(scales[b]);
    Vec sa = s0, sb = s0;
    const int64_t k = block_end - i;  // lanes of this step in block b, >= 1
    if (k < kBlock) {
      // Block b + 1 exists: its first element, i + k, is before i + kBlock <= end.
      const Vec s1(scales[b + 1]);
      sa = Vec::set(s1, s0, std::min<int64_t>(k, Vec::size()));
      sb = Vec::set(s1, s0, std::max<int64_t>(k - Vec::size(), 0));
    }
    if (block_end <= i + kBlock) {
      ++b;
      block_end += block;
    }
    if (streaming) {
      stream2(out + i, qa * sa, qb * sb);
    } else {
      store2(out + i, qa * sa, qb * sb);
    }
  }
  dequantize_scalar(q, scales, out, block, i, end);
}

void dequantize_blockwise_cpu(at::Tensor out, const at::Tensor& q, const at::Tensor& scales,
                              int64_t block) {
  check_dequantize_blockwise(out, q, scales, block);
  TORCH_CHECK(out.device().is_cpu(), "zerocore.dequantize_blockwise_ (CPU): out must be on the "
              "CPU");
  const int64_t n = q.numel();
  const int8_t* q_ptr = q.data_ptr<int8_t>();
  const float* s_ptr = scales.data_ptr<float>();
  const bool stream = use_streaming_stores(
      n * static_cast<int64_t>(1 + out.element_size()) + scales.numel() * 4);
  dispatch_float(out.scalar_type(), [&](auto* tag) {
    using D = std::remove_pointer_t<decltype(tag)>;
    D* out_ptr = static_cast<D*>(out.data_ptr());
    at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) {
      if (block >= kBlock) {
        dequantize_vector(q_ptr, s_ptr, out_ptr, block, begin, end, stream);
      } else {
        dequantize_scalar(q_ptr, s_ptr, out_ptr, block, begin, end);
      }
      streaming_fence();
    });
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(zerocore, CPU, m) {
  m.impl("quantize_blockwise", &quantize_blockwise_cpu);
  m.impl("dequantize_blockwise_", &dequantize_blockwise_cpu);
}

}  // namespace zerocore::cpu
