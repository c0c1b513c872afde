"""kvtier.hf: a Hugging Face transformers adapter — a ``Cache`` whose K/V live in kvtier
sequences, and an attention function, registered in transformers' attention interface, that
runs kvtier's attention for the decode steps.

    import kvtier.hf
    from transformers import AutoModelForCausalLM
    kvtier.hf.register()                                   # the attention function "kvtier"
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="kvtier")
    # (or, on a loaded model: model.set_attn_implementation("kvtier"), or
    #  model.config._attn_implementation = "kvtier")
    cache = kvtier.hf.KvtierCache(model.config, mode="speculative", budget_tokens=512)
    out = model.generate(input_ids, past_key_values=cache, max_new_tokens=64, do_sample=False)
    print(cache.correction_rate(), cache.stats()["recalled_pages"])

Targeted API: transformers 5.x (read from huggingface/transformers' main branch of the 5.x
series: ``src/transformers/cache_utils.py`` — ``Cache(layers=..., layer_class_to_replicate=...)``
whose ``update(key_states, value_states, layer_idx, *args, **kwargs)`` dispatches to
``CacheLayerMixin`` layers (``lazy_initialization(key_states, value_states)``, ``update``,
``get_seq_length()``, ``get_mask_sizes(query_length)`` — ``(cache_position)`` in 4.56–5.0 —,
``get_max_length()`` — ``get_max_cache_shape()`` before —, ``reorder_cache``, ``crop``,
``batch_repeat_interleave``, ``batch_select_indices``, ``reset``, ``is_compileable``);
``integrations/sdpa_attention.py`` — an attention function is ``(module, query, key, value,
attention_mask, dropout=0.0, scaling=None, **kwargs) -> (attn_output [B, T, Hq, d],
attn_weights)`` with query [B, Hq, T, d] and key/value [B, Hkv, S, d];
``modeling_utils.AttentionInterface.register(name, fn)`` and
``masking_utils.AttentionMaskInterface.register(name, sdpa_mask)`` (without a registered mask
function transformers passes ``attention_mask=None``); ``models/llama/modeling_llama.py`` —
``LlamaAttention`` calls ``past_key_values.update(key_states, value_states, self.layer_idx)``
after RoPE and hands what it returns to ``ALL_ATTENTION_FUNCTIONS.get_interface(
config._attn_implementation, eager_attention_forward)``). Both signatures that changed within
the series (get_mask_sizes, get_max_length) are accepted.

How it works, per layer (``_KvtierLayerState``):
  * prefill — a step of T > 1 tokens into an empty layer: the prompt's K/V are appended to
    kvtier (one kvtier sequence per batch row: a ``kvtier.Sequence`` for one row, members of a
    ``kvtier.Batch`` for several) and returned as they are, so the model's own causal attention
    (transformers' SDPA) runs over the prompt;
  * decode — a step of one token: its K/V are appended; the K returned carries a mark naming
    the layer, and the registered attention function, finding it, runs kvtier's attention of
    q over the layer's working set (``Sequence.decode``; the batch step protocol for several
    rows) and returns [B, 1, Hq, d]. Without the mark (any other cache) the attention function
    is transformers' SDPA.
Layouts: transformers holds [B, H, T, d]; kvtier appends NHD [T][Hkv][d] per row and takes q
and out [Hq][d] ([n][Hq][d] for a batch). Nothing is converted: dtype and device are the
model's (the cache's kvtier geometry takes the first K's dtype, or the one given, and refuses
another).

Refused, with ValueError / NotImplementedError / RuntimeError saying what and why: beam search
and every other batch reordering (reorder_cache, batch_repeat_interleave and
batch_select_indices on a filled cache), crop (assisted decoding, contrastive search) that
would drop tokens, a second multi-token step after the prefill (chunked prefill, continuing a
conversation), torch.compile (``is_compileable`` is False, and an update while compiling
raises), padded batches at the first decode step (kvtier attends every token it holds), a
softmax scale other than 1/sqrt(head_dim) (kvtier's), dropout, a dtype or device other than
the cache's, a batch size that changes, sliding-window or non-attention layers, and a model
whose attention is not "kvtier" (the decode step's output would be attention over one token).

This module imports without transformers (and without torch): ``KvtierCacheCore`` and
``attention_forward`` carry the logic and are what the tests drive; ``KvtierCache``,
``KvtierLayer`` and ``register`` exist when transformers is importable (``HAVE_TRANSFORMERS``),
and otherwise raise ImportError saying so.
"""

from __future__ import annotations

import dataclasses
import math
import weakref
from typing import Any, Dict, List, Optional, Tuple

import kvtier
from kvtier.local import _DEFAULT_STREAMS

ATTN_IMPLEMENTATION = "kvtier"
_MARK = "_kvtier_layer"  # the attribute a decode step's returned K carries

_GEOMETRY_DTYPES = ("float16", "bfloat16", "float32")


def _torch():
    try:
        import torch
    except ImportError as e:  # pragma: no cover - exercised where torch is absent
        raise ImportError("kvtier.hf needs torch: %s" % e) from None
    return torch


def _dtype_name(dtype: Any) -> str:
    """'float16' for torch.float16 (and for the string itself)."""
    if isinstance(dtype, str):
        return dtype
    return str(dtype).replace("torch.", "")


def _is_compiling() -> bool:
    torch = _torch()
    for probe in (getattr(getattr(torch, "compiler", None), "is_compiling", None),
                  getattr(getattr(torch, "_dynamo", None), "is_compiling", None)):
        if probe is not None:
            try:
                return bool(probe())
            except Exception:  # noqa: BLE001 - an old torch's probe
                return False
    return False


def geometry_from_config(config: Any) -> Dict[str, int]:
    """num_layers, num_q_heads, num_kv_heads and head_dim of a transformers decoder config
    (LlamaConfig and the like: any object with those attributes); refuses layer types kvtier
    does not hold (sliding-window, chunked, linear attention)."""
    get_text = getattr(config, "get_text_config", None)
    if callable(get_text):
        try:
            config = get_text(decoder=True)
        except TypeError:
            config = get_text()
    layers = int(config.num_hidden_layers)
    q_heads = int(config.num_attention_heads)
    kv_heads = getattr(config, "num_key_value_heads", None) or q_heads
    head_dim = getattr(config, "head_dim", None) or int(config.hidden_size) // q_heads
    if getattr(config, "sliding_window", None) is not None and \
            getattr(config, "use_sliding_window", True) is not False:
        raise NotImplementedError(
            "kvtier.hf: sliding_window = %r: kvtier holds full-attention layers only"
            % (config.sliding_window,))
    types = getattr(config, "layer_types", None)
    if types:
        other = sorted(set(t for t in types if t != "full_attention"))
        if other:
            raise NotImplementedError(
                "kvtier.hf: layer_types %s: kvtier holds full-attention layers only" % other)
    return dict(num_layers=layers, num_q_heads=q_heads, num_kv_heads=int(kv_heads),
                head_dim=int(head_dim))


class _KvtierLayerState:
    """One layer of a KvtierCacheCore: the prefill / decode state machine over the core's
    kvtier sequences (one per batch row)."""

    def __init__(self, core: "KvtierCacheCore", layer: int):
        # Weak: no reference cycle through the core, whose kvtier sequences must be freed
        # before their device (the garbage collector finalizes a cycle in any order).
        self._core = weakref.ref(core)
        self.layer = layer
        self.num_tokens = 0        # tokens appended, the same for every row
        self.pending = False       # a decode step appended, its attention not run yet
        self.steps = 0             # decode steps attended through kvtier
        # The temporaries handed to kvtier at this layer's last step (the NHD copies of K/V,
        # the step's q): on CUDA its background selection and recall may read them after the
        # call returned, on its own stream, so they live until the layer's next step.
        self._keep: Tuple[Any, ...] = ()

    @property
    def core(self) -> "KvtierCacheCore":
        core = self._core()
        if core is None:
            raise RuntimeError("kvtier.hf: layer %d: its KvtierCacheCore was freed" % self.layer)
        return core

    # -- what transformers asks ----------------------------------------------------------
    def get_seq_length(self) -> int:
        return self.num_tokens

    def get_mask_sizes(self, query: Any) -> Tuple[int, int]:
        """(kv_length, kv_offset) for a step of `query` tokens: an int (transformers 5.x), or
        the step's cache_position tensor (4.56–5.0)."""
        shape = getattr(query, "shape", None)
        q = int(shape[0]) if shape is not None and len(shape) >= 1 else int(query)
        return self.num_tokens + q, 0

    def get_max_length(self) -> int:
        return self.core.max_tokens

    # -- the step --------------------------------------------------------------------------
    def update(self, key_states: Any, value_states: Any) -> Tuple[Any, Any]:
        """Appends key/value_states [B, Hkv, T, d] to the layer's kvtier sequences. Prefill
        (T > 1 into an empty layer): returns them, for the model's own causal attention over
        the prompt. Decode (T == 1): returns them marked, for attention_forward to run
        kvtier's attention."""
        core = self.core
        if _is_compiling():
            raise RuntimeError("kvtier.hf: KvtierCache cannot be traced by torch.compile "
                               "(its K/V live in kvtier, behind ctypes calls): generate "
                               "without compiling (is_compileable is False)")
        if self.pending:
            raise RuntimeError(
                "kvtier.hf: layer %d: the previous decode step's attention did not run through "
                "kvtier's attention function (its output attended one token); load the model "
                "with attn_implementation=%r after kvtier.hf.register()"
                % (self.layer, core.attn_implementation))
        core._check_kv("key_states", key_states, core.num_kv_heads)
        core._check_kv("value_states", value_states, core.num_kv_heads)
        if tuple(value_states.shape) != tuple(key_states.shape):
            raise ValueError("kvtier.hf: value_states %s: expected the shape of key_states %s"
                             % (list(value_states.shape), list(key_states.shape)))
        batch, _, t, _ = (int(x) for x in key_states.shape)
        if t < 1:
            # transformers' early_initialization: an empty step fixes dtype, device and rows
            core._ensure(batch, key_states)
            return key_states, value_states
        if t > 1 and self.num_tokens > 0:
            raise NotImplementedError(
                "kvtier.hf: layer %d: a step of %d tokens after %d: kvtier takes one prefill "
                "and then one token per step (no chunked prefill, no continuing a finished "
                "generation, no assisted decoding); start a new KvtierCache"
                % (self.layer, t, self.num_tokens))
        if t == 1:
            core._check_attn_implementation()
        core._ensure(batch, key_states)
        # [Hkv, T, d] -> NHD [T, Hkv, d], contiguous (a copy: transformers' layout is HND)
        keep = []
        for row in range(batch):
            keep += [key_states[row].transpose(0, 1).contiguous(),
                     value_states[row].transpose(0, 1).contiguous()]
        current = core._enter()
        for row, seq in enumerate(core.sequences):
            seq.append(self.layer, keep[2 * row], keep[2 * row + 1])
        core._leave(current)
        self._keep = tuple(keep)
        self.num_tokens += t
        if t > 1:
            return key_states, value_states
        self.pending = True
        marked = key_states.view_as(key_states)
        setattr(marked, _MARK, self)
        return marked, value_states

    def attend(self, query: Any, attention_mask: Any = None, scaling: Optional[float] = None,
               dropout: float = 0.0) -> Tuple[Any, None]:
        """kvtier's attention of the decode step's query [B, Hq, 1, d] over each row's working
        set: returns ([B, 1, Hq, d], None), transformers' attention output layout."""
        torch = _torch()
        core = self.core
        if not self.pending:
            raise RuntimeError("kvtier.hf: layer %d: attention without a decode step "
                               "appended (update) before it" % self.layer)
        self.pending = False
        g = core.geometry
        if dropout:
            raise ValueError("kvtier.hf: dropout = %r: kvtier's attention is inference only"
                             % (dropout,))
        if scaling is not None and not math.isclose(float(scaling), g.head_dim ** -0.5,
                                                    rel_tol=1e-6):
            raise NotImplementedError(
                "kvtier.hf: scaling = %r: kvtier's attention scales by 1/sqrt(head_dim) = %r"
                % (scaling, g.head_dim ** -0.5))
        shape = tuple(int(x) for x in getattr(query, "shape", ()))
        if len(shape) != 4 or shape[1] != g.num_q_heads or shape[2] != 1 or \
                shape[3] != g.head_dim or shape[0] != len(core.sequences):
            raise ValueError("kvtier.hf: query %s: expected [%d, %d, 1, %d] (B, Hq, T, d)"
                             % (list(shape), len(core.sequences), g.num_q_heads, g.head_dim))
        core._check_tensor("query", query)
        if attention_mask is not None and not _attends_everything(attention_mask):
            raise NotImplementedError(
                "kvtier.hf: the decode step's attention mask hides tokens (a padded batch): "
                "kvtier attends every token a sequence holds; generate rows of equal length, "
                "or one row at a time")
        q = query[:, :, 0, :].contiguous()      # [B, Hq, d]
        out = torch.empty_like(q)
        current = core._enter()
        if len(core.sequences) == 1:
            core.sequences[0].decode(self.layer, q[0], out[0])
        else:
            members = core.sequences
            core.batch.begin_step(self.layer, members, q)
            core.batch.attend(self.layer, members, q, out)
            core.batch.end_step(self.layer, members, q)
        core._leave(current)
        self._keep += (q, out)
        self.steps += 1
        return out.unsqueeze(1), None           # [B, 1, Hq, d]

    # -- refusals ------------------------------------------------------------------------
    def reorder_cache(self, beam_idx: Any) -> None:
        raise NotImplementedError(
            "kvtier.hf: reorder_cache (beam search): a kvtier sequence's K/V cannot be copied "
            "to another row; use greedy or sampled decoding (num_beams=1)")

    def batch_repeat_interleave(self, repeats: int) -> None:
        if int(repeats) == 1 or (self.num_tokens == 0 and self.core.sequences is None):
            return
        raise NotImplementedError(
            "kvtier.hf: batch_repeat_interleave(%d) (beam search, num_return_sequences, "
            "contrastive search): kvtier sequences cannot be duplicated" % int(repeats))

    def batch_select_indices(self, indices: Any) -> None:
        if self.core.sequences is None:
            return
        idx = [int(i) for i in (indices.tolist() if hasattr(indices, "tolist") else indices)]
        if idx == list(range(len(self.core.sequences))):
            return
        raise NotImplementedError(
            "kvtier.hf: batch_select_indices(%s): kvtier sequences cannot be reordered or "
            "dropped from the batch" % idx)

    def crop(self, max_length: int) -> None:
        keep = int(max_length)
        if keep < 0:
            keep = self.num_tokens - abs(keep)
        if self.num_tokens <= keep:
            return
        raise NotImplementedError(
            "kvtier.hf: crop to %d of %d tokens (assisted decoding, contrastive search): kvtier "
            "does not drop appended tokens" % (keep, self.num_tokens))


def _attends_everything(mask: Any) -> bool:
    """A 4D attention mask, boolean (True: attend) or additive (0: attend), that hides
    nothing."""
    torch = _torch()
    if not hasattr(mask, "dtype"):
        return False   # a BlockMask or another kind: not one kvtier can honour
    if mask.dtype == torch.bool:
        return bool(mask.all())
    return bool((mask == 0).all())


class KvtierCacheCore:
    """The K/V of a model's layers in kvtier sequences, transformers-free: ``layers[i]`` is
    layer i's state machine (``_KvtierLayerState``). The kvtier sequences are made at the first
    update, one per batch row, with the dtype and device of its K (or `dtype` / `device` when
    given, which the model's tensors must then match).

    mode, budget_tokens, max_tokens, tau, trigger, max_loss, recall, capture_graphs and the
    drop-style policies (budget_policy, residency_policy, host_drop, policy_params; those that
    read attention see kvtier's, which the "kvtier" attention computes): kvtier's
    SequenceOptions; page_size: the geometry's; device: a kvtier.Device, "cpu", "cuda", or None
    (the first K's); stream: on CUDA the stream to adopt (default: torch's current stream when
    the sequences are made, so kvtier's work is ordered with the model's)."""

    def __init__(self, num_layers: int, num_q_heads: int, num_kv_heads: int, head_dim: int, *,
                 mode: str = "speculative", budget_tokens: int = 2048,
                 max_tokens: int = 131072, page_size: int = 32, dtype: Any = None,
                 device: Any = None, tau: float = 0.7, trigger: str = "cosine",
                 max_loss: float = 0.1, recall: str = "auto", capture_graphs: bool = False,
                 stream: Any = None, config: Any = None,
                 attn_implementation: str = ATTN_IMPLEMENTATION, budget_policy: str = "fixed",
                 residency_policy: str = "none", host_drop: str = "refuse",
                 policy_params: Optional[Dict[str, Any]] = None):
        if num_q_heads % num_kv_heads:
            raise ValueError("kvtier.hf: num_q_heads %d is not a multiple of num_kv_heads %d"
                             % (num_q_heads, num_kv_heads))
        if dtype is not None and _dtype_name(dtype) not in _GEOMETRY_DTYPES:
            raise ValueError("kvtier.hf: dtype %s: kvtier holds %s"
                             % (_dtype_name(dtype), ", ".join(_GEOMETRY_DTYPES)))
        self.num_layers, self.num_q_heads = int(num_layers), int(num_q_heads)
        self.num_kv_heads, self.head_dim = int(num_kv_heads), int(head_dim)
        self.page_size = int(page_size)
        self.max_tokens = int(max_tokens)
        self.dtype = self._dtype_arg = None if dtype is None else _dtype_name(dtype)
        self.options = kvtier.SequenceOptions(
            mode=mode, budget_tokens=budget_tokens, max_tokens=max_tokens, tau=tau,
            trigger=trigger, max_loss=max_loss, recall=recall, capture_graphs=capture_graphs,
            stream=stream, budget_policy=budget_policy, residency_policy=residency_policy,
            host_drop=host_drop, policy_params=dict(policy_params or {}))
        self._device_arg = device
        self.device: Optional[kvtier.Device] = device if isinstance(device, kvtier.Device) \
            else None
        self.config = config
        self.attn_implementation = attn_implementation
        self.geometry: Optional[kvtier.LocalGeometry] = None
        self.batch: Optional[kvtier.Batch] = None
        self.sequences: Optional[List[kvtier.Sequence]] = None
        self.torch_device = None
        self._kv_stream = None      # kvtier's CUDA stream, as torch sees it
        self.layers = [_KvtierLayerState(self, i) for i in range(self.num_layers)]

    @classmethod
    def from_config(cls, config: Any, **options: Any) -> "KvtierCacheCore":
        """A core for a transformers decoder config; max_tokens defaults to the config's
        max_position_embeddings."""
        if "max_tokens" not in options and getattr(config, "max_position_embeddings", None):
            options["max_tokens"] = int(config.max_position_embeddings)
        return cls(**geometry_from_config(config), config=config, **options)

    # -- state ---------------------------------------------------------------------------
    @property
    def batch_size(self) -> int:
        if self.sequences is None:
            raise AttributeError("batch_size: the cache has not seen a step yet")
        return len(self.sequences)

    @property
    def initialized(self) -> bool:
        return self.sequences is not None

    def get_seq_length(self, layer: int = 0) -> int:
        return self.layers[layer].get_seq_length() if layer < self.num_layers else 0

    def get_mask_sizes(self, query: Any, layer: int = 0) -> Tuple[int, int]:
        return self.layers[layer].get_mask_sizes(query)

    def stats(self) -> Dict[str, int]:
        """kvtier's counters summed over the rows' sequences (after waiting for their work)."""
        total: Dict[str, int] = {}
        for seq in self.sequences or []:
            seq.wait()
            for k, v in seq.stats().items():
                total[k] = total.get(k, 0) + v
        return total

    def correction_rate(self) -> float:
        s = self.stats()
        return s["corrected_heads"] / s["checked_heads"] if s.get("checked_heads") else 0.0

    def reset(self) -> None:
        """Drops the sequences: the next update starts an empty cache (a new batch size,
        dtype and device allowed)."""
        self.close()
        self.sequences, self.batch, self.geometry, self.torch_device = None, None, None, None
        self._kv_stream = None
        self.dtype = self._dtype_arg
        if self._device_arg is None:
            self.device = None
        for state in self.layers:
            state.num_tokens, state.pending, state.steps, state._keep = 0, False, 0, ()

    def close(self) -> None:
        for seq in self.sequences or []:
            if seq._h is not None:
                seq.close()

    def __del__(self):
        # The rows' sequences (then a batch of several's handle) before anything else of the
        # core goes, so that none outlives the kvtier device it was made on.
        for seq in getattr(self, "sequences", None) or []:
            seq.__del__()
        batch = getattr(self, "batch", None)
        if batch is not None:
            batch.__del__()

    # -- checks and the lazy start -------------------------------------------------------
    def _check_attn_implementation(self) -> None:
        impl = getattr(self.config, "_attn_implementation", None) if self.config is not None \
            else None
        if isinstance(impl, str) and impl != self.attn_implementation:
            raise ValueError(
                "kvtier.hf: the model's attention is %r: a KvtierCache needs %r (after "
                "kvtier.hf.register(): from_pretrained(..., attn_implementation=%r) or "
                "model.set_attn_implementation(%r)), else a decode step attends one token"
                % (impl, self.attn_implementation, self.attn_implementation,
                   self.attn_implementation))

    def _check_kv(self, name: str, t: Any, heads: int) -> None:
        shape = tuple(int(x) for x in getattr(t, "shape", ()))
        if len(shape) != 4 or shape[1] != heads or shape[3] != self.head_dim:
            raise ValueError("kvtier.hf: %s %s: expected [B, %d, T, %d] (transformers' "
                             "[batch, kv heads, tokens, head_dim])"
                             % (name, list(shape), heads, self.head_dim))
        if self.sequences is not None:
            self._check_tensor(name, t)

    def _check_tensor(self, name: str, t: Any) -> None:
        """t's dtype and device are the cache's (once the sequences exist)."""
        got = _dtype_name(t.dtype)
        if self.dtype is not None and got != self.dtype:
            raise ValueError("kvtier.hf: %s is %s, the cache holds %s: run the model in %s, or "
                             "make the cache with dtype=%r" % (name, got, self.dtype, self.dtype,
                                                               got))
        if self.torch_device is not None and t.device != self.torch_device:
            raise ValueError("kvtier.hf: %s is on %s, the cache's kvtier sequences on %s"
                             % (name, t.device, self.torch_device))

    def _ensure(self, batch: int, k: Any) -> None:
        """Makes the rows' kvtier sequences at the first step (dtype, device and batch size
        from k), or checks that a later step has the same batch size."""
        if self.sequences is not None:
            if batch != len(self.sequences):
                raise ValueError(
                    "kvtier.hf: a step of batch %d, the cache holds %d rows: the batch cannot "
                    "change (beam search, num_return_sequences) — reset() the cache first"
                    % (batch, len(self.sequences)))
            return
        torch = _torch()
        got = _dtype_name(k.dtype)
        if got not in _GEOMETRY_DTYPES:
            raise ValueError("kvtier.hf: key_states are %s: kvtier holds %s"
                             % (got, ", ".join(_GEOMETRY_DTYPES)))
        if self.dtype is not None and got != self.dtype:
            raise ValueError("kvtier.hf: key_states are %s, the cache was made for %s: run the "
                             "model in %s, or make the cache with dtype=%r"
                             % (got, self.dtype, self.dtype, got))
        kind = k.device.type
        if kind not in ("cpu", "cuda"):
            raise ValueError("kvtier.hf: key_states on %s: kvtier's devices are cpu and cuda"
                             % (k.device,))
        if self.device is None:
            self.device = kvtier.Device(self._device_arg if isinstance(self._device_arg, str)
                                        else kind)
        if self.device.kind != kind:
            raise ValueError("kvtier.hf: key_states on %s, the cache's kvtier device is %s"
                             % (k.device, self.device.kind))
        if kind == "cuda" and k.device.index is not None and \
                k.device.index != torch.cuda.current_device():
            raise ValueError("kvtier.hf: key_states on %s, not the current CUDA device %d "
                             "kvtier's device uses" % (k.device, torch.cuda.current_device()))
        if batch < 1:
            raise ValueError("kvtier.hf: a batch of %d rows" % batch)
        options = self.options
        if kind == "cuda" and options.stream is None:
            current = torch.cuda.current_stream()
            # torch's default stream (cuda_stream 0) cannot be adopted: kvtier then makes its
            # own, and every call is ordered with torch's stream by events (_enter / _leave).
            if int(current.cuda_stream) not in _DEFAULT_STREAMS:
                options = dataclasses.replace(options, stream=current)
        self.options = options
        self.dtype = got
        self.torch_device = k.device
        self.geometry = kvtier.LocalGeometry(self.num_layers, self.num_q_heads,
                                             self.num_kv_heads, self.head_dim, self.page_size,
                                             got)
        if batch == 1:
            seq = kvtier.Sequence(self.device, self.geometry, options)
            self.batch, self.sequences = seq.batch, [seq]
        else:
            self.batch = kvtier.Batch(self.device, self.geometry, options, max_batch=batch)
            self.sequences = [self.batch.add() for _ in range(batch)]
        self._kv_stream = torch.cuda.ExternalStream(self.batch.native_stream, device=k.device) \
            if kind == "cuda" else None

    # -- ordering with torch's stream (CUDA) -----------------------------------------------
    def _enter(self) -> Any:
        """Before a kvtier call on CUDA: kvtier's stream waits for torch's current one (the
        tensors kvtier is about to read were written there). Returns that stream for _leave,
        or None where there is nothing to order (the CPU, or torch's stream is kvtier's)."""
        if self._kv_stream is None:
            return None
        torch = _torch()
        current = torch.cuda.current_stream(self.torch_device)
        if int(current.cuda_stream) == int(self._kv_stream.cuda_stream):
            return None
        self._kv_stream.wait_stream(current)
        return current

    def _leave(self, current: Any) -> None:
        """After it: torch's stream waits for kvtier's (what kvtier wrote, and the reuse of the
        tensors it read)."""
        if current is not None:
            current.wait_stream(self._kv_stream)


def torch_attention(module: Any, query: Any, key: Any, value: Any, attention_mask: Any,
                    scaling: Optional[float] = None, dropout: float = 0.0,
                    is_causal: Optional[bool] = None, **kwargs: Any) -> Tuple[Any, None]:
    """Plain attention in transformers' convention (query [B, Hq, T, d], key/value
    [B, Hkv, S, d] -> [B, T, Hq, d]), computed in float32: what the prefill runs where
    transformers' SDPA is not importable. A 4D mask (bool: attend, or additive) when given,
    else causal for T > 1 (the last T of S positions)."""
    torch = _torch()
    b, hq, t, d = query.shape
    hkv, s = key.shape[1], key.shape[2]
    k = key.float().repeat_interleave(hq // hkv, dim=1)
    v = value.float().repeat_interleave(hq // hkv, dim=1)
    scale = d ** -0.5 if scaling is None else scaling
    scores = (query.float() @ k.transpose(-1, -2)) * scale          # [B, Hq, T, S]
    if attention_mask is not None:
        m = attention_mask[..., :s]
        scores = scores.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else scores + m
    elif t > 1 and (is_causal if is_causal is not None else getattr(module, "is_causal", True)):
        causal = torch.ones(t, s, dtype=torch.bool, device=query.device).tril(s - t)
        scores = scores.masked_fill(~causal, float("-inf"))
    p = torch.softmax(scores, dim=-1)
    out = (p @ v).to(query.dtype)                                   # [B, Hq, T, d]
    return out.transpose(1, 2).contiguous(), None


def _prefill_attention() -> Any:
    """transformers' SDPA attention function where transformers is importable, else
    torch_attention."""
    try:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        return sdpa_attention_forward
    except ImportError:
        return torch_attention


def attention_forward(module: Any, query: Any, key: Any, value: Any, attention_mask: Any,
                      scaling: Optional[float] = None, dropout: float = 0.0,
                      **kwargs: Any) -> Tuple[Any, Any]:
    """The attention function kvtier registers (transformers' signature): kvtier's attention
    for a decode step of a KvtierCache (the K its update returned is marked), the model's
    own attention (SDPA) for everything else — the prefill, and any other cache."""
    state = getattr(key, _MARK, None)
    if state is None:
        return _prefill_attention()(module, query, key, value, attention_mask,
                                    dropout=dropout, scaling=scaling, **kwargs)
    layer = getattr(module, "layer_idx", None)
    if layer is not None and int(layer) != state.layer:
        raise RuntimeError("kvtier.hf: attention of layer %d given the decode step of layer %d"
                           % (int(layer), state.layer))
    return state.attend(query, attention_mask, scaling, dropout)


# ---------------------------------------------------------------- transformers' classes
def _build_transformers_adapter():
    """KvtierLayer, KvtierCache and register, over the importable transformers (ImportError
    without it)."""
    from transformers.cache_utils import Cache, CacheLayerMixin

    class KvtierLayer(CacheLayerMixin):
        """transformers' cache layer over a _KvtierLayerState: K/V never held in torch."""

        is_compileable = False
        is_sliding = False
        supports_early_init = True

        def __init__(self, state: _KvtierLayerState):
            self.state = state
            super().__init__()

        # transformers sets these in CacheLayerMixin.__init__; they follow the state.
        @property
        def is_initialized(self) -> bool:
            return self.state.core.initialized

        @is_initialized.setter
        def is_initialized(self, value: bool) -> None:
            pass

        @property
        def batch_size(self) -> int:
            return self.state.core.batch_size

        @property
        def dtype(self):
            name = self.state.core.dtype
            return None if name is None else getattr(_torch(), name)

        @property
        def device(self):
            return self.state.core.torch_device

        def __repr__(self) -> str:
            return "KvtierLayer(layer=%d, tokens=%d)" % (self.state.layer,
                                                        self.state.num_tokens)

        def lazy_initialization(self, key_states, value_states=None) -> None:
            self.state.core._ensure(int(key_states.shape[0]), key_states)

        def update(self, key_states, value_states, *args, **kwargs):
            return self.state.update(key_states, value_states)

        def get_mask_sizes(self, query_length_or_cache_position) -> Tuple[int, int]:
            return self.state.get_mask_sizes(query_length_or_cache_position)

        def get_seq_length(self, *args) -> int:
            return self.state.get_seq_length()

        def get_max_length(self) -> int:
            return self.state.get_max_length()

        def get_max_cache_shape(self) -> int:
            return self.state.get_max_length()

        def reorder_cache(self, beam_idx) -> None:
            self.state.reorder_cache(beam_idx)

        def crop(self, max_length: int) -> None:
            self.state.crop(max_length)

        def batch_repeat_interleave(self, repeats: int) -> None:
            self.state.batch_repeat_interleave(repeats)

        def batch_select_indices(self, indices) -> None:
            self.state.batch_select_indices(indices)

        def reset(self) -> None:
            self.state.core.reset()

        def offload(self) -> None:
            raise NotImplementedError("kvtier.hf: offloading: kvtier's host tier is the "
                                      "offload (KvtierCache takes no offloading option)")

        def prefetch(self) -> None:
            self.offload()

    class KvtierCache(Cache):
        """A transformers Cache whose K/V live in kvtier sequences (one per batch row):
        ``model.generate(ids, past_key_values=KvtierCache(model.config, mode=...))`` with the
        model's attention set to "kvtier" (register()). Options: those of KvtierCacheCore
        (mode "full", "speculative", "sync" or "drop"; budget_tokens; max_tokens, default the
        config's max_position_embeddings; page_size; dtype; device; tau; ...)."""

        def __init__(self, config: Any = None, **options: Any):
            if config is not None:
                core = KvtierCacheCore.from_config(config, **options)
            else:
                core = KvtierCacheCore(**options)
            self.core = core
            layers = [KvtierLayer(state) for state in core.layers]
            try:
                super().__init__(layers=layers)
            except TypeError:  # a transformers whose Cache takes no layers (before 4.56)
                super().__init__()
                self.layers = layers

        def __len__(self) -> int:
            return len(self.layers)

        def __repr__(self) -> str:
            return "KvtierCache(mode=%s, layers=%d, tokens=%d)" % (
                self.core.options.mode, self.core.num_layers, self.core.get_seq_length(0))

        @property
        def is_compileable(self) -> bool:
            return False

        @property
        def is_initialized(self) -> bool:
            return self.core.initialized

        @property
        def batch_size(self) -> int:
            return self.core.batch_size if self.core.initialized else -1

        def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
            if not 0 <= int(layer_idx) < self.core.num_layers:
                raise ValueError("kvtier.hf: layer_idx %d of a cache of %d layers"
                                 % (int(layer_idx), self.core.num_layers))
            return self.layers[layer_idx].update(key_states, value_states)

        def get_seq_length(self, layer_idx: Optional[int] = 0, *args) -> int:
            return self.core.get_seq_length(0 if layer_idx is None else int(layer_idx))

        def get_mask_sizes(self, query_length_or_cache_position, layer_idx: int = 0,
                           *args) -> Tuple[int, int]:
            return self.core.get_mask_sizes(query_length_or_cache_position, int(layer_idx))

        def get_max_length(self, layer_idx: Optional[int] = None) -> int:
            return self.core.max_tokens

        def get_max_cache_shape(self, layer_idx: int = 0) -> int:
            return self.core.max_tokens

        def reorder_cache(self, beam_idx) -> None:
            self.core.layers[0].reorder_cache(beam_idx)

        def crop(self, max_length: int) -> None:
            for state in self.core.layers:
                state.crop(max_length)

        def batch_repeat_interleave(self, repeats: int) -> None:
            for state in self.core.layers:
                state.batch_repeat_interleave(repeats)

        def batch_select_indices(self, indices) -> None:
            for state in self.core.layers:
                state.batch_select_indices(indices)

        def reset(self) -> None:
            self.core.reset()

        def stats(self) -> Dict[str, int]:
            return self.core.stats()

        def correction_rate(self) -> float:
            return self.core.correction_rate()

        @property
        def sequences(self):
            return self.core.sequences

    def register(name: str = ATTN_IMPLEMENTATION) -> str:
        """Registers attention_forward under `name` in transformers' AttentionInterface, and
        SDPA's mask function under the same name (without one transformers passes no mask at
        all); then ``from_pretrained(..., attn_implementation=name)``,
        ``model.set_attn_implementation(name)`` or ``model.config._attn_implementation =
        name``."""
        from transformers import AttentionInterface
        AttentionInterface.register(name, attention_forward)
        try:
            from transformers import AttentionMaskInterface
            from transformers.masking_utils import sdpa_mask
        except ImportError:  # a transformers before the mask interface (the mask is SDPA's)
            return name
        AttentionMaskInterface.register(name, sdpa_mask)
        return name

    return KvtierLayer, KvtierCache, register


def _missing(what: str, error: str):
    def missing(*args: Any, **kwargs: Any) -> Any:
        raise ImportError("kvtier.hf.%s needs transformers (pip install 'transformers>=5'): %s"
                          % (what, error))
    return missing


try:
    KvtierLayer, KvtierCache, register = _build_transformers_adapter()
    HAVE_TRANSFORMERS = True
    TRANSFORMERS_ERROR = ""
except ImportError as _e:  # transformers (or torch) not importable: the core only
    HAVE_TRANSFORMERS = False
    TRANSFORMERS_ERROR = str(_e)
    KvtierLayer = _missing("KvtierLayer", TRANSFORMERS_ERROR)
    KvtierCache = _missing("KvtierCache", TRANSFORMERS_ERROR)
    register = _missing("register", TRANSFORMERS_ERROR)

__all__ = ["ATTN_IMPLEMENTATION", "HAVE_TRANSFORMERS", "KvtierCache", "KvtierCacheCore",
           "KvtierLayer", "attention_forward", "geometry_from_config", "register",
           "torch_attention"]
