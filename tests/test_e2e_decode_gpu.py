"""The e2e bench's fp16 decode baseline on CUDA (``kvarn_cutlass.bench.e2e.fp16_decode_attention``).

Decides on the GPU what the CPU tests cannot: that torch's FlashAttention-2 in its varlen form, with the
filled prefix's length in ``seqused_k`` on the device, computes attention over that prefix only (the float64
reference; an unfilled tail of NaN is never read), in float16 and bfloat16, for GQA groups 1, 4 and 8; that a
captured CUDA graph of it, replayed while the device position grows, gives the eager call's bits at every
position; and that StaticGreedy's graph-replayed decode through it gives its eager decode's tokens. Needs no
model files (random tensors, a tiny random Qwen3).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from kvarn_cutlass.bench import e2e  # noqa: E402

from _helpers import prefix_attention_f64  # noqa: E402

pytestmark = pytest.mark.gpu


def _problem(batch, q_heads, kv_heads, L, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn(batch, h, n, 128, generator=g, device="cuda").to(dtype)
               for h, n in ((q_heads, 1), (kv_heads, L), (kv_heads, L)))
    return q, k, v


def _poison_past(x, lengths):
    for b, n in enumerate(lengths):
        x[b, :, n:] = float("nan")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("q_heads,kv_heads", [(8, 8), (32, 8), (16, 2)])  # GQA groups 1, 4, 8
def test_flash_decode_is_attention_over_the_filled_prefix(dtype, q_heads, kv_heads):
    L, scale = 1000, 128**-0.5
    q, k, v = _problem(3, q_heads, kv_heads, L, dtype, seed=q_heads)
    positions = [0, 517, L - 1]  # one key; a partial last block; the whole buffer
    lengths = [p + 1 for p in positions]
    _poison_past(k, lengths)
    _poison_past(v, lengths)
    got, _ = e2e.fp16_decode_attention(None, q, k, v, None, scaling=scale,
                                       position_ids=torch.tensor(positions, device="cuda")[:, None])
    assert got.shape == (3, 1, q_heads, 128) and got.dtype == dtype and torch.isfinite(got).all()
    want = prefix_attention_f64(q, k, v, lengths, scale)
    tol = 4e-3 if dtype == torch.float16 else 3e-2
    torch.testing.assert_close(got.double(), want, rtol=0, atol=tol)
    # one position for the whole batch ([1, 1], what StaticGreedy passes)
    shared, _ = e2e.fp16_decode_attention(None, q, k, v, None, scaling=scale,
                                          position_ids=torch.tensor([[0]], device="cuda"))
    torch.testing.assert_close(shared.double(), prefix_attention_f64(q, k, v, [1, 1, 1], scale), rtol=0, atol=tol)


def test_a_captured_flash_decode_follows_the_device_position():
    """One graph, replayed while the position grows in place (as StaticGreedy's position_ids does): every replay
    equals the eager call at that position, bit for bit, and the float64 reference."""
    B, L, scale = 4, 2000, 128**-0.5
    q, k, v = _problem(B, 32, 8, L, torch.float16, seed=7)
    _poison_past(k, [L - 40] * B)  # the slots the replays never reach
    _poison_past(v, [L - 40] * B)
    pos = torch.tensor([[100]], device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # torch's rule for capture: warm up on a side stream
        e2e.fp16_decode_attention(None, q, k, v, None, scaling=scale, position_ids=pos)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, _ = e2e.fp16_decode_attention(None, q, k, v, None, scaling=scale, position_ids=pos)
    for p in (100, 101, 127, 128, 129, 1023, 1500, L - 41):
        pos.fill_(p)
        graph.replay()
        eager, _ = e2e.fp16_decode_attention(None, q, k, v, None, scaling=scale, position_ids=pos)
        assert torch.equal(out, eager), f"position {p}"
        torch.testing.assert_close(out.double(), prefix_attention_f64(q, k, v, [p + 1] * B, scale), rtol=0, atol=4e-3)


def test_static_greedy_replays_the_flash_decode_to_its_eager_tokens():
    from transformers import AutoModelForCausalLM, Qwen3Config, StaticCache

    from kvarn_cutlass.hf.static_step import StaticGreedy

    shape = {**e2e.QWEN3_8B, "vocab_size": 512, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
             "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 128}
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(Qwen3Config(**shape), dtype=torch.float16,
                                                 attn_implementation="sdpa").eval()
    ids = torch.randint(0, 512, (2, 300), device="cuda", generator=torch.Generator(device="cuda").manual_seed(1))
    tokens = {}
    for graph in (True, False):
        run = StaticGreedy(model, ids, 40, StaticCache(config=model.config, max_cache_len=340), 128, graph=graph,
                           decode_attn=e2e._decode_attn("fp16"))
        run.prefill()
        for _ in range(39):
            run.step()
        tokens[graph] = run.finish()
    assert torch.equal(tokens[True], tokens[False])
    assert model.config._attn_implementation == "sdpa"
