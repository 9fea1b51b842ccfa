// Declarations shared by the op registrations and the CPU and CUDA kernels of zerocore._C.
//
// Every op validates its arguments once, here (checks.cpp), before any backend touches memory, so
// the CPU and CUDA kernels may assume well-formed inputs and both report the same errors.
#pragma once

// The Tensor class alone, not ATen/ATen.h: every .cu file includes this header, and nvcc's
// front ends parse each header twice (host and device); ATen.h's thousands of op declarations
// took 8 of a .cu file's 35 s of CPU (measured 2026-12-07). The CPU sources include ATen.h
// themselves.
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace zerocore {

// Scalars of one Adam/AdamW step, precomputed on the host in double precision exactly as
// torch.optim.Adam computes them in Python, then narrowed to float for the kernels.
struct AdamConsts {
  float lr;
  float beta1, one_minus_beta1;
  float beta2, one_minus_beta2;
  float eps;
  float weight_decay;      // L2 term added to the gradient (Adam); 0 for AdamW
  float decay_factor;      // 1 - lr * weight_decay for AdamW (decoupled decay); 1 for Adam
  float step_size;         // lr / (1 - beta1^step)
  float bias_correction2_sqrt;  // sqrt(1 - beta2^step)
  float inv_grad_scale;    // multiplies the gradient before use: 1 / (loss_scale * clip)
};

// Validates the arguments of zerocore::fused_adam (naming the offending one) and returns the
// step's scalars.
AdamConsts check_fused_adam(const at::Tensor& param, const at::Tensor& grad,
                            const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq,
                            const c10::optional<at::Tensor>& model_copy, double lr, double beta1,
                            double beta2, double eps, double weight_decay, int64_t step,
                            double inv_grad_scale, bool adamw);

// Validates the arguments of zerocore::fused_adam_multi (every shard as fused_adam would, and
// that the lists agree in length, device and dtypes) and returns each shard's scalars.
std::vector<AdamConsts> check_fused_adam_multi(
    at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
    at::TensorList exp_avg_sqs, at::TensorList model_copies, at::ArrayRef<double> lrs,
    at::ArrayRef<double> weight_decays, double beta1, double beta2, double eps, int64_t step,
    double inv_grad_scale, bool adamw);

void check_grad_stats(const at::Tensor& grad, const at::Tensor& stats);

// One stretch of a flat buffer written by pack (or read by unpack): either a copy to/from
// tensors[tensor], or, when tensor == -1, padding that pack fills with zeros.
struct Segment {
  int64_t tensor;       // index into the tensor list, or -1 for padding
  int64_t flat_offset;  // first element in the flat buffer
  int64_t numel;
};

// Validates the arguments of pack/unpack (offsets in range, no two tensors overlapping, same
// device, supported dtypes) and returns the segments that cover the flat buffer from element 0 to
// its end, in order, padding included.
std::vector<Segment> plan_segments(at::TensorList tensors, at::IntArrayRef offsets,
                                   const at::Tensor& flat, const char* op_name);

// Validates the arguments of zerocore::quantize_blockwise (x: a contiguous 1-D float32, float16 or
// bfloat16 tensor whose length is a multiple of block >= 1).
void check_quantize_blockwise(const at::Tensor& x, int64_t block);

// After a quantize_blockwise kernel: raises, naming the first offending block, if a block of x
// held an inf or nan. The kernels take each block's absmax with a max that propagates NaN, so such
// a block, and only such a block, is left with a non-finite scale. On CUDA this reads one flag
// back to the host (a synchronisation): quantizing is a one-off preparation of frozen weights.
void check_quantized_finite(const at::Tensor& scales, int64_t block);

// Validates the arguments of zerocore::dequantize_blockwise_ (out: contiguous, float32, float16 or
// bfloat16, as many elements as q; q: contiguous 1-D int8; scales: contiguous 1-D float32, one per
// block; all on one device).
void check_dequantize_blockwise(const at::Tensor& out, const at::Tensor& q,
                                const at::Tensor& scales, int64_t block);

// Validates the arguments of zerocore::dequantize_nf4_ / dequantize_fp8_ (op names which):
// out contiguous, float32, float16 or bfloat16, of n elements; q contiguous 1-D uint8 holding the
// n codes of `bits` bits each (ceil(n * bits / 8) bytes); scales contiguous 1-D float32 with one
// per block of `block` elements (ceil(n / block)), block a positive multiple of 32; one device.
void check_dequantize_lowbit(const at::Tensor& out, const at::Tensor& q, const at::Tensor& scales,
                             int64_t block, const char* op, int64_t bits);

inline bool is_supported_float(at::ScalarType t) {
  return t == at::kFloat || t == at::kHalf || t == at::kBFloat16;
}

}  // namespace zerocore
