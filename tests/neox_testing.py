"""Shared by the neox test files: a transformers GPT-NeoX with every parameter random, and the
test data."""

import os
from pathlib import Path

import pytest
import torch

import neox.data


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


# -- test data --------------------------------------------------------------------------------------
# What lives in the repository (tests/data/README.md): enough for every test to run on a fresh
# clone without ../shared and without network.
DATA = Path(__file__).resolve().parent / "data"
EXCERPT = DATA / "shakespeare_excerpt.txt"   # 39,908 bytes of tiny_shakespeare
BPE512 = DATA / "bpe512.json"                # a byte-level BPE of 512 tokens trained on it

# The big shared files, when present: the full corpus and the GPT-NeoX-20B tokenizer. CI hides
# them (NEOX_DATA_DIR pointing nowhere) for the main run, to prove the suite stands alone, and
# runs the tests marked shared_data separately with them visible.
SHARED_DATA_DIR = Path(os.environ.get("NEOX_DATA_DIR") or neox.data.default_data_dir())
SHAKESPEARE = SHARED_DATA_DIR / "tiny_shakespeare.txt"
NEOX_TOKENIZER = SHARED_DATA_DIR / "gpt-neox-20b-tokenizer.json"
shared_data = [pytest.mark.shared_data, pytest.mark.skipif(
    not (SHAKESPEARE.is_file() and NEOX_TOKENIZER.is_file()),
    reason=f"shared test data not found in {SHARED_DATA_DIR}")]


def with_shared_data(fn):
    """Marks a test that needs the shared data (and skips it when absent)."""
    for mark in shared_data:
        fn = mark(fn)
    return fn
