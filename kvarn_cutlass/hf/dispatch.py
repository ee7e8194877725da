"""The one place where the transformers integration chooses how attention over a KVarNCache is computed.

``attend(q, cache, layer, scale)`` computes attention of the newest ``n_q`` queries over ``layer`` of
a :class:`kvarn_cutlass.KVarNCache` (semantics of :func:`kvarn_cutlass.reference.attention`: queries
are the newest tokens, causal, tile tokens read as their quantized reconstruction) and returns it in
``q.dtype``, shape [batch, num_q_heads, n_q, head_dim].

* CPU: :func:`kvarn_cutlass.reference.attention` (float64), cast to ``q.dtype``.
* CUDA: the GPU kernels, imported lazily: ``kvarn_cutlass.decode.decode_attention`` for one query
  per sequence (decode steps), ``kvarn_cutlass.prefill.prefill_attention`` for several (prefill
  chunks). Both take ``(q, cache, layer, scale=...)`` like the reference and return
  [batch, num_q_heads, n_q, head_dim]; float32 queries are passed in the cache dtype (the kernels
  take float16/bfloat16). While they are not importable, CUDA raises NotImplementedError (never a
  silent fallback to a different numerical path).
"""

from __future__ import annotations

import importlib

import torch

from .. import reference
from ..cache import KVarNCache as _LibCache

_GPU_ENTRY_POINTS = {
    "decode": ("kvarn_cutlass.decode", "decode_attention"),
    "prefill": ("kvarn_cutlass.prefill", "prefill_attention"),
}


def gpu_entry_point(kind: str):
    """The GPU attention function for ``kind`` ('decode' or 'prefill'), imported lazily.

    Raises NotImplementedError, naming the missing module, when it cannot be imported.
    """
    module_name, fn_name = _GPU_ENTRY_POINTS[kind]
    try:
        module = importlib.import_module(module_name)
        return getattr(module, fn_name)
    except (ImportError, AttributeError) as exc:
        raise NotImplementedError(
            f"KVarN attention on CUDA needs {module_name}.{fn_name}, which is not available yet ({exc}); "
            "use device='cpu' (reference path) meanwhile"
        ) from exc


def attend(q: torch.Tensor, cache: _LibCache, layer: int, scale: float | None = None) -> torch.Tensor:
    """Attention of q [batch, num_q_heads, n_q, head_dim] over ``layer`` of ``cache``, in q.dtype."""
    device = cache.device
    if device.type == "cpu":
        return reference.attention(q, cache, layer, scale=scale).to(q.dtype)
    if device.type == "cuda":
        kind = "decode" if q.shape[2] == 1 else "prefill"
        # the kernels take float16/bfloat16 queries: a float32 model's queries go in the cache dtype
        qk = q if q.dtype in (torch.float16, torch.bfloat16) else q.to(cache.dtype)
        out = gpu_entry_point(kind)(qk, cache, layer, scale=scale)
        return out.to(q.dtype)
    raise NotImplementedError(f"KVarN attention has no implementation for device {device}")
