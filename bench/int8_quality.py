"""How much int8 frozen weights (``zerocore.FrozenWeights("int8")``) change a GPT-NeoX's output:
a transformers-initialised ``GPTNeoXForCausalLM`` (Pythia-70M's shape by default, random
weights: no pretrained ones are available offline) with every parameter quantized as zerocore
quantizes frozen groups — each parameter on its own blocks (zero-padded to whole blocks),
symmetric absmax, int8 values, a scale per block — against the unquantized model, in fp32, on
the same tokens. For blocks of 64, 128 and 256 and fp32 or bf16 scales, and, for scale, the
model with its weights merely rounded to bf16 (what a bf16 run computes with anyway).

Reported: the largest and the mean absolute logit error, the mean error relative to the mean
absolute logit, the KL divergence of the next-token distributions (nats per token) and how often
the most likely next token is the same. The quantization itself is zerocore's CPU kernel
(``zerocore.ops``), exact against ``zerocore.reference`` (tests/kernels/test_quant_ops.py).

    python bench/int8_quality.py
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import harness

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def quantized_copy(model: torch.nn.Module, block: int, bf16_scales: bool) -> dict:
    import zerocore
    state = {}
    for name, p in model.state_dict().items():
        if not p.is_floating_point():
            state[name] = p
            continue
        flat = p.detach().float().reshape(-1)
        padded = torch.zeros((flat.numel() + block - 1) // block * block)
        padded[:flat.numel()] = flat
        q, scales = zerocore.ops.quantize_blockwise(padded, block)
        if bf16_scales:
            scales = scales.to(torch.bfloat16).float()
        values = zerocore.ops.dequantize_blockwise(q, scales, block, torch.float32)
        state[name] = values[:flat.numel()].view(p.shape)
    return state


def compare(ref: torch.Tensor, got: torch.Tensor) -> dict:
    err = (got - ref).abs()
    logp_ref, logp = F.log_softmax(ref, -1), F.log_softmax(got, -1)
    kl = (logp_ref.exp() * (logp_ref - logp)).sum(-1).mean()
    return {"max": err.max().item(), "mean": err.mean().item(),
            "relative": (err.mean() / ref.abs().mean()).item(), "kl": kl.item(),
            "top1": (ref.argmax(-1) == got.argmax(-1)).float().mean().item()}


def main() -> int:
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--tokens", type=int, default=512)
    args = p.parse_args()
    torch.manual_seed(0)
    config = GPTNeoXConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                           num_hidden_layers=args.layers, num_attention_heads=args.heads,
                           intermediate_size=4 * args.hidden, max_position_embeddings=2048)
    model = GPTNeoXForCausalLM(config).eval()
    ids = torch.randint(0, args.vocab, (1, args.tokens))
    with torch.no_grad():
        ref = model(ids).logits.float()
        original = {k: v.clone() for k, v in model.state_dict().items()}
        rows = []
        model.load_state_dict({k: v.to(torch.bfloat16).float() if v.is_floating_point() else v
                               for k, v in original.items()})
        rows.append(("weights rounded to bf16 (no int8)", compare(ref, model(ids).logits)))
        for block in (64, 128, 256):
            for bf16_scales in (False, True):
                model.load_state_dict(quantized_copy(_with(model, original), block, bf16_scales))
                rows.append((f"int8, block {block}, {'bf16' if bf16_scales else 'fp32'} scales",
                             compare(ref, model(ids).logits)))
    params = sum(v.numel() for v in original.values() if v.is_floating_point())
    print(harness.header(f"GPTNeoXForCausalLM from transformers' initialisation (hidden "
                         f"{args.hidden}, {args.layers} layers, vocabulary {args.vocab}: "
                         f"{params:,} parameters, all quantized), {args.tokens} random tokens, "
                         f"fp32 logits; mean |logit| {ref.abs().mean().item():.4f}",
                         packages=("torch", "transformers")))
    print(harness.table(("weights", "max abs logit error", "mean abs error",
                         "mean error / mean abs logit", "KL (nats/token)", "same top-1 token"),
                        [(name, f"{r['max']:.2e}", f"{r['mean']:.2e}", f"{r['relative']:.2e}",
                          f"{r['kl']:.2e}", f"{r['top1'] * 100:.1f}%") for name, r in rows],
                        "lrrrrr"))
    return 0


def _with(model: torch.nn.Module, state: dict) -> torch.nn.Module:
    model.load_state_dict(state)
    return model


if __name__ == "__main__":
    sys.exit(main())
