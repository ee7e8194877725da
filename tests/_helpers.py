"""Shared helpers for the tests: deterministic inputs, float64 Hadamard matrices, cache snapshots,
where the shared reference model and text live."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch

# The shared resources (reference model, eval text): ../shared beside the checkout, or
# $KVARN_SHARED_DIR (the GPU machine gets a copy inside the checkout; tools/gpu_check.sh sets it).
SHARED = Path(os.environ.get("KVARN_SHARED_DIR") or Path(__file__).resolve().parents[1].parent / "shared")


def load_tool(name: str):
    """The module of ``tools/<name>.py`` (the tools are scripts, not a package), loaded afresh; ``tools/`` goes on
    ``sys.path`` as it is for a script, so that a tool may import its siblings."""
    import importlib.util
    import sys

    tools = Path(__file__).resolve().parents[1] / "tools"
    if str(tools) not in sys.path:
        sys.path.insert(0, str(tools))
    path = tools / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def require_disassembler() -> None:
    """Skip the calling test unless cuobjdump or nvdisasm is found (``kvarn_cutlass.cli.sass.find_tool``)."""
    from kvarn_cutlass.cli.sass import find_tool

    if find_tool("cuobjdump") is None and find_tool("nvdisasm") is None:
        pytest.skip("neither cuobjdump nor nvdisasm is installed")


def hadamard64(D: int) -> torch.Tensor:
    """Normalized Sylvester Hadamard matrix [D, D] in float64, built by Kronecker products."""
    H = torch.ones(1, 1, dtype=torch.float64)
    base = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64)
    while H.shape[0] < D:
        H = torch.kron(H, base)
    return H / math.sqrt(D)


def realistic_kv(*shape: int, generator: torch.Generator | None = None, dtype=torch.float16) -> torch.Tensor:
    """Random K/V-like data [..., n, D]: Gaussian with a few outlier channels and a slow drift."""
    x = torch.randn(*shape, generator=generator)
    D = shape[-1]
    outliers = torch.randperm(D, generator=generator)[: max(1, D // 32)]
    x[..., outliers] *= 8.0
    drift = torch.linspace(-1, 1, shape[-2])[:, None] * torch.randn(D, generator=generator)
    return (x + drift).to(dtype)


def snapshot(cache) -> list:
    """Copy of everything a KVarNCache holds, to prove that failed calls change nothing."""
    out = []
    for st in cache._layers:
        out.append(
            (
                st.n_tiles,
                st.window_len,
                st.sink_len,
                st.tiles.clone(),
                st.window_k.clone(),
                st.window_v.clone(),
                st.sink_k.clone(),
                st.sink_v.clone(),
            )
        )
    return out


def assert_same_snapshot(a: list, b: list) -> None:
    assert len(a) == len(b)
    for la, lb in zip(a, b):
        assert la[:3] == lb[:3]
        for ta, tb in zip(la[3:], lb[3:]):
            assert ta.shape == tb.shape and torch.equal(ta, tb)


REF_MODEL_DIR = SHARED / "models" / "kvarn-ref-lm"
REF_TEXT = SHARED / "data" / "code_eval.txt"
# skips a test where the shared reference model or its held-out text is missing
needs_ref_model = pytest.mark.skipif(not (REF_MODEL_DIR / "config.json").exists() or not REF_TEXT.exists(),
                                     reason=f"reference model/data not found under {SHARED}")


def ref_model_on_cuda():
    """kvarn-ref-lm in fp16 on CUDA with the ``kvarn`` attention, and the first ~40k characters of the
    held-out text as token ids [1, n] on CUDA (the GPU tests' shared model fixture)."""
    import kvarn_cutlass.hf  # noqa: F401  (registers 'kvarn')
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(REF_MODEL_DIR, dtype=torch.float16, attn_implementation="kvarn")
    model = model.to("cuda").eval()
    tok = AutoTokenizer.from_pretrained(REF_MODEL_DIR)
    ids = tok(REF_TEXT.read_text(encoding="utf-8")[:40000], return_tensors="pt", add_special_tokens=False).input_ids
    return model, ids.cuda()


def prefix_attention_f64(q, k, v, lengths, scale):
    """Float64 attention of q [B, Hq, 1, D] over keys [0, lengths[b]) of k/v [B, Hkv, L, D] (query head j reads KV
    head j // (Hq / Hkv), transformers' GQA order): [B, 1, Hq, D] on q's device. An independent loop, one softmax
    per (sequence, head), for the fp16 decode baseline's tests."""
    B, Hq, _, D = q.shape
    G = Hq // k.shape[1]
    out = torch.empty(B, 1, Hq, D, dtype=torch.float64, device=q.device)
    for b in range(B):
        n = int(lengths[b])
        for j in range(Hq):
            kk, vv = k[b, j // G, :n].double(), v[b, j // G, :n].double()
            out[b, 0, j] = torch.softmax(kk @ q[b, j, 0].double() * scale, 0) @ vv
    return out
