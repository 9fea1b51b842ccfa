"""Shared by the neox test files: a transformers GPT-NeoX with every parameter random."""

import torch


def random_hf_model(transformers, seed: int = 0, **config):
    """A GPTNeoXForCausalLM in eval mode, weights N(0, 0.2) and layer-norm gains around 1 (so
    that every parameter matters to the logits), built from ``config`` (GPTNeoXConfig keys)."""
    torch.manual_seed(seed)
    model = transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(**config)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layernorm.weight" in name or "layer_norm.weight" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.2)
    return model
