"""kvtier.hf, the Hugging Face transformers adapter, without transformers: the per-layer state
machine of KvtierCacheCore (prefill, decode steps, sequence lengths, mask sizes), its
refusals, the layout conversions, a one-layer Llama attention block driven through the core
against the same block over a plain growing KV, the transformers classes over a stand-in of
transformers 5's Cache base (not the real library), and the export of engine/model/train.py
to transformers' format checked against an independent rotate_half Llama forward.

Needs the package and the library from the environment, as test_local.py:
  KVTIER_PYTHONPATH  the package root (client/python, or <build>/client/python)
  KVTIER_LIBRARY     libkvtier.so (else the package finds the build tree's)
and torch; the export tests also import engine/model/train.py (torch, numpy, regex). What
cannot be imported is skipped.
"""

from __future__ import annotations

import abc
import contextlib
import importlib.util
import io
import json
import math
import os
import struct
import subprocess
import sys
import tempfile
import types
import unittest

import _support  # the package on the path

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.normpath(os.path.join(HERE, "..", "..", ".."))
TRAIN_PY = os.path.join(REPO, "engine", "model", "train.py")
GGUF = os.path.join(REPO, "engine", "model", "kvtier-tiny.gguf")
GOLDEN = os.path.join(REPO, "engine", "model", "golden")

try:
    import torch
except ImportError:
    torch = None

kvtier, IMPORT_ERROR = _support.load_kvtier("kvtier.hf")
hf = None
if kvtier is not None:
    from kvtier import hf

NEEDS = "needs kvtier, its library and torch: %s" % (IMPORT_ERROR or "torch not importable")
HAVE_ALL = kvtier is not None and torch is not None

# A small geometry: 4 query heads over 2 KV heads of 16, pages of 8.
L, HQ, HKV, D, PAGE = 2, 4, 2, 16, 8


def core(**kw):
    opts = dict(mode="full", max_tokens=256, page_size=PAGE)
    opts.update(kw)
    return hf.KvtierCacheCore(L, HQ, HKV, D, **opts)


def reference_attention(q, k, v, causal=True):
    """q [B, Hq, T, d]; k, v [B, Hkv, S, d]: float64 attention (query head h reads KV head
    h // (Hq / Hkv), as transformers' repeat_kv), causal over the last T of S positions;
    returns [B, T, Hq, d]."""
    q, k, v = q.double(), k.double(), v.double()
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    t, s = q.shape[2], k.shape[2]
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        mask = torch.ones(t, s, dtype=torch.bool).tril(s - t)
        scores = scores.masked_fill(~mask, float("-inf"))
    return (torch.softmax(scores, -1) @ v).transpose(1, 2)


def rotate_half_rope(x, pos, theta):
    """transformers' Llama RoPE: x [B, H, T, d] rotated at positions pos [T]."""
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    freqs = pos.float()[:, None] * inv[None]
    emb = torch.cat([freqs, freqs], -1)
    x1, x2 = x[..., :d // 2], x[..., d // 2:]
    return x * emb.cos() + torch.cat([-x2, x1], -1) * emb.sin()


class Attention:
    """A Llama attention block as transformers runs it: project, RoPE, the cache's update,
    then the attention function (module attributes as LlamaAttention's)."""

    def __init__(self, layer_idx, dim=32, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.layer_idx, self.num_key_value_groups = layer_idx, HQ // HKV
        self.scaling, self.is_causal, self.training = D ** -0.5, True, False
        self.wq = torch.randn(HQ * D, dim, generator=g) * dim ** -0.5
        self.wk = torch.randn(HKV * D, dim, generator=g) * dim ** -0.5
        self.wv = torch.randn(HKV * D, dim, generator=g) * dim ** -0.5
        self.wo = torch.randn(dim, HQ * D, generator=g) * (HQ * D) ** -0.5

    def qkv(self, x, pos):
        b, t, _ = x.shape
        q = (x @ self.wq.T).view(b, t, HQ, D).transpose(1, 2)
        k = (x @ self.wk.T).view(b, t, HKV, D).transpose(1, 2)
        v = (x @ self.wv.T).view(b, t, HKV, D).transpose(1, 2)
        return (rotate_half_rope(q, pos, 10000.0).half(), rotate_half_rope(k, pos, 10000.0).half(),
                v.half())

    def forward(self, x, pos, update, attention):
        b, t, _ = x.shape
        q, k, v = self.qkv(x, pos)
        k, v = update(k, v, self.layer_idx)
        out, _ = attention(self, q, k, v, None, dropout=0.0, scaling=self.scaling)
        return out.reshape(b, t, -1).float() @ self.wo.T, q


class Reference:
    """The same block over a plain growing KV (what DynamicCache holds), float64 attention."""

    def __init__(self, block):
        self.block, self.k, self.v = block, None, None

    def forward(self, x, pos):
        b, t, _ = x.shape
        q, k, v = self.block.qkv(x, pos)
        self.k = k if self.k is None else torch.cat([self.k, k], 2)
        self.v = v if self.v is None else torch.cat([self.v, v], 2)
        o = reference_attention(q, self.k, self.v).float()
        return o.reshape(b, t, -1) @ self.block.wo.T


class GeometryTest(unittest.TestCase):
    @unittest.skipIf(hf is None, NEEDS)
    def test_geometry_from_a_config(self):
        c = types.SimpleNamespace(num_hidden_layers=6, num_attention_heads=8,
                                  num_key_value_heads=2, hidden_size=256)
        self.assertEqual(hf.geometry_from_config(c), dict(num_layers=6, num_q_heads=8,
                                                          num_kv_heads=2, head_dim=32))
        c.head_dim = 64
        self.assertEqual(hf.geometry_from_config(c)["head_dim"], 64)
        c.num_key_value_heads = None
        self.assertEqual(hf.geometry_from_config(c)["num_kv_heads"], 8)
        with self.assertRaisesRegex(NotImplementedError, "sliding_window = 4096"):
            hf.geometry_from_config(types.SimpleNamespace(**vars(c), sliding_window=4096))
        with self.assertRaisesRegex(NotImplementedError, "sliding_attention"):
            hf.geometry_from_config(types.SimpleNamespace(
                **vars(c), layer_types=["full_attention", "sliding_attention"]))
        with self.assertRaisesRegex(ValueError, "multiple of num_kv_heads"):
            hf.KvtierCacheCore(2, 6, 4, 16)
        with self.assertRaisesRegex(ValueError, "dtype int8"):
            hf.KvtierCacheCore(2, 4, 2, 16, dtype="int8")

    @unittest.skipIf(hf is None, NEEDS)
    def test_without_transformers_the_classes_say_so(self):
        if hf.HAVE_TRANSFORMERS:
            self.skipTest("transformers is importable here")
        for name in ("KvtierCache", "KvtierLayer", "register"):
            with self.assertRaisesRegex(ImportError, "needs transformers"):
                getattr(hf, name)()


@unittest.skipIf(not HAVE_ALL, NEEDS)
class CoreTest(unittest.TestCase):
    def setUp(self):
        self.g = torch.Generator().manual_seed(3)

    def kv(self, t, b=1, dtype=torch.float32):
        k = torch.randn(b, HKV, t, D, generator=self.g).to(dtype)
        v = torch.randn(b, HKV, t, D, generator=self.g).to(dtype)
        return k, v

    def q(self, b=1, dtype=torch.float32):
        return torch.randn(b, HQ, 1, D, generator=self.g).to(dtype)

    def test_prefill_then_decode_lengths_and_mask_sizes(self):
        c = core()
        self.assertFalse(c.initialized)
        self.assertEqual(c.get_seq_length(0), 0)
        self.assertEqual(c.get_mask_sizes(9, 0), (9, 0))
        self.assertEqual(c.layers[0].get_max_length(), 256)
        with self.assertRaises(AttributeError):
            c.batch_size
        prompt = [self.kv(9) for _ in range(L)]
        for layer, (k, v) in enumerate(prompt):
            rk, rv = c.layers[layer].update(k, v)
            # prefill: the prompt's K/V back as they are, unmarked (the model's own attention)
            self.assertIs(rk, k)
            self.assertIs(rv, v)
            self.assertIsNone(getattr(rk, hf._MARK, None))
        self.assertTrue(c.initialized)
        self.assertEqual(c.batch_size, 1)
        self.assertEqual(c.dtype, "float32")
        seq = c.sequences[0]
        for layer in range(L):
            self.assertEqual(c.get_seq_length(layer), 9)
            self.assertEqual(seq.num_tokens(layer), 9)
        # mask sizes for a one-token step: an int (transformers 5.x) or cache_position (5.0)
        self.assertEqual(c.get_mask_sizes(1, 1), (10, 0))
        self.assertEqual(c.get_mask_sizes(torch.arange(9, 10), 1), (10, 0))
        keys = [k for k, _ in prompt]
        values = [v for _, v in prompt]
        for step in range(5):
            for layer in range(L):
                k, v = self.kv(1)
                keys[layer] = torch.cat([keys[layer], k], 2)
                values[layer] = torch.cat([values[layer], v], 2)
                mk, mv = c.layers[layer].update(k, v)
                self.assertIs(getattr(mk, hf._MARK), c.layers[layer])
                self.assertTrue(torch.equal(mk, k))
                self.assertIs(mv, v)
                q = self.q()
                block = types.SimpleNamespace(layer_idx=layer)
                out, weights = hf.attention_forward(block, q, mk, mv, None, scaling=D ** -0.5)
                self.assertIsNone(weights)
                self.assertEqual(tuple(out.shape), (1, 1, HQ, D))   # [B, T, Hq, d]
                want = reference_attention(q, keys[layer], values[layer])
                torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=0)
                self.assertEqual(c.get_seq_length(layer), 10 + step)
                self.assertEqual(c.get_mask_sizes(1, layer), (11 + step, 0))
        self.assertEqual([s.steps for s in c.layers], [5] * L)
        st = c.stats()
        self.assertEqual(st["steps"], 5 * L)
        self.assertEqual(st["appended_tokens"], 14 * L)

    def test_a_one_token_prompt_is_a_decode_step(self):
        c = core()
        k, v = self.kv(1)
        mk, mv = c.layers[0].update(k, v)
        self.assertIsNotNone(getattr(mk, hf._MARK, None))
        q = self.q()
        out, _ = hf.attention_forward(types.SimpleNamespace(), q, mk, mv, None)
        # one token: the output is its V, per query head's KV head
        torch.testing.assert_close(out[0, 0], v[0].repeat_interleave(HQ // HKV, 0)[:, 0],
                                   atol=1e-6, rtol=0)

    def test_layouts_nhd_in_kvtier_and_b_t_h_d_out(self):
        # The prompt's [B, Hkv, T, d] are appended NHD [T][Hkv][d]: the full-mode working set
        # (slot s holds page s) holds key_states[0].transpose(0, 1).
        c = core()
        k, v = self.kv(20)
        c.layers[0].update(k, v)
        seq = c.sequences[0]
        q = self.q()[:, :, 0].contiguous()
        view = seq.batch.begin_step(0, [seq], q)[0]
        kc, vc = torch.from_dlpack(view.k_cache), torch.from_dlpack(view.v_cache)
        nhd_k, nhd_v = k[0].transpose(0, 1), v[0].transpose(0, 1)      # [T, Hkv, d]
        for page in range(3):
            n = min(PAGE, 20 - page * PAGE)
            self.assertTrue(torch.equal(kc[page, :n], nhd_k[page * PAGE:page * PAGE + n]))
            self.assertTrue(torch.equal(vc[page, :n], nhd_v[page * PAGE:page * PAGE + n]))
        out = torch.empty_like(q)
        seq.batch.attend(0, [seq], q, out)
        seq.batch.end_step(0, [seq], q)

    def test_a_batch_of_two_rows(self):
        c = core(dtype="float16")
        k, v = self.kv(13, b=2, dtype=torch.float16)
        c.layers[1].update(k, v)
        self.assertEqual(c.batch_size, 2)
        self.assertEqual(c.batch.max_batch, 2)
        keys, values = k, v
        for _ in range(3):
            nk, nv = self.kv(1, b=2, dtype=torch.float16)
            keys, values = torch.cat([keys, nk], 2), torch.cat([values, nv], 2)
            mk, mv = c.layers[1].update(nk, nv)
            q = self.q(b=2, dtype=torch.float16)
            out, _ = hf.attention_forward(types.SimpleNamespace(layer_idx=1), q, mk, mv, None,
                                          scaling=D ** -0.5)
            self.assertEqual(tuple(out.shape), (2, 1, HQ, D))
            torch.testing.assert_close(out.double(), reference_attention(q, keys, values),
                                       atol=2e-3, rtol=0)
        for seq in c.sequences:
            self.assertEqual(seq.num_tokens(1), 16)
        with self.assertRaisesRegex(ValueError, "a step of batch 1, the cache holds 2 rows"):
            c.layers[1].update(*self.kv(1, b=1, dtype=torch.float16))

    def test_refusals(self):
        c = core()
        k, v = self.kv(6)
        c.layers[0].update(k, v)
        state = c.layers[0]
        with self.assertRaisesRegex(NotImplementedError, "a step of 3 tokens after 6"):
            state.update(*self.kv(3))
        with self.assertRaisesRegex(NotImplementedError, "beam search"):
            state.reorder_cache(torch.tensor([0]))
        with self.assertRaisesRegex(NotImplementedError, r"batch_repeat_interleave\(2\)"):
            state.batch_repeat_interleave(2)
        state.batch_repeat_interleave(1)
        with self.assertRaisesRegex(NotImplementedError, "cannot be reordered"):
            state.batch_select_indices(torch.tensor([0, 0]))
        state.batch_select_indices(torch.tensor([0]))
        with self.assertRaisesRegex(NotImplementedError, "crop to 4 of 6 tokens"):
            state.crop(4)
        with self.assertRaisesRegex(NotImplementedError, "crop to 5 of 6 tokens"):
            state.crop(-1)
        state.crop(6)          # nothing dropped: DynamicLayer's no-op
        state.crop(100)
        with self.assertRaisesRegex(ValueError, "is float16, the cache holds float32"):
            state.update(*self.kv(1, dtype=torch.float16))
        with self.assertRaisesRegex(ValueError, "on meta, the cache's kvtier sequences on cpu"):
            state.update(torch.empty(1, HKV, 1, D, device="meta"),
                         torch.empty(1, HKV, 1, D, device="meta"))
        with self.assertRaisesRegex(ValueError, r"expected \[B, 2, T, 16\]"):
            state.update(torch.zeros(1, 3, 1, D), torch.zeros(1, 3, 1, D))
        with self.assertRaisesRegex(RuntimeError, "attention without a decode step"):
            state.attend(self.q())
        self.assertEqual(state.get_seq_length(), 6, "nothing of a refused step is kept")
        self.assertEqual(c.sequences[0].num_tokens(0), 6)

        # A decode step must be attended through kvtier before the next one.
        mk, mv = state.update(*self.kv(1))
        with self.assertRaisesRegex(RuntimeError, "did not run through kvtier's attention"):
            state.update(*self.kv(1))
        with self.assertRaisesRegex(NotImplementedError, "scaling = 0.5"):
            hf.attention_forward(types.SimpleNamespace(layer_idx=0), self.q(), mk, mv, None,
                                 scaling=0.5)
        mk, mv = state.update(*self.kv(1))
        with self.assertRaisesRegex(ValueError, "dropout = 0.1"):
            hf.attention_forward(types.SimpleNamespace(), self.q(), mk, mv, None, dropout=0.1)
        mk, mv = state.update(*self.kv(1))
        with self.assertRaisesRegex(RuntimeError, "attention of layer 1 given the decode step "
                                                  "of layer 0"):
            hf.attention_forward(types.SimpleNamespace(layer_idx=1), self.q(), mk, mv, None)
        with self.assertRaisesRegex(ValueError, "query is float16"):
            state.attend(self.q(dtype=torch.float16))
        mk, mv = state.update(*self.kv(1))
        padded = torch.ones(1, 1, 1, state.num_tokens, dtype=torch.bool)
        padded[..., 0] = False
        with self.assertRaisesRegex(NotImplementedError, "a padded batch"):
            hf.attention_forward(types.SimpleNamespace(), self.q(), mk, mv, padded)
        mk, mv = state.update(*self.kv(1))
        full = torch.zeros(1, 1, 1, state.num_tokens)           # additive: hides nothing
        out, _ = hf.attention_forward(types.SimpleNamespace(), self.q(), mk, mv, full)
        self.assertTrue(torch.isfinite(out).all())

        # Made for float16, given float32: refused before anything is made.
        c16 = core(dtype="float16")
        with self.assertRaisesRegex(ValueError, "key_states are float32, the cache was made for "
                                                "float16"):
            c16.layers[0].update(*self.kv(4))
        self.assertFalse(c16.initialized)
        with self.assertRaisesRegex(ValueError, "kvtier's devices are cpu and cuda"):
            c16.layers[0].update(torch.empty(1, HKV, 2, D, device="meta", dtype=torch.float16),
                                 torch.empty(1, HKV, 2, D, device="meta", dtype=torch.float16))

        # torch.compile: refused while tracing.
        saved = hf._is_compiling
        hf._is_compiling = lambda: True
        try:
            compiled = core()
            with self.assertRaisesRegex(RuntimeError, "torch.compile"):
                compiled.layers[0].update(*self.kv(4))
        finally:
            hf._is_compiling = saved

        # A model whose attention is not kvtier's: refused at the first decode step.
        cfg = types.SimpleNamespace(num_hidden_layers=L, num_attention_heads=HQ,
                                    num_key_value_heads=HKV, head_dim=D,
                                    max_position_embeddings=128, _attn_implementation="sdpa")
        cc = hf.KvtierCacheCore.from_config(cfg, mode="full", page_size=PAGE)
        self.assertEqual(cc.max_tokens, 128)
        cc.layers[0].update(*self.kv(5))        # the prefill is the model's own attention
        with self.assertRaisesRegex(ValueError, "the model's attention is 'sdpa'"):
            cc.layers[0].update(*self.kv(1))
        cfg._attn_implementation = "kvtier"
        cc.layers[0].update(*self.kv(1))

        # Past max_tokens: kvtier's own answer.
        small = core(max_tokens=16)
        with self.assertRaises(kvtier.Error) as e:
            small.layers[0].update(*self.kv(17))
        self.assertEqual(e.exception.code, "OUT_OF_RANGE")

    def test_reset_starts_an_empty_cache(self):
        c = core()
        c.layers[0].update(*self.kv(5))
        c.reset()
        self.assertFalse(c.initialized)
        self.assertEqual(c.get_seq_length(0), 0)
        c.layers[0].update(*self.kv(3, b=2, dtype=torch.float16))    # a new batch and dtype
        self.assertEqual((c.batch_size, c.dtype, c.get_seq_length(0)), (2, "float16", 3))

    def test_torch_attention_is_transformers_convention(self):
        q = torch.randn(2, HQ, 5, D, generator=self.g)
        k, v = self.kv(8, b=2)
        out, w = hf.torch_attention(types.SimpleNamespace(is_causal=True), q, k, v, None)
        self.assertIsNone(w)
        torch.testing.assert_close(out.double(), reference_attention(q, k, v), atol=1e-5,
                                   rtol=0)
        mask = torch.ones(2, 1, 5, 8, dtype=torch.bool).tril(3)
        out2, _ = hf.torch_attention(types.SimpleNamespace(), q, k, v, mask)
        torch.testing.assert_close(out2, out)
        # an unmarked K (any other cache): attention_forward is the model's own attention
        # (the module's attributes as LlamaAttention's: transformers' SDPA expands the KV
        # heads by num_key_value_groups)
        llama_like = types.SimpleNamespace(is_causal=True, num_key_value_groups=HQ // HKV)
        out3, _ = hf.attention_forward(llama_like, q, k, v, None)
        torch.testing.assert_close(out3, out)

    def test_llama_block_full_mode_equals_a_plain_growing_kv(self):
        # One Llama attention layer, fp16 K/V: a 40-token prefill (the model's attention over
        # the prompt) and 12 decode steps (kvtier's attention), against the same layer over a
        # plain growing KV.
        c = core(dtype="float16")
        block = Attention(layer_idx=1)
        ref = Reference(block)
        x = torch.randn(1, 40, 32, generator=self.g)
        pos = torch.arange(40)
        got, _ = block.forward(x, pos, lambda k, v, i: c.layers[i].update(k, v),
                               hf.attention_forward)
        torch.testing.assert_close(got, ref.forward(x, pos), atol=2e-3, rtol=0)
        for step in range(12):
            x = torch.randn(1, 1, 32, generator=self.g)
            pos = torch.tensor([40 + step])
            got, _ = block.forward(x, pos, lambda k, v, i: c.layers[i].update(k, v),
                                   hf.attention_forward)
            torch.testing.assert_close(got, ref.forward(x, pos), atol=2e-3, rtol=0)
        self.assertEqual(c.get_seq_length(1), 52)
        self.assertEqual(c.layers[1].steps, 12)

    def prefill_and_decode(self, c, steps):
        """A one-layer attention block over the cache `c`: a 120-token prompt, then `steps`
        decode steps, each output finite."""
        block = Attention(layer_idx=0, seed=1)
        x = torch.randn(1, 120, 32, generator=self.g)
        block.forward(x, torch.arange(120), lambda k, v, i: c.layers[i].update(k, v),
                      hf.attention_forward)
        for step in range(steps):
            out, _ = block.forward(torch.randn(1, 1, 32, generator=self.g),
                                   torch.tensor([120 + step]),
                                   lambda k, v, i: c.layers[i].update(k, v),
                                   hf.attention_forward)
            self.assertTrue(torch.isfinite(out).all())

    def test_speculative_mode_runs_within_its_budget(self):
        c = core(mode="speculative", budget_tokens=4 * PAGE, dtype="float16")
        self.prefill_and_decode(c, 10)
        st = c.stats()
        self.assertEqual(st["steps"], 10)
        self.assertGreater(st["checked_heads"], 0)
        self.assertGreaterEqual(c.correction_rate(), 0.0)
        self.assertLessEqual(c.correction_rate(), 1.0)

    def test_a_drop_policy_keeps_the_working_set_at_its_budget(self):
        # H2O reads the attention kvtier's attention function computes: it evicts down to the
        # budget of 4 pages per KV head; a name the registry does not know is its error.
        c = core(mode="drop", budget_tokens=4 * PAGE, residency_policy="h2o")
        self.prefill_and_decode(c, 6)
        st = c.stats()
        self.assertGreater(st["evicted_head_pages"], 0)
        self.assertLessEqual(st["resident_head_pages"], 4 * HKV * L)
        bad = core(mode="drop", budget_tokens=4 * PAGE, residency_policy="h3o")
        with self.assertRaises(kvtier.Error) as e:
            bad.layers[0].update(torch.randn(1, HKV, 8, D), torch.randn(1, HKV, 8, D))
        self.assertIn("policy.residency = 'h3o'", e.exception.message)


def stand_in_transformers():
    """Modules standing in for transformers 5's Cache, CacheLayerMixin, AttentionInterface,
    AttentionMaskInterface, sdpa_mask and sdpa_attention_forward — their shapes as read from
    the 5.x sources, not the library: enough to build and drive kvtier.hf's classes."""
    tr = types.ModuleType("transformers")
    cu = types.ModuleType("transformers.cache_utils")
    mu = types.ModuleType("transformers.masking_utils")
    integ = types.ModuleType("transformers.integrations")
    sdpa = types.ModuleType("transformers.integrations.sdpa_attention")

    class CacheLayerMixin(abc.ABC):
        is_compileable = False

        def __init__(self, **kwargs):
            self.keys, self.values, self.is_initialized = None, None, False

        @abc.abstractmethod
        def lazy_initialization(self, key_states, value_states): ...

        @abc.abstractmethod
        def update(self, key_states, value_states, *args, **kwargs): ...

        @abc.abstractmethod
        def get_mask_sizes(self, query_length): ...

        @abc.abstractmethod
        def get_seq_length(self): ...

        @abc.abstractmethod
        def get_max_length(self): ...

    class Cache:
        def __init__(self, layers=None, layer_class_to_replicate=None, offloading=False,
                     offload_only_non_sliding=True):
            if (layers is None) == (layer_class_to_replicate is None):
                raise ValueError("exactly one of layers or layer_class_to_replicate")
            self.layers = layers if layers is not None else []
            self.offloading = offloading

        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            return self.layers[layer_idx].update(key_states, value_states, *args, **kwargs)

        def get_seq_length(self, layer_idx=0):
            return self.layers[layer_idx].get_seq_length() if layer_idx < len(self.layers) else 0

        def get_mask_sizes(self, query_length, layer_idx):
            return self.layers[layer_idx].get_mask_sizes(query_length)

        def reorder_cache(self, beam_idx):
            for layer in self.layers:
                layer.reorder_cache(beam_idx)

        @property
        def is_compileable(self):
            return bool(self.layers) and all(l.is_compileable for l in self.layers)

    class GeneralInterface:
        _global_mapping: dict = {}

        @classmethod
        def register(cls, key, value):
            cls._global_mapping.update({key: value})

        def __getitem__(self, key):
            return self._global_mapping[key]

    class AttentionInterface(GeneralInterface):
        _global_mapping = {"sdpa": hf.torch_attention}

    def sdpa_mask(*args, **kwargs):
        return None

    class AttentionMaskInterface(GeneralInterface):
        _global_mapping = {"sdpa": sdpa_mask}

    cu.Cache, cu.CacheLayerMixin = Cache, CacheLayerMixin
    mu.sdpa_mask = sdpa_mask
    sdpa.sdpa_attention_forward = hf.torch_attention
    tr.AttentionInterface, tr.AttentionMaskInterface = AttentionInterface, AttentionMaskInterface
    tr.cache_utils, tr.masking_utils, tr.integrations = cu, mu, integ
    integ.sdpa_attention = sdpa
    return {"transformers": tr, "transformers.cache_utils": cu,
            "transformers.masking_utils": mu, "transformers.integrations": integ,
            "transformers.integrations.sdpa_attention": sdpa}


@unittest.skipIf(not HAVE_ALL, NEEDS)
class StandInTransformersTest(unittest.TestCase):
    """kvtier.hf's KvtierCache, KvtierLayer and register over stand-ins of transformers 5's
    base classes (the real library is not installable here): they build, register, and a
    Llama block driven through Cache.update and the registry equals the plain one."""

    def setUp(self):
        if hf.HAVE_TRANSFORMERS:
            self.skipTest("the real transformers is importable: hf_generate.py tests that")
        self.saved = {k: sys.modules.get(k) for k in stand_in_transformers()}
        self.stub = stand_in_transformers()
        sys.modules.update(self.stub)
        self.KvtierLayer, self.KvtierCache, self.register = hf._build_transformers_adapter()

    def tearDown(self):
        for k, v in getattr(self, "saved", {}).items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v

    def test_cache_and_registry(self):
        tr = self.stub["transformers"]
        self.assertEqual(self.register(), "kvtier")
        attention = tr.AttentionInterface()["kvtier"]
        self.assertIs(attention, hf.attention_forward)
        self.assertIs(tr.AttentionMaskInterface()["kvtier"], self.stub[
            "transformers.masking_utils"].sdpa_mask)
        cfg = types.SimpleNamespace(num_hidden_layers=L, num_attention_heads=HQ,
                                    num_key_value_heads=HKV, head_dim=D, hidden_size=HQ * D,
                                    max_position_embeddings=192, _attn_implementation="kvtier")
        cache = self.KvtierCache(cfg, mode="full", page_size=PAGE)
        self.assertIsInstance(cache, self.stub["transformers.cache_utils"].Cache)
        self.assertEqual(len(cache), L)
        self.assertFalse(cache.is_compileable)
        self.assertFalse(cache.is_initialized)
        self.assertEqual(cache.batch_size, -1)
        self.assertEqual(cache.get_max_length(), 192)
        self.assertEqual(cache.get_max_cache_shape(), 192)
        self.assertEqual(cache.get_mask_sizes(7, 0), (7, 0))
        layer = cache.layers[0]
        self.assertFalse(layer.is_initialized)
        self.assertFalse(hasattr(layer, "batch_size"))

        g = torch.Generator().manual_seed(5)
        block, ref = Attention(layer_idx=1, seed=2), None
        ref = Reference(block)
        x = torch.randn(1, 30, 32, generator=g)
        got, _ = block.forward(x, torch.arange(30), cache.update, attention)
        torch.testing.assert_close(got, ref.forward(x, torch.arange(30)), atol=2e-3, rtol=0)
        for step in range(6):
            x, pos = torch.randn(1, 1, 32, generator=g), torch.tensor([30 + step])
            self.assertEqual(cache.get_mask_sizes(torch.tensor([30 + step]), 1),
                             (31 + step, 0))
            got, _ = block.forward(x, pos, cache.update, attention)
            torch.testing.assert_close(got, ref.forward(x, pos), atol=2e-3, rtol=0)
        self.assertTrue(cache.is_initialized)
        self.assertEqual(cache.batch_size, 1)
        self.assertEqual(cache.layers[1].batch_size, 1)
        self.assertEqual(cache.layers[1].dtype, torch.float16)
        self.assertEqual(cache.get_seq_length(1), 36)
        self.assertEqual(cache.get_seq_length(), 0)   # layer 0 saw nothing
        self.assertEqual(cache.stats()["steps"], 6)
        with self.assertRaisesRegex(NotImplementedError, "beam search"):
            cache.reorder_cache(torch.tensor([0]))
        with self.assertRaisesRegex(NotImplementedError, "crop to 10 of 36"):
            cache.crop(10)
        with self.assertRaisesRegex(NotImplementedError, "batch_repeat_interleave"):
            cache.batch_repeat_interleave(3)
        with self.assertRaisesRegex(NotImplementedError, "offloading"):
            layer.offload()
        with self.assertRaisesRegex(ValueError, "layer_idx 5 of a cache of 2 layers"):
            cache.update(*Attention(0).qkv(torch.randn(1, 1, 32), torch.tensor([0]))[1:], 5)
        cache.reset()
        self.assertFalse(cache.is_initialized)
        self.assertEqual(cache.get_seq_length(1), 0)


def load_train():
    """engine/model/train.py as a module (None, and why, where it cannot be imported)."""
    try:
        spec = importlib.util.spec_from_file_location("kvtier_train", TRAIN_PY)
        train = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(train)
        return train, ""
    except Exception as e:  # noqa: BLE001 - reported as the skip reason
        return None, "%s: %s" % (type(e).__name__, e)


def read_safetensors(path):
    """An independent reader of the safetensors format: {name: float32 tensor}."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    assert header.pop("__metadata__")["format"] == "pt"
    out = {}
    dtypes = {"F32": (torch.float32, 4), "F16": (torch.float16, 2)}
    for name, h in header.items():
        dt, size = dtypes[h["dtype"]]
        a, b = h["data_offsets"]
        count = math.prod(h["shape"])
        assert b - a == count * size, name
        t = torch.frombuffer(bytearray(data[a:b]), dtype=dt).reshape(h["shape"])
        out[name] = t.float()
    return out


def hf_llama_logits(weights, config, ids):
    """transformers' LlamaForCausalLM forward written out independently: RMSNorm, rotate_half
    RoPE at rope_theta, GQA, SwiGLU, tied lm_head — logits [T, vocab]."""
    nh, nkv, d = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    eps, theta = config["rms_norm_eps"], config["rope_parameters"]["rope_theta"]
    assert config["rope_theta"] == theta and config["tie_word_embeddings"]

    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w

    t = len(ids)
    pos = torch.arange(t)
    x = weights["model.embed_tokens.weight"][torch.tensor(ids)]
    for i in range(config["num_hidden_layers"]):
        p = "model.layers.%d." % i
        h = rms(x, weights[p + "input_layernorm.weight"])
        q = (h @ weights[p + "self_attn.q_proj.weight"].T).view(1, t, nh, d).transpose(1, 2)
        k = (h @ weights[p + "self_attn.k_proj.weight"].T).view(1, t, nkv, d).transpose(1, 2)
        v = (h @ weights[p + "self_attn.v_proj.weight"].T).view(1, t, nkv, d).transpose(1, 2)
        q, k = rotate_half_rope(q, pos, theta), rotate_half_rope(k, pos, theta)
        o = reference_attention(q, k, v).float().reshape(t, nh * d)
        x = x + o @ weights[p + "self_attn.o_proj.weight"].T
        h = rms(x, weights[p + "post_attention_layernorm.weight"])
        gate = torch.nn.functional.silu(h @ weights[p + "mlp.gate_proj.weight"].T)
        x = x + (gate * (h @ weights[p + "mlp.up_proj.weight"].T)) @ \
            weights[p + "mlp.down_proj.weight"].T
    return rms(x, weights["model.norm.weight"]) @ weights["model.embed_tokens.weight"].T


def run_layer(test, device, dtype, streams):
    """One layer through the core: a 300-token prefill and 12 decode steps of random K/V/q
    made on `device` (on CUDA each after a spin kernel, so they are written late on torch's
    stream), every step's output against float64 attention over everything appended.
    streams(step): the context the step runs in (a torch stream, or nothing)."""
    c = core(dtype=dtype, max_tokens=512, device=device)
    state = c.layers[0]
    tdtype = getattr(torch, dtype)
    g = torch.Generator(device=device).manual_seed(11)
    ks, vs = [], []
    for step, t in enumerate([300] + [1] * 12):
        with streams(step):
            if device == "cuda":
                torch.cuda._sleep(20_000_000)   # what follows is written late on this stream
            k = torch.randn(1, HKV, t, D, device=device, generator=g).to(tdtype)
            v = torch.randn(1, HKV, t, D, device=device, generator=g).to(tdtype)
            rk, rv = state.update(k, v)
            ks.append(k.cpu())
            vs.append(v.cpu())
            if t > 1:
                continue
            if device == "cuda":
                torch.cuda._sleep(20_000_000)
            q = torch.randn(1, HQ, 1, D, device=device, generator=g).to(tdtype)
            out, _ = hf.attention_forward(types.SimpleNamespace(layer_idx=0), q, rk, rv, None,
                                          scaling=D ** -0.5)
            got = out.cpu()   # ordered on this stream: after kvtier's attention
            qc = q.cpu()
        want = reference_attention(qc, torch.cat(ks, 2), torch.cat(vs, 2))
        torch.testing.assert_close(got.double(), want, rtol=0,
                                   atol=3e-3 if dtype == "float16" else 1e-4)
    test.assertEqual(state.steps, 12)
    test.assertEqual(c.get_seq_length(0), 312)
    c.close()


@unittest.skipUnless(HAVE_ALL, "needs torch and kvtier")
class CpuLayerTest(unittest.TestCase):
    def test_a_layer_on_the_cpu(self):
        for dtype in ("float32", "float16"):
            with self.subTest(dtype=dtype):
                run_layer(self, "cpu", dtype, lambda step: contextlib.nullcontext())


@unittest.skipUnless(_support.cuda_usable(kvtier, torch), "needs a GPU, torch with CUDA and a CUDA build of libkvtier")
class CudaCoreTest(unittest.TestCase):
    """The core on CUDA tensors written late on torch's stream: kvtier must read them after
    torch wrote them and torch must read kvtier's output after kvtier wrote it — on torch's
    default stream (which kvtier cannot adopt: the core orders the two with events), on a
    stream of torch's own (adopted), and when torch's current stream changes between steps."""

    def test_torch_default_stream(self):
        for dtype in ("float32", "float16"):
            with self.subTest(dtype=dtype):
                run_layer(self, "cuda", dtype, lambda step: contextlib.nullcontext())

    def test_a_torch_stream_adopted(self):
        s = torch.cuda.Stream()
        run_layer(self, "cuda", "float32", lambda step: torch.cuda.stream(s))

    def test_torch_s_stream_changing_between_steps(self):
        s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
        run_layer(self, "cuda", "float32",
                  lambda step: contextlib.nullcontext() if step % 3 == 2
                  else torch.cuda.stream(s1 if step % 3 == 0 else s2))


@unittest.skipIf(torch is None, "needs torch")
class ExportTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.train, why = load_train()
        if cls.train is None:
            raise unittest.SkipTest("engine/model/train.py not importable: " + why)

    def test_rope_rows_make_rotate_half_equal_adjacent_pairs(self):
        train = self.train
        cfg = train.Config(vocab=8, dim=32, layers=1, q_heads=4, kv_heads=2, ffn=8,
                           rope_base=10000.0)
        g = torch.Generator().manual_seed(0)
        w = torch.randn(cfg.q_heads * cfg.head_dim, cfg.dim, generator=g)
        x = torch.randn(5, cfg.dim, generator=g)
        ours = (x @ w.T).view(1, 5, cfg.q_heads, cfg.head_dim).transpose(1, 2)
        cos, sin = train.rope_tables(cfg, 5)
        ours = train.apply_rope(ours, cos, sin)
        theirs = (x @ train.hf_rope_rows(w, cfg.q_heads).T).view(1, 5, cfg.q_heads,
                                                                 cfg.head_dim).transpose(1, 2)
        theirs = rotate_half_rope(theirs, torch.arange(5), cfg.rope_base)
        h = cfg.head_dim // 2
        perm = [2 * i for i in range(h)] + [2 * i + 1 for i in range(h)]
        torch.testing.assert_close(theirs, ours[..., perm], atol=1e-5, rtol=0)

    def test_a_random_model_round_trips(self):
        train = self.train
        torch.manual_seed(11)
        cfg = train.Config(vocab=64, dim=48, layers=2, q_heads=6, kv_heads=2, ffn=40,
                           context=64, rope_base=5000.0)
        model = train.Llama(cfg).eval()
        with tempfile.TemporaryDirectory() as d:
            config = train.export_hf(model, cfg, d, bos=62, eos=63)
            with open(os.path.join(d, "config.json")) as f:
                self.assertEqual(json.load(f), config)
            weights = read_safetensors(os.path.join(d, "model.safetensors"))
        self.assertEqual(config["architectures"], ["LlamaForCausalLM"])
        self.assertEqual((config["hidden_size"], config["num_attention_heads"],
                          config["num_key_value_heads"], config["head_dim"],
                          config["num_hidden_layers"], config["intermediate_size"],
                          config["vocab_size"], config["max_position_embeddings"]),
                         (48, 6, 2, 8, 2, 40, 64, 64))
        self.assertEqual(len(weights), 2 + 9 * cfg.layers)
        self.assertNotIn("lm_head.weight", weights)
        ids = [3, 17, 5, 60, 22, 9, 41, 8, 30, 2, 55]
        with torch.no_grad():
            want = model(torch.tensor([ids]))[0]
        got = hf_llama_logits(weights, config, ids)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)

    @unittest.skipUnless(os.path.exists(GGUF) and os.path.exists(os.path.join(GOLDEN,
                                                                              "golden.json")),
                         "engine/model's GGUF and golden files")
    def test_the_project_model_exported_by_the_cli_gives_the_golden_logits(self):
        with tempfile.TemporaryDirectory() as d:
            out = os.path.join(d, "hf")
            r = subprocess.run([sys.executable, TRAIN_PY, "--init", GGUF, "--export-hf", out],
                               capture_output=True, text=True, timeout=120)
            self.assertEqual(r.returncode, 0, r.stderr)
            with open(os.path.join(out, "config.json")) as f:
                config = json.load(f)
            weights = read_safetensors(os.path.join(out, "model.safetensors"))
        self.assertEqual(config["rope_theta"], 500000.0)
        self.assertEqual(config["rms_norm_eps"], 1e-05)
        with open(os.path.join(GOLDEN, "golden.json")) as f:
            golden = json.load(f)
        logits = torch.from_numpy(__import__("numpy").fromfile(
            os.path.join(GOLDEN, "logits.f32"), dtype="<f4").reshape(-1, golden["vocab"]))
        prompt, greedy = golden["prompt_ids"], golden["greedy_ids"]
        self.assertEqual(golden["logit_steps"][:2], [0, 4])
        with torch.no_grad():
            got = hf_llama_logits(weights, config, prompt + greedy[:4])
        # the last prompt position (step 0) and 4 generated tokens later (step 4)
        for row, at in ((0, len(prompt) - 1), (1, len(prompt) + 3)):
            torch.testing.assert_close(got[at], logits[row], atol=2e-3, rtol=0)
            self.assertEqual(int(got[at].argmax()), int(logits[row].argmax()))
        self.assertEqual(got[len(prompt) - 1:len(prompt) + 4].argmax(-1).tolist(), greedy[:5])

    @unittest.skipUnless(HAVE_ALL and os.path.exists(GGUF) and os.path.exists(
        os.path.join(GOLDEN, "golden.json")), "kvtier, and engine/model's GGUF and golden files")
    def test_the_project_model_through_the_core_generates_the_golden_tokens(self):
        # What generate(past_key_values=KvtierCache(mode="full")) does, without transformers:
        # the exported model run in transformers' order (per layer: RoPE, the cache's update,
        # the attention function), the prompt once, then one token per step, greedily.
        with tempfile.TemporaryDirectory() as d:
            with contextlib.redirect_stdout(io.StringIO()):
                config = self.train.export_hf_from_gguf(GGUF, d)
            weights = read_safetensors(os.path.join(d, "model.safetensors"))
        with open(os.path.join(GOLDEN, "golden.json")) as f:
            golden = json.load(f)
        prompt, n = golden["prompt_ids"], 24

        def run(c):
            tokens, pos = [], 0
            step = prompt
            for _ in range(n):
                logits = self.incremental_logits(weights, config, step, pos, c)
                pos += len(step)
                step = [int(logits.argmax())]
                tokens += step
            return tokens

        full = hf.KvtierCacheCore.from_config(types.SimpleNamespace(**config), mode="full")
        self.assertEqual(run(full), golden["greedy_ids"][:n])
        self.assertEqual([s.steps for s in full.layers], [n - 1] * config["num_hidden_layers"])
        spec = hf.KvtierCacheCore.from_config(types.SimpleNamespace(**config),
                                              mode="speculative", budget_tokens=128)
        tokens = run(spec)
        self.assertEqual(len(tokens), n)
        self.assertEqual(tokens[0], golden["greedy_ids"][0])   # the prefill is the model's own
        self.assertEqual(spec.stats()["steps"], (n - 1) * config["num_hidden_layers"])

    @staticmethod
    def incremental_logits(weights, config, ids, start, c):
        """The last position's logits of `ids` at positions start.., the K/V through the core
        and the attention through hf.attention_forward (transformers' LlamaAttention order)."""
        nh, nkv = config["num_attention_heads"], config["num_key_value_heads"]
        d = config["head_dim"]
        eps, theta = config["rms_norm_eps"], config["rope_theta"]

        def rms(x, w):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w

        t = len(ids)
        pos = torch.arange(start, start + t)
        x = weights["model.embed_tokens.weight"][torch.tensor(ids)]
        for i in range(config["num_hidden_layers"]):
            p = "model.layers.%d." % i
            module = types.SimpleNamespace(layer_idx=i, num_key_value_groups=nh // nkv,
                                           is_causal=True)
            h = rms(x, weights[p + "input_layernorm.weight"])
            q = (h @ weights[p + "self_attn.q_proj.weight"].T).view(1, t, nh, d).transpose(1, 2)
            k = (h @ weights[p + "self_attn.k_proj.weight"].T).view(1, t, nkv, d).transpose(1, 2)
            v = (h @ weights[p + "self_attn.v_proj.weight"].T).view(1, t, nkv, d).transpose(1, 2)
            q, k = rotate_half_rope(q, pos, theta), rotate_half_rope(k, pos, theta)
            k, v = c.layers[i].update(k, v)
            o, _ = hf.attention_forward(module, q, k, v, None, scaling=d ** -0.5)
            x = x + o.reshape(t, nh * d) @ weights[p + "self_attn.o_proj.weight"].T
            h = rms(x, weights[p + "post_attention_layernorm.weight"])
            gate = torch.nn.functional.silu(h @ weights[p + "mlp.gate_proj.weight"].T)
            x = x + (gate * (h @ weights[p + "mlp.up_proj.weight"].T)) @ \
                weights[p + "mlp.down_proj.weight"].T
        x = rms(x[-1], weights["model.norm.weight"])
        return x @ weights["model.embed_tokens.weight"].T

    def test_the_cli_needs_init_and_keeps_requiring_data(self):
        r = subprocess.run([sys.executable, TRAIN_PY, "--export-hf", "unused"],
                           capture_output=True, text=True, timeout=60)
        self.assertEqual(r.returncode, 2)
        self.assertIn("--export-hf needs --init GGUF", r.stderr)
        r = subprocess.run([sys.executable, TRAIN_PY, "--out", "unused"],
                           capture_output=True, text=True, timeout=60)
        self.assertEqual(r.returncode, 2)
        self.assertIn("the following arguments are required: --data", r.stderr)


if __name__ == "__main__":
    unittest.main()
