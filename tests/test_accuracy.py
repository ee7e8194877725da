"""Accuracy gates: perplexity of the reference model with KVarN caches (CPU, one-pass simulation).

First 6 non-overlapping 2048-token windows of code_eval.txt (the whole file tokenized). Expected
values come from an independent simulation; this codec must reproduce each within 0.5% relative.
Window 256 rows use the decode-time view (position p sees the cache holding p+1 tokens). The
"no window" rows quantize every complete 128-token tile of the window for every query (the
``prefill`` view with window 0): that is the configuration the expected numbers were computed for
(the decode-time view with window 0 gives 9.591 / 9.559, see docs/accuracy.md).

The chunked-prefill path (real cache, 512-token chunks) is gated against the decode-time value of the
same run (within 0.5%).

Runtime: about 65 s on 2 idle CPU cores plus ~60 s for the prefill path, several minutes under load (the
codec's tile encoding dominates).
"""

from __future__ import annotations


import pytest
import torch

pytest.importorskip("transformers")

from _helpers import REF_MODEL_DIR as MODEL_DIR, REF_TEXT as TEXT, needs_ref_model  # noqa: E402

EXPECTED = {
    "unquantized": 9.550,
    ("k4v2_g128", 256, "decode"): 9.564,
    ("k4v4_g128", 256, "decode"): 9.557,
    ("k4v2_g128", 0, "prefill"): 10.375,
    ("k4v4_g128", 0, "prefill"): 9.599,
}
REL_TOL = 0.005


@pytest.mark.slow
@needs_ref_model
def test_perplexity_gates():
    import kvarn_cutlass.hf as kh
    from kvarn_cutlass.hf._compat import load_model
    from kvarn_cutlass.hf.perplexity import evaluate, token_windows

    torch.manual_seed(0)
    model, tok = load_model(str(MODEL_DIR), "cpu", torch.float32)
    windows = token_windows(tok, TEXT.read_text(encoding="utf-8"), 2048, 6)
    keys = [k for k in EXPECTED if k != "unquantized"]
    specs = [kh.SimSpec(preset, window, view=view) for preset, window, view in keys]
    res = evaluate(model, windows, specs, progress=False, batch_size=3)
    got = {"unquantized": res["baseline"]["ppl"]}
    got.update({k: r["ppl"] for k, r in zip(keys, res["results"])})
    report = ", ".join(f"{k}: {got[k]:.4f} (expected {EXPECTED[k]})" for k in EXPECTED)
    for k, want in EXPECTED.items():
        assert abs(got[k] / want - 1) < REL_TOL, report
    # quantization never helps much and the window keeps the damage small
    assert got[("k4v2_g128", 256, "decode")] < got[("k4v2_g128", 0, "prefill")]
    # the chunked-prefill path (real cache, 512-token chunks, each chunk seeing itself exactly) costs what
    # decode costs: within 0.5% of the decode-time perplexity (it was +6% when a chunk saw its own
    # tokens quantized)
    pre = evaluate(model, windows, [kh.SimSpec("k4v2_g128", 256)], method="prefill", chunk=512, baseline=False,
                   progress=False)["results"][0]["ppl"]
    decode = got[("k4v2_g128", 256, "decode")]
    assert abs(pre / decode - 1) < REL_TOL, f"prefill {pre:.4f} vs decode {decode:.4f}; {report}"


@pytest.mark.slow
@needs_ref_model
def test_lloyd_max_perplexity_gates():
    """lloyd_max against uniform in the same run (docs/accuracy.md, "Quantizer mode"): with every
    complete tile quantized for every query (prefill view, no window), the lower per-element error
    of the 2-bit Lloyd-Max V codes shows (measured 10.203 vs 10.397); with 4-bit V and a 256-token
    window the cost stays within 0.5% of the unquantized cache (measured +0.07%)."""
    import kvarn_cutlass.hf as kh
    from kvarn_cutlass.hf._compat import load_model
    from kvarn_cutlass.hf.perplexity import evaluate, token_windows

    model, tok = load_model(str(MODEL_DIR), "cpu", torch.float32)
    windows = token_windows(tok, TEXT.read_text(encoding="utf-8"), 2048, 6)
    specs = [
        kh.SimSpec("k4v2_g128", 0, view="prefill", quantizer="uniform"),
        kh.SimSpec("k4v2_g128", 0, view="prefill", quantizer="lloyd_max"),
        kh.SimSpec("k4v4_g128", 256, quantizer="lloyd_max"),
    ]
    res = evaluate(model, windows, specs, progress=False, batch_size=2)
    base = res["baseline"]["ppl"]
    uni_2bit, lm_2bit, lm_4bit = (r["ppl"] for r in res["results"])
    assert res["results"][1]["quantizer"] == "lloyd_max"
    assert base < lm_2bit < uni_2bit, (base, lm_2bit, uni_2bit)
    assert base < lm_4bit < base * (1 + REL_TOL), (base, lm_4bit)


@pytest.mark.gpu
@needs_ref_model
def test_perplexity_gates_cuda_kernels():
    """The kernels' paths on CUDA (fp16 model and cache): decode-time through the int8 decode kernel within
    0.5% of the expected value, and the chunked-prefill path through the fused kernel within 0.5% of it."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    import kvarn_cutlass.hf as kh
    from kvarn_cutlass.hf._compat import load_model
    from kvarn_cutlass.hf.perplexity import evaluate, token_windows

    model, tok = load_model(str(MODEL_DIR), "cuda", torch.float16)
    windows = token_windows(tok, TEXT.read_text(encoding="utf-8"), 2048, 6)
    spec = [kh.SimSpec("k4v2_g128", 256)]
    decode = evaluate(model, windows, spec, method="decode", baseline=False, progress=False, batch_size=6)
    pre = evaluate(model, windows, spec, method="prefill", chunk=512, baseline=False, progress=False, batch_size=6)
    decode, pre = decode["results"][0]["ppl"], pre["results"][0]["ppl"]
    want = EXPECTED[("k4v2_g128", 256, "decode")]
    assert abs(decode / want - 1) < REL_TOL, f"decode {decode:.4f} vs expected {want}"
    assert abs(pre / decode - 1) < REL_TOL, f"prefill {pre:.4f} vs decode {decode:.4f}"
