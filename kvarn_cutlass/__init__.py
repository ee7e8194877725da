"""kvarn-cutlass: attention over a 4-bit KVarN-quantized KV cache on NVIDIA GPUs.

Data flow: ``format`` (tile layout) -> ``codec`` (encode/decode) -> ``cache`` (KVarNCache) ->
``reference`` (float64 oracle) -> ``runtime`` (NVRTC compile, kernel cache, load/launch) -> ``ops``
(the kernels' Python side: specs emitted from ``format.TileSpec``, launches) -> ``prefill`` / ``decode``
-> ``hf`` (transformers integration) -> ``cli``.

Everything but the preset and quantizer names is imported on first use, so that ``import
kvarn_cutlass`` stays light (no torch until a tensor type is needed) and works without transformers.
"""

from importlib import import_module
from importlib.util import find_spec

from .presets import PRESETS, QUANTIZERS

__version__ = "0.1.0"

# name -> (module, attribute; None: the module itself). Imported on first access, so that importing
# the package (and so the command line's --help) does not import torch.
_LAZY = {
    "KVarNCache": ("kvarn_cutlass.cache", "KVarNCache"),
    "TileSpec": ("kvarn_cutlass.format", "TileSpec"),
    "encode_tiles": ("kvarn_cutlass.codec", "encode_tiles"),
    "decode_tiles": ("kvarn_cutlass.codec", "decode_tiles"),
    "reference": ("kvarn_cutlass.reference", None),
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
    if name in _LAZY:
        module, attr = _LAZY[name]
        value = import_module(module) if attr is None else getattr(import_module(module), attr)
    elif find_spec(f"{__name__}.{name}") is not None:  # a submodule not imported yet (kvarn_cutlass.format)
        value = import_module(f"{__name__}.{name}")
    else:
        raise AttributeError(f"module 'kvarn_cutlass' has no attribute {name!r}")
    globals()[name] = value
    return value


__all__ = ["PRESETS", "QUANTIZERS", "__version__", *_LAZY]
