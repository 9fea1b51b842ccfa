// zerocore::pack and zerocore::unpack on CUDA: many tensors to/from one contiguous flat buffer,
// converting dtype on the way, in ONE kernel launch for the whole list.
//
// The host describes each segment of the flat buffer (plan_segments in checks.cpp: a tensor's
// elements, or padding that pack zero-fills) in a small table, uploads it with one asynchronous
// copy from pinned memory, and cuts every segment into chunks of kChunk elements. A prefix table
// (the first chunk of each segment) lets any block find its segment by binary search, so the
// blocks of a grid-stride loop over chunks share the work evenly whether the list holds one huge
// tensor or thousands of small ones. Contiguous tensors are copied with 16-byte accesses when
// they and their slice of flat are aligned alike; others go through stride arithmetic on their
// dimensions after merging those that are laid out contiguously with respect to each other.
#include <ATen/MemoryOverlap.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#include "../zerocore.h"
#include "cuda_common.cuh"

namespace zerocore::cuda {
namespace {

// Dimensions kept per tensor after merging; a tensor that still has more is copied by ATen
// after the kernel (rare: it takes more than 8 non-mergeable strided dimensions).
constexpr int kMaxDims = 8;
// Elements per chunk, the unit a block takes from the grid-stride loop. A multiple of kVec, so
// the alignment of a segment's first element carries over to every chunk of it.
constexpr int64_t kChunk = 8192;
// Vector steps each thread issues before storing any, to keep that many 16-byte loads in flight.
constexpr int kUnroll = kChunk / (kThreads * kVec);
static_assert(kChunk % (kThreads * kVec) == 0, "a chunk must be whole vector passes");

enum DType : int32_t { kF32 = 0, kF16 = 1, kBF16 = 2 };

// One segment of the flat buffer as the kernel sees it. Trivially copyable: uploaded as bytes.
struct SegmentMeta {
  void* data;           // the tensor's first element; null for padding (pack zero-fills it)
  int64_t flat_offset;  // first element in flat
  int64_t numel;
  int64_t head;         // vector_head of (tensor, flat slice) if contiguous, of the flat slice
                        // alone for padding, -1 for a strided tensor
  int32_t dtype;        // DType of the tensor
  int32_t ndim;         // 0: contiguous, element i at data[i]; else sizes/strides below are used
  int64_t sizes[kMaxDims];    // outermost dimension first
  int64_t strides[kMaxDims];  // in elements
};
static_assert(std::is_trivially_copyable_v<SegmentMeta>);

template <typename D, typename S>
__device__ __forceinline__ D convert_elem(S x) {
  if constexpr (std::is_same_v<S, D>) {
    return x;  // same dtype: copy the bits, NaN payloads included, as memcpy would
  } else {
    return from_float<D>(to_float(x));
  }
}

// dst[begin, end) = src[begin, end), converting. head: as SegmentMeta::head, relative to element
// 0 of src and dst; begin is a multiple of kVec, so element begin + head is aligned as well.
template <typename S, typename D>
__device__ __forceinline__ void copy_range(const S* src, D* dst, int64_t begin, int64_t end,
                                           int64_t head) {
  if (head < 0) {
    for (int64_t i = begin + threadIdx.x; i < end; i += kThreads) dst[i] = convert_elem<D>(src[i]);
    return;
  }
  const int64_t vec_begin = min(begin + head, end);
  const int64_t vec_end = vec_begin + (end - vec_begin) / kVec * kVec;
  const int64_t head_i = begin + threadIdx.x;  // one of the < kVec elements before vec_begin
  if (head_i < vec_begin) dst[head_i] = convert_elem<D>(src[head_i]);
  const int64_t tail_i = vec_end + threadIdx.x;  // one of the < kVec elements after vec_end
  if (tail_i < end) dst[tail_i] = convert_elem<D>(src[tail_i]);
  constexpr int64_t kPass = kThreads * kVec;
  for (int64_t base = vec_begin + threadIdx.x * kVec; base < vec_end; base += kPass * kUnroll) {
    S buf[kUnroll][kVec];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (base + u * kPass < vec_end) load_vec(src + base + u * kPass, buf[u]);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (base + u * kPass < vec_end) {
        D out[kVec];
#pragma unroll
        for (int j = 0; j < kVec; ++j) out[j] = convert_elem<D>(buf[u][j]);
        store_vec(dst + base + u * kPass, out);
      }
    }
  }
}

// dst[begin, end) = +0.0 (all-zero bits in float, Half and BFloat16 alike).
template <typename D>
__device__ __forceinline__ void zero_range(D* dst, int64_t begin, int64_t end, int64_t head) {
  const D zero = from_float<D>(0.0f);
  const int64_t vec_begin = min(begin + head, end);
  const int64_t vec_end = vec_begin + (end - vec_begin) / kVec * kVec;
  if (begin + threadIdx.x < vec_begin) dst[begin + threadIdx.x] = zero;
  if (vec_end + threadIdx.x < end) dst[vec_end + threadIdx.x] = zero;
  D zeros[kVec];
#pragma unroll
  for (int j = 0; j < kVec; ++j) zeros[j] = zero;
  for (int64_t i = vec_begin + threadIdx.x * kVec; i < vec_end; i += kThreads * kVec) {
    store_vec(dst + i, zeros);
  }
}

// Offset in elements from data of the tensor's i-th element in row-major order.
__device__ __forceinline__ int64_t strided_offset(const SegmentMeta& seg, int64_t i) {
  int64_t offset = 0;
  for (int d = seg.ndim - 1; d >= 0; --d) {
    const int64_t size = seg.sizes[d];
    offset += (i % size) * seg.strides[d];
    i /= size;
  }
  return offset;
}

// Elements [begin, end) of one tensor segment, between the tensor (type T) and its slice of flat
// (type F) that starts at flat_part.
template <typename T, typename F, bool kPack>
__device__ __forceinline__ void copy_segment(const SegmentMeta& seg, F* flat_part, int64_t begin,
                                             int64_t end) {
  T* t = static_cast<T*>(seg.data);
  if (seg.ndim == 0) {
    if constexpr (kPack) {
      copy_range(t, flat_part, begin, end, seg.head);
    } else {
      copy_range(flat_part, t, begin, end, seg.head);
    }
    return;
  }
  for (int64_t i = begin + threadIdx.x; i < end; i += kThreads) {
    const int64_t j = strided_offset(seg, i);
    if constexpr (kPack) {
      flat_part[i] = convert_elem<F>(t[j]);
    } else {
      t[j] = convert_elem<T>(flat_part[i]);
    }
  }
}

// The last segment whose first chunk is <= chunk. Every segment has at least one chunk, so the
// table is strictly increasing and starts at 0.
__device__ __forceinline__ int64_t find_segment(const int64_t* first_chunk, int64_t n_segments,
                                                int64_t chunk) {
  int64_t lo = 0, hi = n_segments - 1;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (first_chunk[mid] <= chunk) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

// Blocks per multiprocessor the pack kernel must fit: its launch bounds cap it at 128 registers a
// thread (65536 / (2 * kThreads)). It needs up to 112 (sm_90, ptxas -v; the converting pack with
// a float source holds kUnroll vectors of 8 floats); a cap of 3 blocks (85 registers) made ptxas
// spill 72-80 bytes a thread to local memory. Two blocks keep 2 * kThreads * kUnroll 16-byte
// loads or more in flight per multiprocessor, 32 KiB, above the ~25 KiB an H200 needs to cover
// its memory latency (4.8 TB/s x ~0.7 us / 132 multiprocessors). The bound also keeps a later
// edit from silently dropping the kernel to one block per multiprocessor (255 registers).
constexpr int kPackMinBlocksPerSm = 2;

// kPack: tensors -> flat; else flat -> tensors (flat is then only read). Launched with kThreads
// threads per block; every thread of a block works on the same chunk, so the per-segment
// branches below never diverge within a warp.
template <typename F, bool kPack>
__global__ void __launch_bounds__(kThreads, kPackMinBlocksPerSm)
    pack_kernel(const int64_t* __restrict__ first_chunk, const SegmentMeta* __restrict__ segments,
                int64_t n_segments, int64_t n_chunks, F* flat) {
  for (int64_t chunk = blockIdx.x; chunk < n_chunks; chunk += gridDim.x) {
    const int64_t s = find_segment(first_chunk, n_segments, chunk);
    const SegmentMeta& seg = segments[s];
    const int64_t begin = (chunk - first_chunk[s]) * kChunk;
    const int64_t end = min(begin + kChunk, seg.numel);
    F* flat_part = flat + seg.flat_offset;
    if (seg.data == nullptr) {
      zero_range(flat_part, begin, end, seg.head);
      continue;
    }
    switch (seg.dtype) {
      case kF32: copy_segment<float, F, kPack>(seg, flat_part, begin, end); break;
      case kF16: copy_segment<c10::Half, F, kPack>(seg, flat_part, begin, end); break;
      default: copy_segment<c10::BFloat16, F, kPack>(seg, flat_part, begin, end); break;
    }
  }
}

int32_t dtype_code(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return kF32;
    case at::kHalf: return kF16;
    case at::kBFloat16: return kBF16;
    default: TORCH_CHECK(false, "zerocore: unsupported dtype ", t);
  }
  return -1;  // not reached: TORCH_CHECK(false) throws
}

// Fills meta.sizes/strides with t's dimensions, dropping size-1 ones and merging each dimension
// into the one outside it when the outer stride is the inner extent (so a transposed matrix keeps
// 2 dims and a slice of rows becomes 1). Returns 0 when the result is plain contiguous, the number
// of dimensions kept otherwise, or -1 when more than kMaxDims remain.
int collapse_dims(const at::Tensor& t, SegmentMeta& meta) {
  std::vector<std::pair<int64_t, int64_t>> dims;  // (size, stride), outermost first
  for (int64_t d = 0; d < t.dim(); ++d) {
    const int64_t size = t.size(d);
    const int64_t stride = t.stride(d);
    if (size == 1) continue;
    if (!dims.empty() && dims.back().second == size * stride) {
      dims.back().first *= size;
      dims.back().second = stride;
    } else {
      dims.emplace_back(size, stride);
    }
  }
  if (dims.empty() || (dims.size() == 1 && dims[0].second == 1)) return 0;
  if (dims.size() > static_cast<size_t>(kMaxDims)) return -1;
  for (size_t d = 0; d < dims.size(); ++d) {
    meta.sizes[d] = dims[d].first;
    meta.strides[d] = dims[d].second;
  }
  return static_cast<int>(dims.size());
}

// Shared by pack (kPack = true) and unpack. segments: plan_segments' list for this call.
void run_pack(at::TensorList tensors, const at::Tensor& flat,
              const std::vector<Segment>& segments, bool pack) {
  const c10::cuda::CUDAGuard guard(flat.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  char* flat_bytes = static_cast<char*>(flat.data_ptr());
  const int64_t flat_elem = flat.element_size();

  std::vector<SegmentMeta> metas;
  std::vector<int64_t> first_chunk;  // the prefix table: chunks of all earlier segments
  std::vector<Segment> by_aten;      // tensors with too many dimensions for SegmentMeta
  metas.reserve(segments.size());
  first_chunk.reserve(segments.size());
  int64_t n_chunks = 0;
  for (const Segment& s : segments) {
    if (s.tensor < 0 && !pack) continue;  // unpack reads nothing from the padding
    SegmentMeta meta;
    std::memset(&meta, 0, sizeof(meta));
    meta.flat_offset = s.flat_offset;
    meta.numel = s.numel;
    const void* flat_part = flat_bytes + s.flat_offset * flat_elem;
    if (s.tensor < 0) {
      meta.data = nullptr;
      meta.head = vector_head({{flat_part, flat_elem}}, s.numel);
    } else {
      const at::Tensor& t = tensors[s.tensor];
      meta.ndim = collapse_dims(t, meta);
      if (meta.ndim < 0) {
        by_aten.push_back(s);
        continue;
      }
      meta.data = t.data_ptr();
      meta.dtype = dtype_code(t.scalar_type());
      // Strided tensors are copied element by element: no vector steps.
      meta.head = -1;
      if (meta.ndim == 0) {
        meta.head = vector_head({{meta.data, t.element_size()}, {flat_part, flat_elem}}, s.numel);
      }
    }
    metas.push_back(meta);
    first_chunk.push_back(n_chunks);
    n_chunks += (s.numel + kChunk - 1) / kChunk;
  }

  if (!metas.empty()) {
    // One upload of the prefix table followed by the segment table. The pinned buffer may be
    // freed as soon as this function returns: a non_blocking copy_ from pinned memory records an
    // event on the current stream with the caching host allocator, which does not reuse the
    // buffer until the copy has run.
    const int64_t n_segments = static_cast<int64_t>(metas.size());
    const int64_t table_bytes = n_segments * static_cast<int64_t>(sizeof(int64_t));
    const int64_t total_bytes =
        table_bytes + n_segments * static_cast<int64_t>(sizeof(SegmentMeta));
    at::Tensor host =
        at::empty({total_bytes}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
    std::memcpy(host.data_ptr(), first_chunk.data(), table_bytes);
    std::memcpy(static_cast<char*>(host.data_ptr()) + table_bytes, metas.data(),
                total_bytes - table_bytes);
    at::Tensor device = at::empty({total_bytes}, flat.options().dtype(at::kByte));
    device.copy_(host, /*non_blocking=*/true);
    const auto* table = reinterpret_cast<const int64_t*>(device.data_ptr());
    // table_bytes is a multiple of 8, and the allocator's blocks are at least 256-byte aligned,
    // so the segment table is aligned for SegmentMeta's int64 fields.
    const auto* segment_table =
        reinterpret_cast<const SegmentMeta*>(static_cast<char*>(device.data_ptr()) + table_bytes);
    // One block per chunk, at most what the device keeps resident; blocks take further chunks
    // in the grid-stride loop.
    dispatch_float(flat.scalar_type(), [&](auto* f_tag) {
      using F = std::remove_pointer_t<decltype(f_tag)>;
      F* flat_ptr = static_cast<F*>(flat.data_ptr());
      if (pack) {
        const unsigned int blocks = grid_size(pack_kernel<F, true>, n_chunks * kThreads);
        pack_kernel<F, true><<<blocks, kThreads, 0, stream>>>(table, segment_table, n_segments,
                                                              n_chunks, flat_ptr);
      } else {
        const unsigned int blocks = grid_size(pack_kernel<F, false>, n_chunks * kThreads);
        pack_kernel<F, false><<<blocks, kThreads, 0, stream>>>(table, segment_table, n_segments,
                                                               n_chunks, flat_ptr);
      }
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  }

  for (const Segment& s : by_aten) {
    const at::Tensor& t = tensors[s.tensor];
    at::Tensor flat_view = flat.narrow(0, s.flat_offset, s.numel).view(t.sizes());
    if (pack) {
      flat_view.copy_(t);
    } else {
      // const_cast: the list is const but its tensors are the op's outputs (Tensor(a!)[]).
      const_cast<at::Tensor&>(t).copy_(flat_view);
    }
  }
}

void pack_cuda(at::TensorList tensors, at::IntArrayRef offsets, at::Tensor flat) {
  const std::vector<Segment> segments = plan_segments(tensors, offsets, flat, "pack");
  // plan_segments has checked that every tensor is on flat's device.
  TORCH_CHECK(flat.is_cuda(), "zerocore.pack (CUDA): flat must be a CUDA tensor, got one on ",
              flat.device());
  run_pack(tensors, flat, segments, /*pack=*/true);
}

void unpack_cuda(const at::Tensor& flat, at::IntArrayRef offsets, at::TensorList tensors) {
  const std::vector<Segment> segments = plan_segments(tensors, offsets, flat, "unpack");
  TORCH_CHECK(flat.is_cuda(), "zerocore.unpack (CUDA): flat must be a CUDA tensor, got one on ",
              flat.device());
  for (size_t i = 0; i < tensors.size(); ++i) {
    // Two threads writing one memory location would race; the CPU kernel's copy_ refuses such
    // outputs too.
    TORCH_CHECK(at::has_internal_overlap(tensors[i]) != at::MemOverlap::Yes,
                "zerocore.unpack: tensors[", i, "] has elements that share memory (e.g. an "
                "expanded tensor), so it cannot be written element by element; pass a tensor "
                "that owns its elements (.clone() it)");
  }
  run_pack(tensors, flat, segments, /*pack=*/false);
}

}  // namespace

TORCH_LIBRARY_IMPL(zerocore, CUDA, m) {
  m.impl("pack", &pack_cuda);
  m.impl("unpack", &unpack_cuda);
}

}  // namespace zerocore::cuda
