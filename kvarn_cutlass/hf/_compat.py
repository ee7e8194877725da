"""Small helpers that keep the integration working across transformers 5.x releases."""

from __future__ import annotations

import inspect

import torch


def text_config(config):
    """The decoder (text) config of ``config`` (itself for plain causal LMs)."""
    get = getattr(config, "get_text_config", None)
    if get is None:
        return config
    try:
        return get(decoder=True)
    except TypeError:  # older signature without ``decoder``
        return get()


def cache_kwarg(model) -> str:
    """Name of the forward argument that takes the cache: ``cache`` (transformers >= 5.2x) or
    ``past_key_values`` (earlier 5.x; later releases still accept it with a deprecation warning)."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return "past_key_values"
    return "cache" if "cache" in params else "past_key_values"


def base_model(model):
    """The decoder stack without the LM head (``model.model`` for Llama/Qwen), or None."""
    prefix = getattr(model, "base_model_prefix", None)
    if prefix and hasattr(model, prefix):
        inner = getattr(model, prefix)
        if isinstance(inner, torch.nn.Module) and inner is not model:
            return inner
    return None


def resolve_dtype(name: str | torch.dtype | None, device: str) -> torch.dtype:
    """Model dtype: float32 on CPU unless told otherwise (fp16 CPU kernels are slower and less
    portable), float16 on CUDA."""
    if isinstance(name, torch.dtype):
        return name
    if name in (None, "auto"):
        return torch.float32 if str(device).startswith("cpu") else torch.float16
    table = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
             "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
    if name not in table:
        raise ValueError(f"dtype must be one of {sorted(table)} or 'auto', got {name!r}")
    return table[name]


def load_model(path: str, device: str = "cpu", dtype=None, attn_implementation: str = "kvarn"):
    """Load a causal LM and its tokenizer with the ``kvarn`` attention implementation registered."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .attention import register

    register()
    dt = resolve_dtype(dtype, device)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dt, attn_implementation=attn_implementation)
    model = model.to(device).eval()
    tok = AutoTokenizer.from_pretrained(path)
    return model, tok
