"""Hugging Face transformers integration (transformers >= 5).

* :class:`KVarNCache`: a transformers ``Cache`` backed by :class:`kvarn_cutlass.KVarNCache`; use it
  with a model loaded with ``attn_implementation="kvarn"`` (registered on import of this package).
* :func:`prefill`: chunked prefill into a cache, logits for the last chunk only.
* :mod:`.simulate`: teacher-forced decode-time simulation (perplexity), :mod:`.perplexity` and
  :mod:`.generate`: the ``kvarn-cutlass perplexity`` / ``generate`` subcommands and their functions.
* :mod:`.dispatch`: where attention over the cache is computed (CPU reference, CUDA kernels).
"""

from .attention import kvarn_attention_forward, register
from .cache import ATTN_IMPLEMENTATION, KVarNCache, KVarNLayer, check_model_config
from .dispatch import attend
from .prefill import prefill
from .simulate import SimSpec, simulated_attention

register()

__all__ = [
    "ATTN_IMPLEMENTATION",
    "KVarNCache",
    "KVarNLayer",
    "SimSpec",
    "attend",
    "check_model_config",
    "kvarn_attention_forward",
    "prefill",
    "register",
    "simulated_attention",
]
