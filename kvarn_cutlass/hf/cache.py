"""``KVarNCache``: a transformers ``Cache`` whose storage is the library's :class:`kvarn_cutlass.KVarNCache`.

Usage (transformers >= 5)::

    import kvarn_cutlass.hf as kh
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="kvarn")
    cache = kh.KVarNCache(model.config, preset="k4v2_g128", window=256)
    from kvarn_cutlass.hf.generate import generate
    out = generate(model, input_ids, cache, max_new_tokens=64)  # cache= or past_key_values=

How the pieces meet: the model's attention layer calls ``cache.update(k, v, layer_idx)`` with the
post-RoPE keys/values of the new tokens; the update returns the same new k/v tagged with a handle to
the cache layer (it does not append yet). The ``kvarn`` attention function
(``kvarn_cutlass.hf.attention``) sees the tag and, through :func:`kvarn_cutlass.hf.dispatch.attend`
(reference on CPU, GPU kernels on CUDA), computes attention of the new queries over the library cache
plus the new tokens, then appends them (which compresses tiles leaving the fp16 window): a prefill
chunk sees its own tokens exactly, as the library's ``prefill_attention`` defines. Any other attention
implementation would never append, so an update whose output was not consumed by the ``kvarn``
attention makes the next update raise instead of producing wrong output.

Everything the library cannot honor is rejected at construction: head_dim outside (64, 128, 256),
sliding-window / chunked / linear-attention layers, logit soft-capping, MLA, encoder-decoder models,
and bad preset/window/sink/dtype values (the library's own validation). Padding (batch > 1 with an
attention mask that has zeros) raises when the mask is built; beam search (cache reordering) raises.
"""

from __future__ import annotations

import contextlib

from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from ..cache import KVarNCache as LibraryCache
from ..format import DEFAULT_PRESET, DEFAULT_QUANTIZER, DEFAULT_SINKHORN_ITERS, HEAD_DIMS
from ._compat import text_config

ATTN_IMPLEMENTATION = "kvarn"


@dataclass(frozen=True)
class ModelShape:
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int


def _get(config, name, default=None):
    return getattr(config, name, default)


def check_model_config(config) -> ModelShape:
    """Validate a (text) model config for KVarN attention; return its attention shape.

    Raises ValueError naming the unsupported feature.
    """
    cfg = text_config(config)
    mt = _get(cfg, "model_type", type(cfg).__name__)
    if _get(config, "is_encoder_decoder", False) or _get(cfg, "is_encoder_decoder", False):
        raise ValueError(f"KVarNCache supports decoder-only models; {mt} is an encoder-decoder model")
    for name in ("num_hidden_layers", "num_attention_heads", "hidden_size"):
        if not isinstance(_get(cfg, name), int):
            raise ValueError(f"KVarNCache needs config.{name} (an int); {mt} config has {_get(cfg, name)!r}")
    for name in ("kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "v_head_dim"):
        if _get(cfg, name) is not None:
            raise ValueError(f"KVarNCache does not support multi-head latent attention ({mt} config sets {name})")
    if _get(cfg, "attn_logit_softcapping") is not None:
        raise ValueError(f"KVarNCache does not support attention logit soft-capping ({mt}: attn_logit_softcapping)")
    if _get(cfg, "attention_chunk_size") is not None:
        raise ValueError(f"KVarNCache does not support chunked attention ({mt}: attention_chunk_size)")
    if _get(cfg, "num_kv_shared_layers"):
        raise ValueError(f"KVarNCache does not support KV sharing across layers ({mt}: num_kv_shared_layers)")

    n_layers = cfg.num_hidden_layers
    layer_types = _get(cfg, "layer_types")
    if layer_types is not None:
        bad = {i: t for i, t in enumerate(layer_types) if t != "full_attention"}
        if bad:
            shown = ", ".join(f"{i}: {t}" for i, t in list(bad.items())[:6])
            raise ValueError(
                f"KVarNCache supports only full-attention layers; {mt} has {len(bad)} other layer(s) ({shown}"
                f"{', ...' if len(bad) > 6 else ''})"
            )
        if len(layer_types) != n_layers:
            raise ValueError(f"config.layer_types has {len(layer_types)} entries for {n_layers} layers")
    elif _get(cfg, "sliding_window") is not None and _get(cfg, "use_sliding_window", True):
        raise ValueError(
            f"KVarNCache does not support sliding-window attention ({mt}: sliding_window={cfg.sliding_window})"
        )

    n_q = cfg.num_attention_heads
    n_kv = _get(cfg, "num_key_value_heads") or n_q
    head_dim = _get(cfg, "head_dim") or cfg.hidden_size // n_q
    if n_q % n_kv:
        raise ValueError(f"num_attention_heads={n_q} must be a multiple of num_key_value_heads={n_kv}")
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"KVarNCache supports head_dim in {list(HEAD_DIMS)}; {mt} has head_dim={head_dim}")
    return ModelShape(n_layers, n_q, n_kv, head_dim)


class _Handle:
    """Tag on the k/v returned by ``update``: where the ``kvarn`` attention finds the library cache."""

    __slots__ = ("cache", "layer", "consumed", "key", "value")

    def __init__(self, cache: KVarNCache, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        self.cache, self.layer, self.consumed = cache, layer, False
        self.key, self.value = key, value  # the new tokens, appended by the attention that consumes them


HANDLE_ATTR = "_kvarn_handle"


def handle_of(t: torch.Tensor) -> _Handle | None:
    return getattr(t, HANDLE_ATTR, None)


class KVarNLayer(CacheLayerMixin):
    """One model layer's view of the shared library cache (transformers ``CacheLayerMixin``)."""

    is_compileable = False
    is_croppable = False  # crop works only inside the fp16 window
    is_sliding = False
    supports_early_init = True

    def __init__(self, parent: KVarNCache, layer_idx: int) -> None:
        super().__init__()
        self.parent = parent
        self.layer_idx = layer_idx
        self._pending: _Handle | None = None
        # tokens dropped from this layer by compaction (kvarn_cutlass.compact): the layer holds
        # ``library.seq_len`` tokens but the sequence is this many longer, so new tokens keep their
        # absolute positions (RoPE) and mask offsets, as in SnapKV
        self.evicted = 0

    def __repr__(self) -> str:
        return f"KVarNLayer({self.layer_idx})"

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.parent._ensure_library(key_states)
        self.device = key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Tag the new tokens' k/v [batch, num_kv_heads, n_new, head_dim] for the ``kvarn`` attention, which
        attends and then appends them; return them tagged (validated here, so bad input raises now)."""
        if self._pending is not None and not self._pending.consumed:
            raise RuntimeError(
                f"KVarNCache layer {self.layer_idx}: the previous update was not consumed by the '{ATTN_IMPLEMENTATION}' "
                "attention implementation, so attention did not read the quantized cache. Load the model with "
                f"attn_implementation='{ATTN_IMPLEMENTATION}' (after `import kvarn_cutlass.hf`) or call "
                f"model.set_attn_implementation('{ATTN_IMPLEMENTATION}')"
            )
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        lib = self.parent.library
        lib.check_kv("key_states", key_states)
        lib.check_kv("value_states", value_states)
        handle = _Handle(self.parent, self.layer_idx, key_states, value_states)
        self._pending = handle
        k, v = key_states.view(key_states.shape), value_states.view(value_states.shape)
        setattr(k, HANDLE_ATTR, handle)
        setattr(v, HANDLE_ATTR, handle)
        return k, v

    def get_seq_length(self) -> int:
        """Tokens of the sequence so far (absolute: includes tokens dropped by compaction)."""
        lib = self.parent.library
        return 0 if lib is None else lib.seq_len(self.layer_idx) + self.evicted

    def get_mask_sizes(self, query_length: int, *args, **kwargs) -> tuple[int, int]:
        # keys held + new ones; held key j sits at position j + evicted for the causal mask
        return self.get_seq_length() - self.evicted + query_length, self.evicted

    def get_max_length(self) -> int:
        return -1 if self.parent.max_seq_len is None else self.parent.max_seq_len

    def get_max_cache_shape(self) -> int:  # transformers < 5.16 name
        return self.get_max_length()

    def offload(self):
        raise NotImplementedError("KVarNCache does not support offloading")

    def prefetch(self):
        raise NotImplementedError("KVarNCache does not support offloading")

    def reset(self) -> None:
        self.parent.library = None
        self.parent.dequantized = None
        self.is_initialized = False
        self._pending = None
        self.evicted = 0

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError("crop takes a negative number of tokens to remove")
        if tokens_to_remove == 0 or self.parent.library is None:
            return
        lib = self.parent.library
        lib.truncate(self.layer_idx, lib.seq_len(self.layer_idx) + tokens_to_remove)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("KVarNCache does not support beam search (cache reordering)")

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.get_seq_length() > 0 and repeats != 1:
            raise NotImplementedError("KVarNCache cannot repeat a filled cache along the batch")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.get_seq_length() > 0:
            raise NotImplementedError("KVarNCache cannot select batch entries of a filled cache")


class KVarNCache(Cache):
    """transformers ``Cache`` backed by :class:`kvarn_cutlass.KVarNCache` (one for all layers).

    Args:
        config: the model's config (``model.config``); validated here (see the module docstring).
        preset: tile preset, ``k4v2_g128`` default.
        window: fp16 window in tokens (a multiple of the tile size, >= one tile), default 256.
        sink_tokens: leading tokens kept unquantized (0 or a multiple of the tile size).
        dtype: float16 (default) or bfloat16, the dtype of the window and sink; incoming k/v are
            rounded to it (so a float32 model on CPU sees fp16-rounded keys and values).
        scale_dtype, sinkhorn_iters, max_seq_len: passed to the library cache.
        quantizer: ``uniform`` (default) or ``lloyd_max``, passed to the library cache (how tile
            values are coded, see ``kvarn_cutlass.format.QUANTIZERS``).
        device: where the cache lives; default: the device of the first k/v it receives.
        cpu_attention: on CPU, ``"reference"`` (default: :func:`kvarn_cutlass.reference.attention`,
            float64) or ``"dequant"`` (tiles decoded once, float32 SDPA; for long CPU generation).

    The library cache is created on the first ``update`` (batch size and device come from the
    first keys) and is available as ``.library``.
    """

    def __init__(
        self,
        config,
        preset: str = DEFAULT_PRESET,
        window: int = 256,
        sink_tokens: int = 0,
        dtype: torch.dtype = torch.float16,
        scale_dtype: torch.dtype = torch.float16,
        sinkhorn_iters: int = DEFAULT_SINKHORN_ITERS,
        max_seq_len: int | None = None,
        device: str | torch.device | None = None,
        cpu_attention: str = "reference",
        quantizer: str = DEFAULT_QUANTIZER,
    ) -> None:
        self.shape = check_model_config(config)
        if cpu_attention not in ("reference", "dequant"):
            raise ValueError(f"cpu_attention must be 'reference' or 'dequant', got {cpu_attention!r}")
        self.cpu_attention = cpu_attention
        self.max_seq_len = max_seq_len
        self._lib_kwargs = dict(
            num_layers=self.shape.num_layers,
            num_kv_heads=self.shape.num_kv_heads,
            head_dim=self.shape.head_dim,
            preset=preset,
            window=window,
            sink_tokens=sink_tokens,
            dtype=dtype,
            scale_dtype=scale_dtype,
            sinkhorn_iters=sinkhorn_iters,
            max_seq_len=max_seq_len,
            quantizer=quantizer,
        )
        # Validate every library argument now (a tiny probe cache on the CPU), not at the first forward.
        LibraryCache(batch_size=1, device="cpu", **{**self._lib_kwargs, "num_layers": 1, "max_seq_len": None})
        if max_seq_len is not None and (isinstance(max_seq_len, bool) or not isinstance(max_seq_len, int) or max_seq_len < 1):
            raise ValueError(f"max_seq_len must be a positive int or None, got {max_seq_len!r}")
        self.device = None if device is None else torch.device(device)
        self.library: LibraryCache | None = None
        self.dequantized = None
        self._deferring: contextlib.ExitStack | None = None  # open deferred_checks block, if any
        self._overlap_appends = False  # that block's overlap_appends
        super().__init__(layers=[KVarNLayer(self, i) for i in range(self.shape.num_layers)])

    # --- library cache ------------------------------------------------------------------------
    def _ensure_library(self, key_states: torch.Tensor) -> None:
        if self.library is not None:
            if key_states.shape[0] != self.library.batch_size:
                raise ValueError(
                    f"KVarNCache holds batch size {self.library.batch_size}, got keys of batch {key_states.shape[0]}"
                )
            return
        device = self.device if self.device is not None else key_states.device
        self.library = LibraryCache(batch_size=key_states.shape[0], device=device, **self._lib_kwargs)
        if self.cpu_attention == "dequant":
            from .dispatch import DequantizedTiles

            self.dequantized = DequantizedTiles()
        if self._deferring is not None:  # created inside a deferred_checks block: it joins the block
            self._deferring.enter_context(self.library.deferred_checks(self._overlap_appends))

    @contextlib.contextmanager
    def deferred_checks(self, overlap_appends: bool = False):
        """The library's :meth:`kvarn_cutlass.KVarNCache.deferred_checks` for a block of forward passes
        (what :func:`kvarn_cutlass.hf.prefill.prefill` runs its chunks in): no host synchronization per
        layer and chunk; a failed check raises when the block ends, with the cache as it was at its
        start (a library first created inside the block is dropped again). A block opened inside an
        open one joins it (its checks happen when the outer block ends). ``overlap_appends``: the
        library's option of that name (appends on the cache's second stream, overlapping the rest of
        the forward pass)."""
        if not isinstance(overlap_appends, bool):
            raise TypeError(f"overlap_appends must be a bool, got {type(overlap_appends).__name__}")
        if self._deferring is not None:
            yield self
            return
        existed = self.library is not None
        self._overlap_appends = overlap_appends
        try:
            with contextlib.ExitStack() as stack:
                self._deferring = stack
                if existed:
                    stack.enter_context(self.library.deferred_checks(overlap_appends))
                yield self
        except BaseException:
            self._deferring = None
            if existed:
                for layer in self.layers:  # a forward cut short leaves updates its attention never read
                    layer._pending = None
                if self.dequantized is not None:  # decoded tiles past the restored length are stale
                    from .dispatch import DequantizedTiles

                    self.dequantized = DequantizedTiles()
            else:
                self.reset()
            raise
        self._deferring = None

    @property
    def preset(self) -> str:
        return self._lib_kwargs["preset"]

    @property
    def window(self) -> int:
        return self._lib_kwargs["window"]

    @property
    def quantizer(self) -> str:
        return self._lib_kwargs["quantizer"]

    @property
    def spec(self):
        from ..format import TileSpec

        k = self._lib_kwargs
        return TileSpec(k["preset"], k["head_dim"], k["scale_dtype"], k["sinkhorn_iters"], k["quantizer"])

    def nbytes(self) -> int:
        return 0 if self.library is None else self.library.nbytes()

    def reset(self) -> None:
        for layer in self.layers:
            layer.reset()
        self.library = None
        self.dequantized = None

    def __repr__(self) -> str:
        k = self._lib_kwargs
        return (
            f"kvarn_cutlass.hf.KVarNCache(layers={k['num_layers']}, preset={k['preset']!r}, "
            f"quantizer={k['quantizer']!r}, window={k['window']}, "
            f"sink={k['sink_tokens']}, seq_len={self.get_seq_length()})"
        )
