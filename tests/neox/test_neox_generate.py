"""Generation with a key/value cache equals recomputing the whole sequence, and the CLIs of
evaluate and generate run on a preset and on a saved checkpoint."""

import json

import pytest
import torch

import neox
from neox import evaluate
from neox.run.sampling import generate
from neox.generate import main as generate_main
from neox.model import NeoXModel
from tests.support.neox_testing import BPE512, call_main

CONFIG = neox.NeoXConfig(vocab_size=97, hidden_size=48, num_hidden_layers=3,
                         num_attention_heads=4, intermediate_size=96, rotary_pct=0.5)


def tiny_model(parallel: bool = True) -> NeoXModel:
    import dataclasses
    cfg = dataclasses.replace(CONFIG, use_parallel_residual=parallel)
    return NeoXModel(cfg, neox.build_layers(cfg, generator=torch.Generator().manual_seed(0)),
                     ).eval()


@pytest.mark.parametrize("parallel", [True, False])
def test_cached_forward_equals_full_forward(parallel):
    model = tiny_model(parallel)
    ids = torch.randint(0, CONFIG.vocab_size, (2, 11), generator=torch.Generator().manual_seed(1))
    full = model(ids)
    caches = model.new_caches()
    # A prompt of 5, then chunks of 1 and 5 tokens: the mask for T > 1 with a past is the
    # delicate case.
    parts = [model.forward_cached(ids[:, :5], caches), model.forward_cached(ids[:, 5:6], caches),
             model.forward_cached(ids[:, 6:], caches)]
    # fp32, same ops on the same values; attention over a longer key set sums in another order.
    torch.testing.assert_close(torch.cat(parts, dim=1), full, rtol=1e-5, atol=1e-5)
    assert caches[0].length == 11


def test_greedy_generation_equals_recomputation():
    model = tiny_model()
    prompt = torch.tensor([[3, 14, 15, 92]])
    out = generate(model, prompt, max_new_tokens=8)
    expected = prompt
    with torch.no_grad():
        for _ in range(8):
            nxt = model(expected)[:, -1].argmax(-1, keepdim=True)
            expected = torch.cat((expected, nxt), dim=1)
    assert torch.equal(out, expected)


def test_sampling_is_seeded_and_respects_top_k():
    model = tiny_model()
    prompt = torch.tensor([[1, 2, 3]])
    a = generate(model, prompt, max_new_tokens=6, temperature=1.0, top_k=1,
                 generator=torch.Generator().manual_seed(0))
    greedy = generate(model, prompt, max_new_tokens=6)
    assert torch.equal(a, greedy)  # top-1 sampling is greedy
    b = generate(model, prompt, max_new_tokens=6, temperature=2.0,
                 generator=torch.Generator().manual_seed(5))
    c = generate(model, prompt, max_new_tokens=6, temperature=2.0,
                 generator=torch.Generator().manual_seed(5))
    assert torch.equal(b, c)


def test_cli_on_a_saved_checkpoint(tmp_path, capsys):
    import dataclasses
    cfg = dataclasses.replace(CONFIG, vocab_size=512)  # the test tokenizer's 512 ids
    big = NeoXModel(cfg, neox.build_layers(cfg, generator=torch.Generator().manual_seed(0)))
    neox.save_hf(tmp_path / "m", cfg, neox.iter_layer_states(big), extra_files={
        "tokenizer.json": BPE512})
    text = tmp_path / "t.txt"
    text.write_text("To be, or not to be, that is the question. " * 40)
    r = call_main(evaluate.main, capsys, text, "--checkpoint", tmp_path / "m", "--seq-len", 16,
                  "--json")
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert result["windows"] > 5 and result["perplexity"] > 1
    r = call_main(generate_main, capsys, "--checkpoint", tmp_path / "m", "--prompt", "To be",
                  "--max-new-tokens", 5)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("To be")


def test_cli_errors_are_one_line(tmp_path, capsys):
    r = call_main(evaluate.main, capsys, tmp_path / "missing.txt", "--max-windows", 1)
    assert r.returncode == 2 and "Traceback" not in r.stderr and "missing.txt" in r.stderr
    r = call_main(generate_main, capsys, "--checkpoint", tmp_path / "nope")
    assert r.returncode == 2 and "Traceback" not in r.stderr and "nope" in r.stderr
