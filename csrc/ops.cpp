// The schemas of zerocore's ops, declared once; each backend registers its kernels in its own
// file (cpu/*_cpu.cpp, cuda/*_cuda.cu). Mutated arguments are marked (a!) so torch.compile and
// functionalization know what each op writes.
#include <Python.h>
#include <torch/library.h>

// The module zerocore._C holds no Python functions: importing it runs the registrations below.
extern "C" PyObject* PyInit__C(void) {
  static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module);
}

TORCH_LIBRARY(zerocore, m) {
  // One AdamW/Adam step over a flat fp32 shard, in place, in one pass over memory.
  m.def(
      "fused_adam(Tensor(a!) param, Tensor grad, Tensor(b!) exp_avg, Tensor(c!) exp_avg_sq, "
      "Tensor(d!)? model_copy, float lr, float beta1, float beta2, float eps, "
      "float weight_decay, int step, float inv_grad_scale, bool adamw) -> ()");
  // The same step over many flat shards at once, in one launch: shard i has its own lr[i] and
  // weight_decay[i] (a run of parameters with its own settings is a shard of its own here);
  // model_copies is empty (no copies) or one per shard. Every grad has one dtype, every model
  // copy one dtype, all on one device. Each shard's elements compute the same bits as
  // fused_adam on that shard alone.
  m.def(
      "fused_adam_multi(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, "
      "Tensor(c!)[] exp_avg_sqs, Tensor(d!)[] model_copies, float[] lrs, float[] weight_decays, "
      "float beta1, float beta2, float eps, int step, float inv_grad_scale, bool adamw) -> ()");
  // stats[0] += sum(grad^2); stats[1] = 1 if any element of grad is inf or nan.
  m.def("grad_stats(Tensor grad, Tensor(a!) stats) -> ()");
  // flat[offsets[i] : offsets[i] + tensors[i].numel()] = tensors[i].flatten(); the rest of flat
  // (the padding) = 0.
  m.def("pack(Tensor[] tensors, int[] offsets, Tensor(a!) flat) -> ()");
  // tensors[i] = flat[offsets[i] : offsets[i] + tensors[i].numel()].view_as(tensors[i]).
  m.def("unpack(Tensor flat, int[] offsets, Tensor(a!)[] tensors) -> ()");
  // Symmetric int8 quantization by blocks of `block` consecutive elements of x (1-D, a multiple
  // of block long): scales[b] = absmax of block b / 127 in fp32; q = x / scales[b] rounded half to
  // even, clamped to [-127, 127]; q = 0 where the scale is 0. Raises if x holds an inf or nan.
  m.def("quantize_blockwise(Tensor x, int block) -> (Tensor q, Tensor scales)");
  // out[i] = q[i] * scales[i // block], multiplied in fp32 and rounded once to out's dtype. out
  // may be a slice of a larger buffer at any offset.
  m.def("dequantize_blockwise_(Tensor(a!) out, Tensor q, Tensor scales, int block) -> ()");
  // The low-bit formats of zerocore/kernels/formats.py, n = out.numel() elements of any count,
  // scales[b] (fp32) for elements [b * block, (b + 1) * block), block a multiple of 32:
  // out[i] = value(code i) * scales[i // block], multiplied in fp32 and rounded once to out's
  // dtype. NF4: code i is the low nibble of packed[i // 2] for an even i, the high one for an odd
  // i, and its value QLoRA's NormalFloat4 table entry. fp8: code i is codes[i], the bits of an
  // e4m3fn number (its NaN codes give NaN).
  m.def("dequantize_nf4_(Tensor(a!) out, Tensor packed, Tensor scales, int block) -> ()");
  m.def("dequantize_fp8_(Tensor(a!) out, Tensor codes, Tensor scales, int block) -> ()");
}
