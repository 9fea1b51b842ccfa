// zerocore::pack and zerocore::unpack on CPU: many tensors to/from one contiguous flat buffer,
// converting dtype on the way. The flat buffer is split into even pieces across threads (one
// parallel region for the whole list, not one per tensor), so a list of many small tensors is as
// fast as one large one. Non-contiguous tensors go through ATen's strided copy. Calls larger than
// the cache write with streaming stores (vec_io.h): a copy then moves 2 bytes per byte, not 3.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>

#include "../zerocore.h"
#include "vec_io.h"

namespace zerocore::cpu {
namespace {

// Same dtype: a byte copy, so every bit pattern (NaN payloads included) arrives unchanged.
void copy_bytes(char* dst, const char* src, int64_t n, bool stream) {
#if defined(ZEROCORE_AVX2_STREAMING)
  if (stream) {
    const auto head = std::min<int64_t>(n, (32 - reinterpret_cast<uintptr_t>(dst) % 32) % 32);
    std::memcpy(dst, src, head);
    int64_t i = head;
    for (; i + 64 <= n; i += 64) {
      const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
      const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i + 32));
      _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i), a);
      _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i + 32), b);
    }
    std::memcpy(dst + i, src + i, n - i);
    return;
  }
#endif
  std::memcpy(dst, src, n);
}

// All-zero bits are +0.0 in float32, float16 and bfloat16 alike.
void zero_bytes(char* dst, int64_t n, bool stream) {
#if defined(ZEROCORE_AVX2_STREAMING)
  if (stream) {
    const auto head = std::min<int64_t>(n, (32 - reinterpret_cast<uintptr_t>(dst) % 32) % 32);
    std::memset(dst, 0, head);
    int64_t i = head;
    const __m256i zero = _mm256_setzero_si256();
    for (; i + 32 <= n; i += 32) _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i), zero);
    std::memset(dst + i, 0, n - i);
    return;
  }
#endif
  std::memset(dst, 0, n);
}

template <typename S, typename D>
void convert_copy(const S* src, D* dst, int64_t n, bool stream) {
  if constexpr (std::is_same_v<S, D>) {
    copy_bytes(reinterpret_cast<char*>(dst), reinterpret_cast<const char*>(src),
               n * static_cast<int64_t>(sizeof(S)), stream);
  } else {
    int64_t i = 0;
    const int64_t head = stream ? streaming_head(dst) : -1;
    if (head >= 0 && head + kBlock <= n) {
      for (; i < head; ++i) dst[i] = static_cast<D>(static_cast<float>(src[i]));
      for (; i + kBlock <= n; i += kBlock) {
        Vec a, b;
        load2(src + i, a, b);
        stream2(dst + i, a, b);
      }
    }
    for (; i + kBlock <= n; i += kBlock) {
      Vec a, b;
      load2(src + i, a, b);
      store2(dst + i, a, b);
    }
    for (; i < n; ++i) dst[i] = static_cast<D>(static_cast<float>(src[i]));
  }
}

void convert_copy_any(const void* src, at::ScalarType src_type, void* dst,
                      at::ScalarType dst_type, int64_t n, bool stream) {
  dispatch_float(src_type, [&](auto* s_tag) {
    using S = std::remove_pointer_t<decltype(s_tag)>;
    dispatch_float(dst_type, [&](auto* d_tag) {
      using D = std::remove_pointer_t<decltype(d_tag)>;
      convert_copy(static_cast<const S*>(src), static_cast<D*>(dst), n, stream);
    });
  });
}

// Bytes a pack or unpack reads and writes: every tensor once and the flat buffer once.
int64_t bytes_touched(at::TensorList tensors, const at::Tensor& flat) {
  int64_t bytes = flat.numel() * static_cast<int64_t>(flat.element_size());
  for (const at::Tensor& t : tensors) bytes += t.numel() * static_cast<int64_t>(t.element_size());
  return bytes;
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
    streaming_fence();  // fn may have used streaming stores
  });
}

void pack_cpu(at::TensorList tensors, at::IntArrayRef offsets, at::Tensor flat) {
  const std::vector<Segment> segments = plan_segments(tensors, offsets, flat, "pack");
  TORCH_CHECK(flat.device().is_cpu(), "zerocore.pack (CPU): flat must be on the CPU");
  const size_t elem = flat.element_size();
  char* flat_ptr = static_cast<char*>(flat.data_ptr());
  const bool stream = use_streaming_stores(bytes_touched(tensors, flat));
  for_each_piece(segments, flat.numel(), [&](const Segment& s, int64_t lo, int64_t hi) {
    if (s.tensor < 0) {
      zero_bytes(flat_ptr + lo * elem, (hi - lo) * elem, stream);
      return;
    }
    const at::Tensor& t = tensors[s.tensor];
    if (!t.is_contiguous()) return;  // copied below
    const char* src =
        static_cast<const char*>(t.data_ptr()) + (lo - s.flat_offset) * t.element_size();
    convert_copy_any(src, t.scalar_type(), flat_ptr + lo * elem, flat.scalar_type(), hi - lo,
                     stream);
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
  const bool stream = use_streaming_stores(bytes_touched(tensors, flat));
  for_each_piece(segments, flat.numel(), [&](const Segment& s, int64_t lo, int64_t hi) {
    if (s.tensor < 0) return;
    const at::Tensor& t = tensors[s.tensor];
    if (!t.is_contiguous()) return;  // copied below
    char* dst = static_cast<char*>(t.data_ptr()) + (lo - s.flat_offset) * t.element_size();
    convert_copy_any(flat_ptr + lo * elem, flat.scalar_type(), dst, t.scalar_type(), hi - lo,
                     stream);
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
