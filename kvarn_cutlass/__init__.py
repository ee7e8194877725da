"""kvarn-cutlass: attention over a 4-bit KVarN-quantized KV cache on NVIDIA GPUs.

Data flow: ``format`` (tile layout) -> ``codec`` (encode/decode) -> ``cache`` (KVarNCache) ->
``reference`` (float64 oracle) -> ``runtime`` (compile/load/launch) -> ``gemm`` (CUTLASS K-score
GEMM) -> prefill / decode -> integrations -> cli.
"""

from . import reference
from .cache import KVarNCache
from .codec import decode_tiles, encode_tiles
from .format import PRESETS, TileSpec

__version__ = "0.1.0"

__all__ = ["PRESETS", "TileSpec", "encode_tiles", "decode_tiles", "KVarNCache", "reference", "__version__"]
