"""Hugging Face transformers integration (transformers >= 5).

* :class:`KVarNCache`: a transformers ``Cache`` backed by :class:`kvarn_cutlass.KVarNCache`; use it
  with a model loaded with ``attn_implementation="kvarn"`` (registered on import of this package).
* :func:`prefill`: chunked prefill into a cache, logits for the last chunk only.
* :mod:`.simulate`: teacher-forced decode-time simulation (perplexity), :mod:`.perplexity` and
  :mod:`.generate`: the ``kvarn-cutlass perplexity`` / ``generate`` subcommands and their functions.
* :mod:`.dispatch`: where attention over the cache is computed (CPU reference, CUDA kernels).
* :func:`static_greedy` / :class:`StaticGreedy`: chunked prefill, then greedy decode of the whole model
  step on static buffers, replayed from one CUDA graph on CUDA (:mod:`.static_step`).
"""

from .attention import kvarn_attention_forward, register
from .cache import ATTN_IMPLEMENTATION, KVarNCache, KVarNLayer, check_model_config
from .dispatch import attend
from .prefill import prefill
from .simulate import SimSpec, simulated_attention
from .static_step import StaticGreedy, static_greedy

register()

__all__ = [
    "ATTN_IMPLEMENTATION",
    "KVarNCache",
    "KVarNLayer",
    "SimSpec",
    "StaticGreedy",
    "attend",
    "check_model_config",
    "kvarn_attention_forward",
    "prefill",
    "register",
    "simulated_attention",
    "static_greedy",
]
