// zerocore::pack and zerocore::unpack on CPU: many tensors to/from one contiguous flat buffer,
// converting dtype on the way. The flat buffer is split into even pieces across threads (one
// parallel region for the whole list, not one per tensor), so a list of many small tensors is as
// fast as one large one. Non-contiguous tensors go through ATen's strided copy.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>

#include "../zerocore.h"
#include "vec_io.h"

namespace zerocore::cpu {
namespace {

template <typename S, typename D>
void convert_copy(const S* src, D* dst, int64_t n) {
  if constexpr (std::is_same_v<S, D>) {
    std::memcpy(dst, src, n * sizeof(S));
  } else {
    int64_t i = 0;
    for (; i + kBlock <= n; i += kBlock) {
      Vec a, b;
      load2(src + i, a, b);
      store2(dst + i, a, b);
    }
    for (; i < n; ++i) dst[i] = static_cast<D>(static_cast<float>(src[i]));
  }
}

void convert_copy_any(const void* src, at::ScalarType src_type, void* dst,
                      at::ScalarType dst_type, int64_t n) {
  dispatch_float(src_type, [&](auto* s_tag) {
    using S = std::remove_pointer_t<decltype(s_tag)>;
    dispatch_float(dst_type, [&](auto* d_tag) {
      using D = std::remove_pointer_t<decltype(d_tag)>;
      convert_copy(static_cast<const S*>(src), static_cast<D*>(dst), n);
    });
  });
}

// Splits [0, flat_numel) into pieces across threads and calls fn(segment, lo, hi) for each part
// [lo, hi) of a segment that falls in a thread's piece.
template <typename F>
void for_each_piece(const std::vector<Segment>& segments, int64_t flat_numel, F&& fn) {
  at::parallel_for(0, flat_numel, kGrain, [&](int64_t begin, int64_t end) {
    auto it = std::upper_bound(
        segments.begin(), segments.end(), begin,
        [](int64_t pos, const Segment& s) { return pos < s.flat_offset; });
    if (it != segments.begin()) --it;
    for (; it != segments.end() && it->flat_offset < end; ++it) {
      const int64_t lo = std::max(begin, it->flat_offset);
      const int64_t hi = std::min(end, it->flat_offset + it->numel);
      if (lo < hi) fn(*it, lo, hi);
    }
  });
}

void pack_cpu(at::TensorList tensors, at::IntArrayRef offsets, at::Tensor flat) {
  const std::vector<Segment> segments = plan_segments(tensors, offsets, flat, "pack");
  TORCH_CHECK(flat.device().is_cpu(), "zerocore.pack (CPU): flat must be on the CPU");
  const size_t elem = flat.element_size();
  char* flat_ptr = static_cast<char*>(flat.data_ptr());
  for_each_piece(segments, flat.numel(), [&](const Segment& s, int64_t lo, int64_t hi) {
    if (s.tensor < 0) {
      // All-zero bits are +0.0 in float32, float16 and bfloat16 alike.
      std::memset(flat_ptr + lo * elem, 0, (hi - lo) * elem);
      return;
    }
    const at::Tensor& t = tensors[s.tensor];
    if (!t.is_contiguous()) return;  // copied below
    const char* src = static_cast<const char*>(t.data_ptr()) + (lo - s.flat_offset) * t.element_size();
    convert_copy_any(src, t.scalar_type(), flat_ptr + lo * elem, flat.scalar_type(), hi - lo);
  });
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    if (t.numel() > 0 && !t.is_contiguous()) {
      flat.narrow(0, offsets[i], t.numel()).view(t.sizes()).copy_(t);
    }
  }
}

void unpack_cpu(const at::Tensor& flat, at::IntArrayRef offsets, at::TensorList tensors) {
  const std::vector<Segment> segments = plan_segments(tensors, offsets, flat, "unpack");
  TORCH_CHECK(flat.device().is_cpu(), "zerocore.unpack (CPU): flat must be on the CPU");
  const size_t elem = flat.element_size();
  const char* flat_ptr = static_cast<const char*>(flat.data_ptr());
  for_each_piece(segments, flat.numel(), [&](const Segment& s, int64_t lo, int64_t hi) {
    if (s.tensor < 0) return;
    const at::Tensor& t = tensors[s.tensor];
    if (!t.is_contiguous()) return;  // copied below
    char* dst = static_cast<char*>(t.data_ptr()) + (lo - s.flat_offset) * t.element_size();
    convert_copy_any(flat_ptr + lo * elem, flat.scalar_type(), dst, t.scalar_type(), hi - lo);
  });
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    if (t.numel() > 0 && !t.is_contiguous()) {
      // const_cast: the list is const but its tensors are the op's outputs (Tensor(a!)[]).
      const_cast<at::Tensor&>(t).copy_(flat.narrow(0, offsets[i], t.numel()).view(t.sizes()));
    }
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(zerocore, CPU, m) {
  m.impl("pack", &pack_cpu);
  m.impl("unpack", &unpack_cpu);
}

}  // namespace zerocore::cpu
