// Argument validation shared by the CPU and CUDA implementations of every zerocore op.
#include <ATen/ATen.h>
#include "zerocore.h"

#include <algorithm>
#include <cmath>
#include <numeric>

namespace zerocore {

namespace {

void check_flat_like(const at::Tensor& t, const char* name, const at::Tensor& param) {
  TORCH_CHECK(t.device() == param.device(), "zerocore.fused_adam: ", name, " is on ", t.device(),
              " but param is on ", param.device(), "; move all arguments to one device");
  TORCH_CHECK(t.numel() == param.numel(), "zerocore.fused_adam: ", name, " has ", t.numel(),
              " elements but param has ", param.numel(), "; all shards of one step must match");
  TORCH_CHECK(t.is_contiguous(), "zerocore.fused_adam: ", name,
              " must be contiguous (a flat shard); call .contiguous() first");
}

}  // namespace

AdamConsts check_fused_adam(const at::Tensor& param, const at::Tensor& grad,
                            const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq,
                            const c10::optional<at::Tensor>& model_copy, double lr, double beta1,
                            double beta2, double eps, double weight_decay, int64_t step,
                            double inv_grad_scale, bool adamw) {
  TORCH_CHECK(param.scalar_type() == at::kFloat,
              "zerocore.fused_adam: param (the master weights) must be float32, got ",
              param.scalar_type());
  TORCH_CHECK(param.is_contiguous(), "zerocore.fused_adam: param must be contiguous");
  TORCH_CHECK(is_supported_float(grad.scalar_type()),
              "zerocore.fused_adam: grad must be float32, float16 or bfloat16, got ",
              grad.scalar_type());
  TORCH_CHECK(exp_avg.scalar_type() == at::kFloat,
              "zerocore.fused_adam: exp_avg must be float32, got ", exp_avg.scalar_type());
  TORCH_CHECK(exp_avg_sq.scalar_type() == at::kFloat,
              "zerocore.fused_adam: exp_avg_sq must be float32, got ", exp_avg_sq.scalar_type());
  check_flat_like(grad, "grad", param);
  check_flat_like(exp_avg, "exp_avg", param);
  check_flat_like(exp_avg_sq, "exp_avg_sq", param);
  if (model_copy.has_value()) {
    TORCH_CHECK(is_supported_float(model_copy->scalar_type()),
                "zerocore.fused_adam: model_copy must be float32, float16 or bfloat16, got ",
                model_copy->scalar_type());
    check_flat_like(*model_copy, "model_copy", param);
  }
  TORCH_CHECK(step >= 1, "zerocore.fused_adam: step must be >= 1 (the count including this "
              "step), got ", step);
  TORCH_CHECK(lr >= 0.0, "zerocore.fused_adam: lr must be >= 0, got ", lr);
  TORCH_CHECK(beta1 >= 0.0 && beta1 < 1.0, "zerocore.fused_adam: beta1 must be in [0, 1), got ",
              beta1);
  TORCH_CHECK(beta2 >= 0.0 && beta2 < 1.0, "zerocore.fused_adam: beta2 must be in [0, 1), got ",
              beta2);
  TORCH_CHECK(eps >= 0.0, "zerocore.fused_adam: eps must be >= 0, got ", eps);
  TORCH_CHECK(weight_decay >= 0.0, "zerocore.fused_adam: weight_decay must be >= 0, got ",
              weight_decay);
  TORCH_CHECK(std::isfinite(inv_grad_scale),
              "zerocore.fused_adam: inv_grad_scale must be finite, got ", inv_grad_scale);

  // Same order of operations as torch.optim.adam._single_tensor_adam, in double.
  const double bias_correction1 = 1.0 - std::pow(beta1, static_cast<double>(step));
  const double bias_correction2 = 1.0 - std::pow(beta2, static_cast<double>(step));
  AdamConsts c;
  c.lr = static_cast<float>(lr);
  c.beta1 = static_cast<float>(beta1);
  c.one_minus_beta1 = static_cast<float>(1.0 - beta1);
  c.beta2 = static_cast<float>(beta2);
  c.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  c.eps = static_cast<float>(eps);
  c.weight_decay = adamw ? 0.0f : static_cast<float>(weight_decay);
  c.decay_factor = adamw ? static_cast<float>(1.0 - lr * weight_decay) : 1.0f;
  c.step_size = static_cast<float>(lr / bias_correction1);
  c.bias_correction2_sqrt = static_cast<float>(std::sqrt(bias_correction2));
  c.inv_grad_scale = static_cast<float>(inv_grad_scale);
  return c;
}

std::vector<AdamConsts> check_fused_adam_multi(
    at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
    at::TensorList exp_avg_sqs, at::TensorList model_copies, at::ArrayRef<double> lrs,
    at::ArrayRef<double> weight_decays, double beta1, double beta2, double eps, int64_t step,
    double inv_grad_scale, bool adamw) {
  const size_t n = params.size();
  TORCH_CHECK(grads.size() == n && exp_avgs.size() == n && exp_avg_sqs.size() == n &&
                  lrs.size() == n && weight_decays.size() == n,
              "zerocore.fused_adam_multi: params, grads, exp_avgs, exp_avg_sqs, lrs and "
              "weight_decays must have one entry per shard (", n, " params, ", grads.size(),
              " grads, ", exp_avgs.size(), " exp_avgs, ", exp_avg_sqs.size(), " exp_avg_sqs, ",
              lrs.size(), " lrs, ", weight_decays.size(), " weight_decays)");
  TORCH_CHECK(model_copies.empty() || model_copies.size() == n,
              "zerocore.fused_adam_multi: model_copies must be empty or have one entry per "
              "shard, got ", model_copies.size(), " for ", n, " shards");
  std::vector<AdamConsts> consts;
  consts.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    const c10::optional<at::Tensor> copy =
        model_copies.empty() ? c10::nullopt : c10::optional<at::Tensor>(model_copies[i]);
    consts.push_back(check_fused_adam(params[i], grads[i], exp_avgs[i], exp_avg_sqs[i], copy,
                                      lrs[i], beta1, beta2, eps, weight_decays[i], step,
                                      inv_grad_scale, adamw));
    // check_fused_adam checked each shard's tensors against its own param; one launch also
    // needs every shard on one device, one gradient dtype and one model-copy dtype.
    TORCH_CHECK(params[i].device() == params[0].device(),
                "zerocore.fused_adam_multi: every shard must be on one device; shard ", i,
                " is on ", params[i].device(), ", shard 0 on ", params[0].device());
    TORCH_CHECK(grads[i].scalar_type() == grads[0].scalar_type(),
                "zerocore.fused_adam_multi: every grad must have one dtype; grad ", i, " is ",
                grads[i].scalar_type(), ", grad 0 ", grads[0].scalar_type());
    TORCH_CHECK(!copy.has_value() || copy->scalar_type() == model_copies[0].scalar_type(),
                "zerocore.fused_adam_multi: every model copy must have one dtype; copy ", i,
                " is ", copy->scalar_type(), ", copy 0 ", model_copies[0].scalar_type());
  }
  return consts;
}

void check_grad_stats(const at::Tensor& grad, const at::Tensor& stats) {
  TORCH_CHECK(is_supported_float(grad.scalar_type()),
              "zerocore.grad_stats: grad must be float32, float16 or bfloat16, got ",
              grad.scalar_type());
  TORCH_CHECK(grad.is_contiguous(), "zerocore.grad_stats: grad must be contiguous");
  TORCH_CHECK(stats.scalar_type() == at::kFloat && stats.dim() == 1 && stats.numel() == 2,
              "zerocore.grad_stats: stats must be a float32 tensor of shape [2] "
              "(sum of squares, non-finite flag), got ", stats.scalar_type(), " ", stats.sizes());
  TORCH_CHECK(stats.device() == grad.device(), "zerocore.grad_stats: stats is on ",
              stats.device(), " but grad is on ", grad.device());
}

std::vector<Segment> plan_segments(at::TensorList tensors, at::IntArrayRef offsets,
                                   const at::Tensor& flat, const char* op_name) {
  TORCH_CHECK(tensors.size() == offsets.size(), "zerocore.", op_name, ": got ", tensors.size(),
              " tensors but ", offsets.size(), " offsets; pass one offset per tensor");
  TORCH_CHECK(is_supported_float(flat.scalar_type()), "zerocore.", op_name,
              ": flat must be float32, float16 or bfloat16, got ", flat.scalar_type());
  TORCH_CHECK(flat.dim() == 1 && flat.is_contiguous(), "zerocore.", op_name,
              ": flat must be a contiguous 1-D tensor, got shape ", flat.sizes());
  const int64_t flat_numel = flat.numel();
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    TORCH_CHECK(is_supported_float(t.scalar_type()), "zerocore.", op_name, ": tensors[", i,
                "] must be float32, float16 or bfloat16, got ", t.scalar_type());
    TORCH_CHECK(t.device() == flat.device(), "zerocore.", op_name, ": tensors[", i, "] is on ",
                t.device(), " but flat is on ", flat.device());
    TORCH_CHECK(offsets[i] >= 0 && offsets[i] + t.numel() <= flat_numel, "zerocore.", op_name,
                ": tensors[", i, "] (", t.numel(), " elements at offset ", offsets[i],
                ") does not fit in flat (", flat_numel, " elements)");
  }
  std::vector<int64_t> order(tensors.size());
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(),
            [&](int64_t a, int64_t b) { return offsets[a] < offsets[b]; });
  std::vector<Segment> segments;
  segments.reserve(2 * tensors.size() + 1);
  int64_t cursor = 0;
  for (int64_t i : order) {
    const int64_t start = offsets[i];
    const int64_t n = tensors[i].numel();
    if (n == 0) continue;
    TORCH_CHECK(start >= cursor, "zerocore.", op_name, ": tensors[", i, "] at offset ", start,
                " overlaps the tensor before it, which ends at ", cursor,
                "; offsets must give disjoint ranges");
    if (start > cursor) segments.push_back({-1, cursor, start - cursor});
    segments.push_back({i, start, n});
    cursor = start + n;
  }
  if (cursor < flat_numel) segments.push_back({-1, cursor, flat_numel - cursor});
  return segments;
}

void check_quantize_blockwise(const at::Tensor& x, int64_t block) {
  TORCH_CHECK(is_supported_float(x.scalar_type()),
              "zerocore.quantize_blockwise: x must be float32, float16 or bfloat16, got ",
              x.scalar_type());
  TORCH_CHECK(x.dim() == 1 && x.is_contiguous(),
              "zerocore.quantize_blockwise: x must be a contiguous 1-D tensor, got shape ",
              x.sizes(), "; flatten it (.reshape(-1)) first");
  TORCH_CHECK(block >= 1, "zerocore.quantize_blockwise: block must be >= 1, got ", block);
  TORCH_CHECK(x.numel() % block == 0, "zerocore.quantize_blockwise: x has ", x.numel(),
              " elements, not a multiple of block = ", block, "; pad x to a multiple of block");
}

void check_quantized_finite(const at::Tensor& scales, int64_t block) {
  const at::Tensor bad = at::logical_not(at::isfinite(scales));
  if (!bad.any().item<bool>()) return;
  const int64_t b = bad.nonzero()[0][0].item<int64_t>();
  TORCH_CHECK(false, "zerocore.quantize_blockwise: x has an inf or nan in block ", b,
              " (elements ", b * block, " to ", (b + 1) * block - 1,
              "); a non-finite weight cannot be quantized, so fix or replace it first");
}

void check_dequantize_blockwise(const at::Tensor& out, const at::Tensor& q,
                                const at::Tensor& scales, int64_t block) {
  TORCH_CHECK(is_supported_float(out.scalar_type()),
              "zerocore.dequantize_blockwise_: out must be float32, float16 or bfloat16, got ",
              out.scalar_type());
  TORCH_CHECK(out.is_contiguous(), "zerocore.dequantize_blockwise_: out must be contiguous (a "
              "slice of a flat buffer, say), got strides ", out.strides());
  TORCH_CHECK(q.scalar_type() == at::kChar, "zerocore.dequantize_blockwise_: q must be int8, got ",
              q.scalar_type());
  TORCH_CHECK(q.dim() == 1 && q.is_contiguous(),
              "zerocore.dequantize_blockwise_: q must be a contiguous 1-D tensor, got shape ",
              q.sizes());
  TORCH_CHECK(scales.scalar_type() == at::kFloat,
              "zerocore.dequantize_blockwise_: scales must be float32, got ", scales.scalar_type());
  TORCH_CHECK(scales.dim() == 1 && scales.is_contiguous(),
              "zerocore.dequantize_blockwise_: scales must be a contiguous 1-D tensor, got shape ",
              scales.sizes());
  TORCH_CHECK(block >= 1, "zerocore.dequantize_blockwise_: block must be >= 1, got ", block);
  TORCH_CHECK(q.numel() % block == 0, "zerocore.dequantize_blockwise_: q has ", q.numel(),
              " elements, not a multiple of block = ", block);
  TORCH_CHECK(scales.numel() == q.numel() / block, "zerocore.dequantize_blockwise_: scales has ",
              scales.numel(), " elements but q has ", q.numel() / block, " blocks of ", block,
              "; pass one scale per block");
  TORCH_CHECK(out.numel() == q.numel(), "zerocore.dequantize_blockwise_: out has ", out.numel(),
              " elements but q has ", q.numel(), "; they must match one to one");
  TORCH_CHECK(q.device() == out.device(), "zerocore.dequantize_blockwise_: q is on ", q.device(),
              " but out is on ", out.device(), "; move all arguments to one device");
  TORCH_CHECK(scales.device() == out.device(), "zerocore.dequantize_blockwise_: scales is on ",
              scales.device(), " but out is on ", out.device(),
              "; move all arguments to one device");
}

void check_dequantize_lowbit(const at::Tensor& out, const at::Tensor& q, const at::Tensor& scales,
                             int64_t block, const char* op, int64_t bits) {
  TORCH_CHECK(is_supported_float(out.scalar_type()), "zerocore.", op,
              ": out must be float32, float16 or bfloat16, got ", out.scalar_type());
  TORCH_CHECK(out.is_contiguous(), "zerocore.", op, ": out must be contiguous (a slice of a flat "
              "buffer, say), got strides ", out.strides());
  TORCH_CHECK(q.scalar_type() == at::kByte, "zerocore.", op, ": the codes must be uint8, got ",
              q.scalar_type());
  TORCH_CHECK(q.dim() == 1 && q.is_contiguous(), "zerocore.", op,
              ": the codes must be a contiguous 1-D tensor, got shape ", q.sizes());
  TORCH_CHECK(scales.scalar_type() == at::kFloat, "zerocore.", op,
              ": scales must be float32, got ", scales.scalar_type());
  TORCH_CHECK(scales.dim() == 1 && scales.is_contiguous(), "zerocore.", op,
              ": scales must be a contiguous 1-D tensor, got shape ", scales.sizes());
  TORCH_CHECK(block >= 32 && block % 32 == 0, "zerocore.", op,
              ": block must be a positive multiple of 32, got ", block);
  const int64_t n = out.numel();
  const int64_t want_bytes = (n * bits + 7) / 8;
  TORCH_CHECK(q.numel() == want_bytes, "zerocore.", op, ": out has ", n, " elements, which take ",
              want_bytes, " bytes of ", bits, "-bit codes, but the codes have ", q.numel());
  const int64_t want_scales = (n + block - 1) / block;
  TORCH_CHECK(scales.numel() == want_scales, "zerocore.", op, ": out has ", n, " elements in ",
              want_scales, " blocks of ", block, " but scales has ", scales.numel(),
              "; pass one scale per block");
  TORCH_CHECK(q.device() == out.device(), "zerocore.", op, ": the codes are on ", q.device(),
              " but out is on ", out.device(), "; move all arguments to one device");
  TORCH_CHECK(scales.device() == out.device(), "zerocore.", op, ": scales is on ",
              scales.device(), " but out is on ", out.device(),
              "; move all arguments to one device");
}

}  // namespace zerocore
