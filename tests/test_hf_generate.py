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


@pytest.mark.parametrize("seed", [pytest.param(random.randrange(2**31), id="fresh_seed")])
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


# --- static_greedy: the static decode step (kvarn_cutlass.hf.static_step), run eagerly on the CPU -----------------------
from _helpers import SHARED, assert_same_snapshot, snapshot  # noqa: E402

MODEL_DIR = SHARED / "models" / "kvarn-ref-lm"


@pytest.fixture(scope="module")
def ref_model():
    if not (MODEL_DIR / "config.json").is_file():
        pytest.skip(f"reference model/data not found under {SHARED}")
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32, attn_implementation="kvarn").eval()


def test_static_step_equals_eager_greedy_on_the_reference_model(ref_model):
    """The static step (explicit position ids, the argmax fed back on the device, tokens written by a device index)
    gives the eager loop's tokens and leaves the cache byte for byte as the eager loop does, at batch 2, with a tile
    completing during decode."""
    seed = random.randrange(2**31)
    ids = torch.randint(1, ref_model.config.vocab_size, (2, 240), generator=torch.Generator().manual_seed(seed))
    new = 20
    # "dequant": the CPU attention that decodes each tile once (the float64 reference is ~5x slower here)
    eager_cache = kh.KVarNCache(ref_model.config, window=128, cpu_attention="dequant")
    want = G.greedy(ref_model, ids, new, eager_cache, chunk_size=120)
    cache = kh.KVarNCache(ref_model.config, window=128, cpu_attention="dequant")
    run = G.StaticGreedy(ref_model, ids, new, cache, chunk_size=120)
    assert not run.graph  # the CPU default
    run.prefill()
    tiles_after_prefill = cache.library.num_tiles(0)
    for _ in range(new - 1):
        run.step()
    got = run.finish()
    assert (tiles_after_prefill, cache.library.num_tiles(0)) == (1, 2)  # 240 -> 259 tokens, window 128
    assert torch.equal(got, want), f"seed {seed}: first difference at {(got != want).nonzero()[:1].tolist()}"
    assert_same_snapshot(snapshot(cache.library), snapshot(eager_cache.library))
    assert cache.get_seq_length() == 240 + new - 1
    assert ref_model.config._attn_implementation == kh.ATTN_IMPLEMENTATION  # restored after the steps


def test_static_step_with_a_transformers_static_cache_equals_eager_greedy(ref_model):
    from transformers import StaticCache

    seed = random.randrange(2**31)
    ids = torch.randint(1, ref_model.config.vocab_size, (1, 100), generator=torch.Generator().manual_seed(seed))
    new = 16
    capacity = 100 + new - 1  # exactly what the generation needs
    eager_cache = StaticCache(config=ref_model.config, max_cache_len=capacity)
    want = G.greedy(ref_model, ids, new, eager_cache, chunk_size=64)
    cache = StaticCache(config=ref_model.config, max_cache_len=capacity)
    got = G.static_greedy(ref_model, ids, new, cache, chunk_size=64)
    assert torch.equal(got, want), f"seed {seed}"
    assert int(cache.get_seq_length()) == capacity
    for a, b in zip(cache.layers, eager_cache.layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def test_static_greedy_reads_the_tokens_back_every_sync_every_tokens(model):
    ids = torch.randint(1, 96, (2, 50), generator=torch.Generator().manual_seed(3))
    want = G.greedy(model, ids, 11, kh.KVarNCache(model.config, preset="k4v2_g64", window=64), chunk_size=32)
    seen = []
    got = G.static_greedy(model, ids, 11, kh.KVarNCache(model.config, preset="k4v2_g64", window=64), chunk_size=32,
                          sync_every=4, on_tokens=seen.append)
    assert [t.shape for t in seen] == [(2, 4), (2, 4), (2, 3)] and all(t.device.type == "cpu" for t in seen)
    assert torch.equal(torch.cat(seen, 1), got) and torch.equal(got, want)
    one = G.static_greedy(model, ids, 1, kh.KVarNCache(model.config, preset="k4v2_g64", window=64), chunk_size=32)
    assert torch.equal(one, want[:, :1])


def _static_cache(config, n):
    from transformers import StaticCache

    return StaticCache(config=config, max_cache_len=n)


@pytest.mark.parametrize("make,kwargs,error,match", [
    (lambda c: kh.KVarNCache(c, preset="k4v2_g64", window=64), {"graph": True}, ValueError, r"max_seq_len >= 57"),
    (lambda c: kh.KVarNCache(c, preset="k4v2_g64", window=64, max_seq_len=57), {"graph": True}, ValueError, "CUDA device"),
    (lambda c: kh.KVarNCache(c, preset="k4v2_g64", window=64, max_seq_len=56), {}, ValueError,
     r"57 in all, over the cache's max_seq_len=56"),
    (lambda c: _static_cache(c, 56), {}, ValueError, "max_cache_len=56"),
    (lambda c: G._baseline_cache(_Model(c)), {}, TypeError, "StaticCache"),
    (lambda c: kh.KVarNCache(c, preset="k4v2_g64", window=64), {"max_new_tokens": 0}, ValueError, "max_new_tokens"),
    (lambda c: kh.KVarNCache(c, preset="k4v2_g64", window=64), {"input_ids": torch.ones(1, 5)}, ValueError, "int64"),
    (lambda c: kh.KVarNCache(c, preset="k4v2_g64", window=64), {"chunk_size": 0}, ValueError, "chunk_size"),
    (lambda c: kh.KVarNCache(c, preset="k4v2_g64", window=64), {"sync_every": -1}, ValueError, "sync_every"),
    (lambda c: kh.KVarNCache(c, preset="k4v2_g64", window=64), {"decode_attn": "sdpa"}, ValueError,
     "decode_attn='sdpa' is for a StaticCache"),
    (lambda c: _static_cache(c, 60), {"decode_attn": "no_such_attention"}, ValueError, "AttentionInterface"),
    (lambda c: _static_cache(c, 60), {"decode_attn": 3}, ValueError, "decode_attn must be None"),
])
def test_static_greedy_refuses_before_the_model_or_the_cache_runs(model, make, kwargs, error, match):
    cache = make(model.config)
    args = {"input_ids": torch.arange(1, 51)[None], "max_new_tokens": 8, **kwargs}
    calls, handle = _forward_counter(model)
    try:
        with pytest.raises(error, match=match):
            G.static_greedy(model, args.pop("input_ids"), args.pop("max_new_tokens"), cache, **args)
    finally:
        handle.remove()
    assert calls == [] and int(cache.get_seq_length()) == 0


class _Model:
    """Stands in for a model where only ``.config`` is read."""

    def __init__(self, config):
        self.config = config


def test_a_kvarn_cache_needs_the_kvarn_attention_and_kvarn_step_serves_only_decode(model):
    cache = kh.KVarNCache(model.config, preset="k4v2_g64", window=64)
    ids = torch.arange(1, 51)[None]
    model.set_attn_implementation("sdpa")
    try:
        with pytest.raises(ValueError, match="attention implementation 'kvarn'"):
            G.StaticGreedy(model, ids, 4, cache)
    finally:
        model.set_attn_implementation(kh.ATTN_IMPLEMENTATION)
    from kvarn_cutlass.hf.static_step import STEP_ATTN_IMPLEMENTATION

    model.set_attn_implementation(STEP_ATTN_IMPLEMENTATION)
    try:
        with pytest.raises(ValueError, match="one query per sequence"):
            model(input_ids=ids[:, :3], use_cache=True, **{G.cache_kwarg(model): cache})
    finally:
        model.set_attn_implementation(kh.ATTN_IMPLEMENTATION)


def test_static_greedy_steps_in_order(model):
    run = G.StaticGreedy(model, torch.arange(1, 51)[None], 2, kh.KVarNCache(model.config, preset="k4v2_g64", window=64))
    with pytest.raises(RuntimeError, match="prefill"):
        run.step()
    run.prefill()
    with pytest.raises(RuntimeError, match="already"):
        run.prefill()
    run.step()
    with pytest.raises(RuntimeError, match="all 2 tokens"):
        run.step()
    assert run.finish().shape == (1, 2)


def test_cli_generate_says_how_it_decoded(capsys):
    if not (MODEL_DIR / "config.json").is_file():
        pytest.skip(f"reference model/data not found under {SHARED}")
    import json

    from kvarn_cutlass.cli import main

    assert main(["generate", "--model", str(MODEL_DIR), "--prompt", "def add(a, b):", "--max-new-tokens", "3",
                 "--device", "cpu", "--window", "128", "--no-graph", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["decode"] == "eager"  # never a graph on the CPU
