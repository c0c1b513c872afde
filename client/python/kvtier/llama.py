"""A small Llama decoder in torch whose KV cache lives in kvtier: the control flow a Python
engine has over the package (kvtier.local's public API only), on the project's model.

    import kvtier
    from kvtier.llama import LlamaModel, run_options
    model = LlamaModel.from_gguf("engine/model/kvtier-tiny.gguf")
    dev = kvtier.Device("cpu")
    seq = kvtier.Sequence(dev, model.geometry(), run_options("speculative", 128, len(ids), 16))
    tokens = model.generate(seq, ids, 16)          # greedy
    seq.correction_rate()

It computes what kvtier-run's decoder (engine/decoder.cc) computes, in the same order:

- prefill: the prompt in chunks of `prefill_chunk` (256) tokens; each layer attends
  causally over the prompt's own K/V in float32 (the engine's attention, as every engine
  does for a prompt) and appends the chunk's K/V, rounded to the sequence's dtype, to kvtier;
- a decode step: per layer q, k and v in float32 (after RoPE), converted to the sequence's
  dtype, ``seq.append(layer, k, v)`` then ``seq.decode(layer, q, out)`` (kvtier's attention
  over the working set, then the next step's selection and recall), ``out`` back to float32;
- greedy decoding: the first token from the prompt's last logits, then one step per token,
  stopping at `n` tokens or at the end-of-text token.

The arithmetic follows engine/math_cpu.cc where torch lets it at no cost: RMSNorm's sum of
squares in float64, RoPE on adjacent pairs (GGUF's llama layout, not NeoX) with the inverse
frequencies rounded to float32 and the angles in float64, weights dequantised to float32.
What remains different is the summation order of the matrix products (torch's BLAS against
OpenBLAS), so logits agree to about 1e-4, not bit for bit.

Device-agnostic: the model runs on the device its weights are on (``from_gguf(device=...)``)
and hands kvtier tensors on that device, so a kvtier.Device("cuda") sequence takes CUDA
tensors. On CUDA give the sequence torch's stream (``SequenceOptions(stream=
torch.cuda.current_stream())``) so that kvtier's work is ordered with the model's; only the
CPU path has been run.

CLI (no tokenizer: the prompt's ids come from a golden.json or a comma list):

    python -m kvtier.llama --model engine/model/kvtier-tiny.gguf \\
        --prompt-ids-from engine/model/golden/golden.json -n 16 --mode full,speculative \\
        --budget 128 --json out.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
import weakref
from typing import Any, Dict, List, Optional, Sequence as Seq

import numpy as np
import torch
import torch.nn.functional as F

from kvtier import gguf
from kvtier import local as kv

__all__ = ["LlamaConfig", "LlamaModel", "run_options", "main"]

_TORCH_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """The model's hyper-parameters from a GGUF file's metadata (engine/model.cc's
    LlamaConfig::FromGguf, llama architecture)."""
    arch: str
    name: str
    dim: int
    layers: int
    ffn: int
    q_heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    context: int
    rope_base: float
    rope_dim: int
    rope_linear_factor: float
    eps: float
    tied_embeddings: bool
    bos: int
    eos: int

    @classmethod
    def from_metadata(cls, meta: Dict[str, Any], tensors: Dict[str, np.ndarray]) -> "LlamaConfig":
        arch = meta.get("general.architecture")
        if arch != "llama":
            raise NotImplementedError("GGUF general.architecture = %r: this decoder runs llama"
                                      % (arch,))
        p = arch + "."

        def need(key):
            if key not in meta:
                raise ValueError("GGUF metadata %s is missing" % key)
            return meta[key]

        dim = int(need(p + "embedding_length"))
        q_heads = int(need(p + "attention.head_count"))
        kv_heads = int(meta.get(p + "attention.head_count_kv", q_heads))
        if q_heads % kv_heads:
            raise ValueError("GGUF metadata %sattention.head_count = %d is not a multiple of "
                             "head_count_kv = %d" % (p, q_heads, kv_heads))
        head_dim = int(meta.get(p + "attention.key_length", dim // q_heads))
        if int(meta.get(p + "attention.value_length", head_dim)) != head_dim:
            raise NotImplementedError("GGUF metadata %sattention.value_length differs from "
                                      "key_length" % p)
        rope_dim = int(meta.get(p + "rope.dimension_count", head_dim))
        if rope_dim > head_dim or rope_dim % 2:
            raise ValueError("GGUF metadata %srope.dimension_count = %d: must be even and at "
                             "most the head size %d" % (p, rope_dim, head_dim))
        factor = 1.0
        scaling = meta.get(p + "rope.scaling.type", "none")
        if scaling == "linear":
            factor = float(need(p + "rope.scaling.factor"))
        elif scaling != "none":
            raise NotImplementedError("GGUF metadata %srope.scaling.type = %r: this decoder runs "
                                      "none and linear" % (p, scaling))
        if "token_embd.weight" not in tensors:
            raise ValueError("GGUF: tensor 'token_embd.weight' is missing")
        if "blk.0.attn_q.bias" in tensors:
            raise NotImplementedError("GGUF: q/k/v biases (qwen2-style) are not supported here")
        return cls(arch=arch, name=str(meta.get("general.name", "")), dim=dim,
                   layers=int(need(p + "block_count")), ffn=int(need(p + "feed_forward_length")),
                   q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim,
                   vocab=int(tensors["token_embd.weight"].shape[0]),
                   context=int(need(p + "context_length")),
                   rope_base=float(meta.get(p + "rope.freq_base", 10000.0)), rope_dim=rope_dim,
                   rope_linear_factor=factor,
                   eps=float(meta.get(p + "attention.layer_norm_rms_epsilon", 1e-5)),
                   tied_embeddings="output.weight" not in tensors,
                   bos=int(meta.get("tokenizer.ggml.bos_token_id", -1)),
                   eos=int(meta.get("tokenizer.ggml.eos_token_id", -1)))


def run_options(mode: str, budget: int, prompt_tokens: int, new_tokens: int,
                page_size: int = 32, tau: float = 0.7, trigger: str = "cosine",
                max_loss: float = 0.1, **policy: Any) -> kv.SequenceOptions:
    """The sequence options kvtier-run generate gives a prompt of `prompt_tokens` and `n`
    new tokens (engine/run_main.cc RunMode, engine/generate.cc OptionsOf): max_tokens the
    tokens it will hold and a page, rounded up to pages; `budget` in the selecting modes; in
    full mode (every page resident) the default budget, cut to fit max_tokens. `policy`:
    budget_policy, residency_policy, host_drop and policy_params, as kvtier-run's
    --budget-policy, --residency-policy and --policy-param give them."""
    need = prompt_tokens + new_tokens + page_size
    max_tokens = -(-need // page_size) * page_size
    if mode == "full":
        budget = kv.SequenceOptions().budget_tokens
        unit = 4 * page_size
        if budget > max_tokens and max_tokens >= unit:
            budget = max_tokens // unit * unit
    return kv.SequenceOptions(mode=mode, budget_tokens=budget, max_tokens=max_tokens, tau=tau,
                              trigger=trigger, max_loss=max_loss, **policy)


class LlamaModel:
    """A Llama decoder (RMSNorm, RoPE on adjacent pairs, grouped-query attention, SwiGLU,
    tied or separate output embeddings) in float32 torch, its KV cache in kvtier sequences."""

    def __init__(self, config: LlamaConfig, weights: Dict[str, torch.Tensor],
                 inv_freq: torch.Tensor, prefill_chunk: int = 256, observe_window: int = 32):
        if prefill_chunk < 1:
            raise ValueError("prefill_chunk = %d: must be >= 1" % prefill_chunk)
        if not 0 <= observe_window <= 1024:
            raise ValueError("observe_window = %d: must be in [0, 1024]" % observe_window)
        # What a sequence's policies read, fed as kvtier-run's decoder feeds them
        # (engine/decoder.cc): the prompt's last `observe_window` queries per layer
        # (observe_queries), and after every forward pass the next-token logits and each
        # token's hidden-state change per layer (report_signals; EpiKV's signal).
        self.observe_window = observe_window
        self._last_hidden: "weakref.WeakKeyDictionary[kv.Sequence, torch.Tensor]" = \
            weakref.WeakKeyDictionary()
        self.config = config
        self.w = weights
        self.device = weights["token_embd.weight"].device
        self.inv_freq = inv_freq  # float64 [rope_dim / 2], each value rounded to float32
        self.prefill_chunk = prefill_chunk
        c = config
        self.scale = float(np.float32(1.0) / np.sqrt(np.float32(c.head_dim)))
        self.output = self.w["token_embd.weight" if c.tied_embeddings else "output.weight"]

    @classmethod
    def from_gguf(cls, path: str, device: Any = "cpu", prefill_chunk: int = 256) -> "LlamaModel":
        meta, tensors = gguf.read(path)
        c = LlamaConfig.from_metadata(meta, tensors)
        d, qd, kvd = c.dim, c.q_heads * c.head_dim, c.kv_heads * c.head_dim
        shapes = {"token_embd.weight": (c.vocab, d), "output_norm.weight": (d,)}
        if not c.tied_embeddings:
            shapes["output.weight"] = (c.vocab, d)
        for i in range(c.layers):
            p = "blk.%d." % i
            shapes.update({p + "attn_norm.weight": (d,), p + "attn_q.weight": (qd, d),
                           p + "attn_k.weight": (kvd, d), p + "attn_v.weight": (kvd, d),
                           p + "attn_output.weight": (d, qd), p + "ffn_norm.weight": (d,),
                           p + "ffn_gate.weight": (c.ffn, d), p + "ffn_up.weight": (c.ffn, d),
                           p + "ffn_down.weight": (d, c.ffn)})
        weights = {}
        for name, shape in shapes.items():
            if name not in tensors:
                raise ValueError("GGUF: tensor %r is missing" % name)
            a = tensors[name]
            if tuple(a.shape) != shape:
                raise ValueError("GGUF: tensor %r has shape %s; the model's metadata needs %s"
                                 % (name, list(a.shape), list(shape)))
            weights[name] = torch.from_numpy(a.astype(np.float32)).to(device)
        # base^(-2i/rope_dim) in float64, rounded to float32 as the engine keeps them,
        # divided by Llama-3's per-frequency factors when present and the linear factor.
        half = c.rope_dim // 2
        inv = [c.rope_base ** (-2.0 * i / c.rope_dim) for i in range(half)]
        if "rope_freqs.weight" in tensors:
            factors = tensors["rope_freqs.weight"].astype(np.float32)
            if factors.shape != (half,):
                raise ValueError("GGUF: tensor 'rope_freqs.weight' has shape %s; the model "
                                 "needs [%d]" % (list(factors.shape), half))
            inv = [v / float(f) for v, f in zip(inv, factors)]
        inv = np.array([v / c.rope_linear_factor for v in inv], dtype=np.float32)
        inv_freq = torch.from_numpy(inv.astype(np.float64)).to(device)
        return cls(c, weights, inv_freq, prefill_chunk)

    # -- the pieces --------------------------------------------------------------------------
    def geometry(self, dtype: str = "float16", page_size: int = 32) -> kv.LocalGeometry:
        """The kvtier geometry of this model's KV cache."""
        c = self.config
        return kv.LocalGeometry(num_layers=c.layers, num_q_heads=c.q_heads,
                                num_kv_heads=c.kv_heads, head_dim=c.head_dim,
                                page_size=page_size, dtype=dtype)

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # The sum of squares in float64, the scale in float32 (engine/math_cpu.cc RmsNorm).
        ms = (x.double().square().sum(-1, keepdim=True) / x.shape[-1]).float()
        inv = 1.0 / torch.sqrt(ms + self.config.eps)
        return x * inv * weight

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [m][H][d] (float32); rotates pairs (2i, 2i+1) of the first rope_dim by
        position · inv_freq[i]."""
        r = self.config.rope_dim
        angle = positions.to(torch.float64)[:, None] * self.inv_freq[None, :]  # [m][r/2]
        cos = torch.cos(angle).float()[:, None, :]
        sin = torch.sin(angle).float()[:, None, :]
        x0, x1 = x[..., 0:r:2], x[..., 1:r:2]
        out = x.clone()
        out[..., 0:r:2] = x0 * cos - x1 * sin
        out[..., 1:r:2] = x0 * sin + x1 * cos
        return out

    def _qkv(self, layer: int, x: torch.Tensor, positions: torch.Tensor):
        c, p = self.config, "blk.%d." % layer
        h = self._rms_norm(x, self.w[p + "attn_norm.weight"])
        m = x.shape[0]
        q = F.linear(h, self.w[p + "attn_q.weight"]).view(m, c.q_heads, c.head_dim)
        k = F.linear(h, self.w[p + "attn_k.weight"]).view(m, c.kv_heads, c.head_dim)
        v = F.linear(h, self.w[p + "attn_v.weight"]).view(m, c.kv_heads, c.head_dim)
        return self._rope(q, positions), self._rope(k, positions), v

    def _finish_layer(self, layer: int, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        p = "blk.%d." % layer
        x = x + F.linear(attn, self.w[p + "attn_output.weight"])
        h = self._rms_norm(x, self.w[p + "ffn_norm.weight"])
        g = F.linear(h, self.w[p + "ffn_gate.weight"])
        u = F.linear(h, self.w[p + "ffn_up.weight"])
        return x + F.linear(g / (1.0 + torch.exp(-g)) * u, self.w[p + "ffn_down.weight"])

    @staticmethod
    def _runs_policies(seq: kv.Sequence) -> bool:
        o = seq.options
        return o.budget_policy != "fixed" or o.residency_policy != "none"

    def _hidden_delta(self, seq: kv.Sequence, layer: int, x: torch.Tensor, first: bool,
                      out: torch.Tensor) -> None:
        """out[:, layer] = ||x_t - x_(t-1)|| for the rows of x, the hidden states after
        `layer` (0 for the sequence's first token); keeps the last row for the next call."""
        last = self._last_hidden[seq]
        prev = x[:1] if first else last[layer][None]
        out[:, layer] = torch.linalg.vector_norm(x - torch.cat([prev, x[:-1]]), dim=1)
        last[layer] = x[-1]

    def _logits(self, x_last: torch.Tensor) -> torch.Tensor:
        h = self._rms_norm(x_last, self.w["output_norm.weight"])
        return F.linear(h, self.output)[0]

    def _causal_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          pos0: int) -> torch.Tensor:
        """q [m][Hq][d] at positions pos0 .. pos0+m-1 over k, v [pos0+m][Hkv][d] (float32):
        [m][Hq·d]."""
        c = self.config
        m, n, g = q.shape[0], k.shape[0], c.q_heads // c.kv_heads
        qh = q.view(m, c.kv_heads, g, c.head_dim).permute(1, 2, 0, 3)  # [Hkv][g][m][d]
        kh = k.permute(1, 0, 2)[:, None]                                 # [Hkv][1][n][d]
        vh = v.permute(1, 0, 2)[:, None]
        s = torch.matmul(qh, kh.transpose(-1, -2)) * self.scale          # [Hkv][g][m][n]
        rows = torch.arange(m, device=q.device)[:, None] + pos0
        cols = torch.arange(n, device=q.device)[None, :]
        s = s.masked_fill(cols > rows, float("-inf"))
        o = torch.matmul(torch.softmax(s, dim=-1), vh)                   # [Hkv][g][m][d]
        return o.permute(2, 0, 1, 3).reshape(m, c.q_heads * c.head_dim)

    def _kv_dtype(self, seq: kv.Sequence) -> torch.dtype:
        return _TORCH_DTYPES[seq.geometry.dtype]

    def _check_seq(self, seq: kv.Sequence) -> None:
        c, g = self.config, seq.geometry
        if (g.num_layers, g.num_q_heads, g.num_kv_heads, g.head_dim) != (
                c.layers, c.q_heads, c.kv_heads, c.head_dim):
            raise ValueError("the sequence's geometry %s does not fit the model (%d layers, "
                             "%d/%d heads of %d)" % (g, c.layers, c.q_heads, c.kv_heads,
                                                     c.head_dim))

    def _check_ids(self, ids: Seq[int]) -> None:
        for t in ids:
            if not 0 <= int(t) < self.config.vocab:
                raise ValueError("token id %d outside the vocabulary [0, %d)" %
                                 (int(t), self.config.vocab))

    # -- the engine's calls ------------------------------------------------------------------
    @torch.no_grad()
    def prefill(self, seq: kv.Sequence, ids: Seq[int]) -> torch.Tensor:
        """Runs the prompt `ids` (positions 0 ..) through the model in chunks and appends every
        layer's K/V to the empty sequence `seq`; returns the next-token logits [vocab]
        (float32)."""
        c = self.config
        self._check_seq(seq)
        if len(ids) < 1:
            raise ValueError("prefill: the prompt has no tokens")
        if seq.num_tokens(0) != 0:
            raise ValueError("prefill: the sequence already holds %d tokens" % seq.num_tokens(0))
        self._check_ids(ids)
        dt = self._kv_dtype(seq)
        n = len(ids)
        # The prompt's own K/V in float32, for the prefill's attention.
        keys = [torch.empty(n, c.kv_heads, c.head_dim, device=self.device) for _ in range(c.layers)]
        values = [torch.empty_like(keys[0]) for _ in range(c.layers)]
        ids_t = torch.as_tensor(list(ids), dtype=torch.long, device=self.device)
        logits = None
        policies = self._runs_policies(seq)
        window = min(self.observe_window, n) if policies else 0
        observed = [torch.empty(window, c.q_heads, c.head_dim, dtype=dt, device=self.device)
                    for _ in range(c.layers)]
        if policies:
            self._last_hidden[seq] = torch.zeros(c.layers, c.dim, device=self.device)
        for pos0 in range(0, n, self.prefill_chunk):
            m = min(self.prefill_chunk, n - pos0)
            positions = torch.arange(pos0, pos0 + m, device=self.device)
            x = self.w["token_embd.weight"][ids_t[pos0:pos0 + m]]
            delta = torch.empty(m, c.layers, device=self.device) if policies else None
            lo = max(pos0, n - window)  # the prompt's last `window` queries
            for layer in range(c.layers):
                q, k, v = self._qkv(layer, x, positions)
                keys[layer][pos0:pos0 + m] = k
                values[layer][pos0:pos0 + m] = v
                attn = self._causal_attention(q, keys[layer][:pos0 + m],
                                              values[layer][:pos0 + m], pos0)
                seq.append(layer, k.to(dt).contiguous(), v.to(dt).contiguous())
                if lo < pos0 + m:
                    first = n - window
                    observed[layer][lo - first:pos0 + m - first] = q[lo - pos0:].to(dt)
                x = self._finish_layer(layer, x, attn)
                if policies:
                    self._hidden_delta(seq, layer, x, pos0 == 0, delta)
            if policies:
                seq.report_signals(pos0, m, hidden_delta=delta.cpu().contiguous().numpy())
            logits = self._logits(x[-1:])
        if policies:
            for layer in range(c.layers):
                if window > 0:
                    seq.observe_queries(layer, observed[layer].contiguous(), n - window)
            seq.report_signals(0, n, logits=logits.cpu().contiguous().numpy())
        return logits

    @torch.no_grad()
    def step(self, seq: kv.Sequence, token: int) -> torch.Tensor:
        """One decode step of `token` at position seq.num_tokens(0): per layer its K/V
        appended and kvtier's attention over the working set; returns the next-token logits
        [vocab] (float32)."""
        c = self.config
        self._check_ids([token])
        pos = seq.num_tokens(0)
        if pos < 1:
            raise ValueError("step: prefill the sequence first")
        dt = self._kv_dtype(seq)
        positions = torch.tensor([pos], device=self.device)
        x = self.w["token_embd.weight"][int(token)][None]
        out = torch.empty(c.q_heads, c.head_dim, dtype=dt, device=self.device)
        policies = self._runs_policies(seq) and seq in self._last_hidden
        delta = torch.empty(1, c.layers, device=self.device) if policies else None
        for layer in range(c.layers):
            q, k, v = self._qkv(layer, x, positions)
            q_kv = q[0].to(dt).contiguous()
            seq.append(layer, k.to(dt).contiguous(), v.to(dt).contiguous())
            seq.decode(layer, q_kv, out)
            attn = out.float().view(1, c.q_heads * c.head_dim)
            x = self._finish_layer(layer, x, attn)
            if policies:
                self._hidden_delta(seq, layer, x, False, delta)
        logits = self._logits(x)
        if policies:
            seq.report_signals(pos, 1, logits=logits.cpu().contiguous().numpy(),
                               hidden_delta=delta.cpu().contiguous().numpy())
        return logits

    def generate(self, seq: kv.Sequence, ids: Seq[int], n: int,
                 stop_at_eos: bool = True) -> List[int]:
        """Greedy decoding: prefill `ids` into the empty `seq`, then up to `n` tokens (the
        first from the prompt's logits, each next one from a step), stopping after the
        end-of-text token when stop_at_eos; waits for the sequence's work before it returns."""
        if n < 1:
            raise ValueError("generate: n = %d: must be >= 1" % n)
        logits = self.prefill(seq, ids)
        tokens: List[int] = []
        while True:
            t = int(torch.argmax(logits))  # the first of equal maxima, as std::max_element
            tokens.append(t)
            if len(tokens) >= n or (stop_at_eos and t == self.config.eos):
                break
            logits = self.step(seq, t)
        seq.wait()
        return tokens


def detokenize(meta: Dict[str, Any], ids: Seq[int]) -> str:
    """The text of `ids` for a byte-level BPE (GPT-2) vocabulary in the file's metadata;
    special tokens (<|bos|>, <|eos|>: token type 3) are left out."""
    if meta.get("tokenizer.ggml.model") != "gpt2":
        return ""
    bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) +
          list(range(ord("®"), ord("ÿ") + 1)))
    cs, extra = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + extra)
            extra += 1
    inv = {chr(c): b for b, c in zip(bs, cs)}
    tokens = meta.get("tokenizer.ggml.tokens", [])
    types = meta.get("tokenizer.ggml.token_type", [])
    data = bytearray()
    for i in ids:
        if i < len(types) and types[i] == 3:
            continue
        data += bytes(inv[ch] for ch in tokens[i] if ch in inv)
    return data.decode("utf-8", errors="replace")


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m kvtier.llama",
        description="Greedy generation with a GGUF Llama model in torch over a kvtier sequence "
                    "(the control flow of kvtier-run generate, from Python).")
    ap.add_argument("--model", required=True, help="GGUF file (llama architecture, F32/F16)")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt-ids-from", metavar="JSON",
                     help="a JSON file whose 'prompt_ids' are the prompt (golden.json)")
    src.add_argument("--ids", help="the prompt's token ids, comma-separated")
    ap.add_argument("-n", "--new-tokens", type=int, default=64, help="tokens to generate")
    ap.add_argument("--mode", default="speculative",
                    help="full, speculative, sync or drop; a comma list runs each in turn")
    ap.add_argument("--budget", type=int, default=512,
                    help="working set in tokens (not full mode), a multiple of 4 pages")
    ap.add_argument("--page-size", type=int, default=32)
    ap.add_argument("--tau", type=float, default=0.7, help="speculative correction threshold")
    ap.add_argument("--trigger", default="cosine", help="cosine or mass")
    ap.add_argument("--max-loss", type=float, default=0.1, help="the mass trigger's loss")
    ap.add_argument("--budget-policy", default="fixed",
                    help="fixed, confidence, xkv, kv_compress (docs/policies.md)")
    ap.add_argument("--residency-policy", default="none",
                    help="none, h2o, attention, epiphany, kv_compress")
    ap.add_argument("--policy-param", action="append", default=[], metavar="KEY=VALUE",
                    help="a policy parameter (repeatable)")
    ap.add_argument("--kv-dtype", default="float16", choices=sorted(_TORCH_DTYPES))
    ap.add_argument("--prefill-chunk", type=int, default=256)
    ap.add_argument("--device", default="cpu", help="cpu or cuda (torch and kvtier)")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's)")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--quiet", action="store_true", help="print only the JSON summary line")
    a = ap.parse_args(argv)

    if a.threads > 0:
        torch.set_num_threads(a.threads)
    # What a user can get wrong (a path, a file, an id list) is a message, not a traceback.
    try:
        if a.prompt_ids_from:
            with open(a.prompt_ids_from, encoding="utf-8") as f:
                ids = [int(t) for t in json.load(f)["prompt_ids"]]
        else:
            ids = [int(t) for t in a.ids.split(",") if t.strip()]
        model = LlamaModel.from_gguf(a.model, device=a.device, prefill_chunk=a.prefill_chunk)
        meta, _ = gguf.read(a.model)
    except (OSError, ValueError, KeyError) as e:
        print("kvtier.llama: %s" % e, file=sys.stderr)
        return 2
    params = {}
    for kv_arg in a.policy_param:
        key, eq, value = kv_arg.partition("=")
        if not eq or not key:
            print("kvtier.llama: --policy-param %r: must be KEY=VALUE" % kv_arg, file=sys.stderr)
            return 2
        params[key] = value
    dev = kv.Device(a.device)
    runs = []
    for mode in [m.strip() for m in a.mode.split(",") if m.strip()]:
        opts = run_options(mode, a.budget, len(ids), a.new_tokens, a.page_size, a.tau,
                           a.trigger, a.max_loss, budget_policy=a.budget_policy,
                           residency_policy=a.residency_policy, policy_params=params)
        if a.device != "cpu" and torch.cuda.is_available():
            opts.stream = torch.cuda.current_stream()
        seq = kv.Sequence(dev, model.geometry(a.kv_dtype, a.page_size), opts)
        t0 = time.perf_counter()
        tokens = model.generate(seq, ids, a.new_tokens)
        seconds = time.perf_counter() - t0
        st = seq.stats()
        runs.append({"mode": mode, "budget_tokens": opts.budget_tokens,
                     "max_tokens": opts.max_tokens, "tokens": tokens,
                     "correction_rate": seq.correction_rate(),
                     "checked_heads": st["checked_heads"],
                     "corrected_heads": st["corrected_heads"], "steps": st["steps"],
                     "seconds": round(seconds, 4), "text": detokenize(meta, tokens)})
        seq.close()
        del seq
        if not a.quiet:
            r = runs[-1]
            print("[%s] %d tokens in %.2f s, correction rate %.5f (%d of %d heads)" %
                  (mode, len(tokens), seconds, r["correction_rate"], r["corrected_heads"],
                   r["checked_heads"]), file=sys.stderr)
            print("  tokens: %s" % ",".join(map(str, tokens)), file=sys.stderr)
            print("  text:   %r" % r["text"], file=sys.stderr)
    result = {"model": a.model, "config": dataclasses.asdict(model.config),
              "prompt_tokens": len(ids), "new_tokens": a.new_tokens,
              "kv_dtype": a.kv_dtype, "page_size": a.page_size, "runs": runs}
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
            f.write("\n")
    print(json.dumps({"runs": [{k: r[k] for k in ("mode", "tokens", "correction_rate")}
                               for r in runs]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
