"""kvarn-cutlass: attention over a 4-bit KVarN-quantized KV cache on NVIDIA GPUs.

Data flow: ``format`` (tile layout) -> ``codec`` (encode/decode) -> ``cache`` (KVarNCache) ->
``reference`` (float64 oracle) -> ``runtime`` (compile/load/launch) -> ``gemm`` (CUTLASS K-score
GEMM) -> ``prefill`` / ``decode`` -> ``hf`` (transformers integration) -> ``cli``.

The GPU entry points and the transformers integration are imported on first use, so that
``import kvarn_cutlass`` stays light and works without transformers installed.
"""

from importlib import import_module

from . import reference
from .cache import KVarNCache
from .codec import decode_tiles, encode_tiles
from .format import PRESETS, QUANTIZERS, TileSpec

__version__ = "0.1.0"

_LAZY = {
    "prefill_attention": ("kvarn_cutlass.prefill", "prefill_attention"),
    "decode_attention": ("kvarn_cutlass.decode", "decode_attention"),
    "decode_attention_ragged": ("kvarn_cutlass.decode", "decode_attention_ragged"),
    "DecodeGraph": ("kvarn_cutlass.decode", "DecodeGraph"),
    "StepGraph": ("kvarn_cutlass.step_graph", "StepGraph"),
    "snapkv_compact": ("kvarn_cutlass.compact", "snapkv_compact"),
    "dequantize_layer": ("kvarn_cutlass.ops.dequant", "dequantize_layer"),
    "hf": ("kvarn_cutlass.hf", None),
}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'kvarn_cutlass' has no attribute {name!r}")
    module, attr = _LAZY[name]
    value = import_module(module) if attr is None else getattr(import_module(module), attr)
    globals()[name] = value
    return value


__all__ = ["PRESETS", "QUANTIZERS", "TileSpec", "encode_tiles", "decode_tiles", "KVarNCache", "reference", "__version__", *_LAZY]
