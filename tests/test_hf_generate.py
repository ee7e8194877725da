"""``kvarn_cutlass.hf.generate``: decoding strategies a KVarN cache cannot serve are refused before
the prompt reaches the cache (or the model); the agreement report counts the tokens held as tiles
and calls its progress once per token. A tiny random Qwen3 (2 layers, head_dim 128) on the CPU."""

from __future__ import annotations

import math
import random

import pytest
import torch

transformers = pytest.importorskip("transformers")

import kvarn_cutlass.hf as kh  # noqa: E402
from kvarn_cutlass.hf import generate as G  # noqa: E402


@pytest.fixture(scope="module")
def model():
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=96, hidden_size=256, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=128, max_position_embeddings=1024)
    config._attn_implementation = kh.ATTN_IMPLEMENTATION
    m = Qwen3ForCausalLM(config).eval()
    m.generation_config = GenerationConfig(pad_token_id=0, eos_token_id=None, bos_token_id=None)
    return m


def _forward_counter(model) -> list:
    calls = []
    handle = model.register_forward_pre_hook(lambda module, args: calls.append(1))
    return calls, handle


@pytest.mark.parametrize("kwargs,strategy", [
    ({"num_beams": 2}, "beam search"),
    ({"num_beams": 3, "do_sample": True}, "beam sample"),
    ({"prompt_lookup_num_tokens": 3}, "assisted generation"),
    ({"assistant_model": "MODEL"}, "assisted generation"),
    ({"generation_config": "BEAM_CONFIG"}, "beam search"),
])
def test_unsupported_strategy_is_refused_before_the_prompt_is_prefilled(model, kwargs, strategy):
    from transformers import GenerationConfig

    kwargs = {k: {"MODEL": model, "BEAM_CONFIG": GenerationConfig(num_beams=4)}.get(v, v) if isinstance(v, str) else v
              for k, v in kwargs.items()}
    cache = kh.KVarNCache(model.config, preset="k4v2_g64", window=64)
    calls, handle = _forward_counter(model)
    try:
        with pytest.raises(NotImplementedError, match=f"selects {strategy}"):
            G.generate(model, torch.arange(1, 40)[None], cache, max_new_tokens=4, **kwargs)
    finally:
        handle.remove()
    assert calls == [], "the model ran before the refusal"
    assert cache.library is None and cache.get_seq_length() == 0  # the cache was never touched


def test_plain_model_generate_fills_the_cache_before_beam_search_fails(model):
    """Why the check exists: transformers prefills the prompt and only then asks the cache to reorder."""
    cache = kh.KVarNCache(model.config, preset="k4v2_g64", window=64)
    with pytest.raises(NotImplementedError, match="beam"):
        model.generate(torch.arange(1, 40)[None], max_new_tokens=4, num_beams=2, **{G.cache_kwarg(model): cache})
    assert cache.get_seq_length() > 0


@pytest.mark.parametrize("seed", [random.randrange(2**31)])
def test_greedy_and_sampling_run_and_a_window_larger_than_the_text_is_exact(model, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 96, (1, 50), generator=g)
    unquantized = model.generate(ids, max_new_tokens=6, min_new_tokens=6, do_sample=False)
    cache = kh.KVarNCache(model.config, preset="k4v4_g64", window=512)  # holds every token exact (fp16)
    out = G.generate(model, ids, cache, max_new_tokens=6, min_new_tokens=6, do_sample=False)
    assert cache.library.num_tiles(0) == 0 and cache.get_seq_length() == 50 + 5
    assert torch.equal(out, unquantized), f"seed {seed}"
    torch.manual_seed(seed)
    sampled_cache = kh.KVarNCache(model.config, preset="k4v2_g64", window=64)
    sampled = G.generate(model, ids, sampled_cache, max_new_tokens=5, min_new_tokens=5, do_sample=True,
                         num_return_sequences=2)
    assert sampled.shape == (2, 55) and sampled_cache.library.batch_size == 2
    assert torch.equal(sampled[:, :50], ids.expand(2, -1))


@pytest.mark.parametrize("prompt_tokens,new,window,teacher_forced", [(40, 5, 64, True), (150, 7, 64, False),
                                                                    (64, 1, 64, False)])
def test_agreement_counts_tiles_and_reports_progress_per_token(model, prompt_tokens, new, window, teacher_forced):
    T = 64
    seed = random.randrange(2**31)
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, 96, (prompt_tokens,), generator=g) for _ in range(2)]
    steps = []
    res = G.agreement(model, prompts, new, G.kvarn_cache_factory(model, preset="k4v2_g64", window=window),
                      chunk_size=32, teacher_forced=teacher_forced, progress=lambda: steps.append(1))
    # the library's rule: n tokens held -> max(0, ceil((n - window) / T)) tiles; the last token is never fed back
    held = prompt_tokens + new - 1
    want_tiles = max(0, math.ceil((held - window) / T)) * T
    assert [r["tokens_in_tiles"] for r in res["per_prompt"]] == [want_tiles] * 2, f"seed {seed}"
    assert res["prompts_without_tiles"] == (2 if want_tiles == 0 else 0)
    assert len(steps) == 2 * new * (3 if teacher_forced else 2)
