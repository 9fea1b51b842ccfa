"""Tiny ``transformers`` causal LMs for the shard_model tests and benchmark: GPT-NeoX, Llama and
GPT-2 (with ``tie_word_embeddings``), Qwen2 and two mixtures of experts from small configs, and
what each training mode trains.

Dropout is 0 so that the sharded and the reference runs compute the same function; attention is
the eager implementation (no backend choosing kernels by shape).
"""

from __future__ import annotations

import torch
from peft import LoraConfig, get_peft_model
from torch import nn
from transformers import (GPT2Config, GPT2LMHeadModel, GPTNeoXConfig, GPTNeoXForCausalLM,
                          LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM,
                          Qwen2Config, Qwen2ForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM)

VOCAB = 96
SEQ = 12


def build(arch: str, seed: int = 0) -> nn.Module:
    """A freshly initialised tiny model, the same on every rank for the same seed."""
    torch.manual_seed(seed)
    if arch == "neox":
        config = GPTNeoXConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                               num_attention_heads=4, intermediate_size=64,
                               max_position_embeddings=64, hidden_dropout=0.0,
                               attention_dropout=0.0, use_parallel_residual=True,
                               tie_word_embeddings=False, attn_implementation="eager",
                               # No attention biases: a key bias adds the same q·b to every
                               # score of a query, which softmax cancels, so its exact gradient
                               # is 0 and the computed one rounding noise, whose sign Adam
                               # turns into ±lr steps no two summation orders agree on
                               # (tests/support/toy_stack.py's Block has none for that reason).
                               attention_bias=False)
        return GPTNeoXForCausalLM(config)
    if arch == "llama":
        config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
                             max_position_embeddings=64, tie_word_embeddings=True,
                             attn_implementation="eager")
        return LlamaForCausalLM(config)
    if arch == "qwen2":  # attention biases on q, k, v; untied head
        config = Qwen2Config(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
                             max_position_embeddings=64, tie_word_embeddings=False,
                             attn_implementation="eager")
        return Qwen2ForCausalLM(config)
    if arch == "gpt2":  # Conv1D layers, learned positions, the head tied to the embedding
        config = GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                            tie_word_embeddings=True, attn_implementation="eager")
        return GPT2LMHeadModel(config)
    # Mixture-of-experts models, whose experts are 3-D parameters (experts x out x in) of one
    # module: what LoraConfig(target_parameters=...) adapts.
    if arch == "mixtral":
        config = MixtralConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2,
                               intermediate_size=48, num_local_experts=4, num_experts_per_tok=2,
                               max_position_embeddings=64, tie_word_embeddings=False,
                               attn_implementation="eager")
        return MixtralForCausalLM(config)
    if arch == "qwen2moe":
        config = Qwen2MoeConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2,
                                intermediate_size=64, moe_intermediate_size=24, num_experts=4,
                                num_experts_per_tok=2, shared_expert_intermediate_size=32,
                                max_position_embeddings=64, tie_word_embeddings=False,
                                attn_implementation="eager")
        return Qwen2MoeForCausalLM(config)
    raise ValueError(arch)


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers of a model from ``build``, PEFT-wrapped or not."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    if hasattr(inner, "transformer"):  # GPT-2
        return inner.transformer.h
    return inner.gpt_neox.layers if hasattr(inner, "gpt_neox") else inner.model.layers


def prepare(model: nn.Module, mode: str) -> nn.Module:
    """The model to train in ``mode``:
    full: every parameter; lora: PEFT LoRA adapters (r 4) on the attention and MLP projections,
    the rest frozen; lora-experts (MoE models): LoRA on the query and value projections and on
    the experts' 3-D weights (``target_parameters``); biases: biases only (GPT-NeoX); norms: the
    norm weights and the tied embedding only (Llama, which has no biases: trainable parameters in
    the root unit, one of them tied to the head, and in every decoder layer)."""
    if mode == "full":
        return model
    if mode in ("lora", "lora-experts"):
        targets = (["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"]
                   if isinstance(model, GPTNeoXForCausalLM)
                   else ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                         "down_proj"])
        extra = {}
        if mode == "lora-experts":
            # PEFT's way to adapt 3-D expert weights: LoRA on the parameters themselves,
            # parametrized around every forward; attention's projections as modules.
            targets = ["q_proj", "v_proj"]
            extra["target_parameters"] = ["experts.gate_up_proj", "experts.down_proj"]
        peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                      target_modules=targets, **extra))
        # LoRA's B starts at 0, so the adapters' first gradients reach B only; a seeded
        # non-zero B makes every adapter parameter move from the first step.
        torch.manual_seed(1)
        with torch.no_grad():
            for name, p in peft_model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0.0, 0.02)
        return peft_model
    for name, p in model.named_parameters():
        if mode == "biases":
            p.requires_grad_(name.endswith("bias"))
        elif mode == "norms":
            p.requires_grad_("norm" in name or "embed_tokens" in name)
        else:
            raise ValueError(mode)
    return model


def batch(step: int, rows: int) -> torch.Tensor:
    """Token ids (rows, SEQ) of a learnable rule (each token a fixed function of the one
    before), the same on every rank for the same step."""
    g = torch.Generator().manual_seed(1000 + step)
    start = torch.randint(0, VOCAB, (rows, 1), generator=g)
    return (start * 7 + 5 * torch.arange(SEQ)) % VOCAB
