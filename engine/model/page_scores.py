"""Which page score lets a small working set copy? An emulation of kvtier's page selection on
the project's model, in torch, outside kvtier.

The copy task of `kvtier-run eval --task copy` (a held-out passage repeated `distance` tokens
later in a 4,096-token prompt; the loss on the repeat after its first 16 tokens), with the
prompt attended densely and every token of the repeat attending, per KV head, to the sink
pages, the recent pages and the top-k pages of a page score (budget split 1 : 2 : 1 by
default, kvtier's default when these runs were made; `--split`), selected with the step's own
query (kvtier's sync mode). Page scores:

  dense      full attention (the reference: full KV)
  center-mad q·(mean) + |q|·(mean absolute deviation) per page (ArkVale; kvtier's default before key-codes)
  minmax     Σ_i max(q_i·max_i, q_i·min_i) (Quest's bound; kvtier's other summary)
  max        the page's largest exact logit q·k_j (an oracle: needs every key)
  mass       the page's exact attention mass (an oracle)
  key-codes  kvtier's SummaryMode::kKeyCodes: the bounds and a 4-bit code per key and
             dimension; a page scores by the log-sum-exp of its decoded keys' logits
  sign       one bit per key dimension: center ± mean absolute deviation, best token
  qB         B-bit codes of every key dimension in the page's per-dimension [min, max]
             range (Quest's bounds plus B bits per token and dimension), best token
  rN         4-bit codes on the page's N widest dimensions, the page's mean elsewhere
  mix        the mean of center-mad's and q4's pooled distributions
  nearest    no score: the candidates nearest the end (the recent window made longer)

Also the perplexity task (--task text: the text's first 4,096 tokens, the last 512 stepped
and scored; perplexity and KL from the first score listed) and the single pass key
(--task niah: stepped decoding of the question and the greedy answer).

Each of the group's query heads scores the pages; the group pools softmax(scale·score) by
its mean, as kvtier's ScorePages does. Run with the python3 that trains the model:
  python3 engine/model/page_scores.py --scores dense,center-mad,max,q4 --trials 2
"""
import argparse
import json
import math
import os
import random
import sys
import time

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import gguf_write  # noqa: E402
import train  # noqa: E402


def page_pooled(kind, q, kp, scale):
    """pooled [Hkv][pages] for the group's queries q [Hkv][G][d] over full pages kp
    [Hkv][pages][page][d]."""
    Hkv, G = q.shape[0], q.shape[1]

    def best_token(kh):
        lg = torch.einsum("hgd,hpjd->hgpj", q, kh) * scale
        return torch.softmax(lg.amax(-1), -1).mean(1)

    if kind == "nearest":  # no score: the candidate pages nearest the end (a longer window)
        n = kp.shape[1]
        return torch.arange(n, dtype=torch.float32).expand(Hkv, n) / n
    if kind.startswith("mix"):  # the mean of center-mad's and 4-bit codes' distributions
        return 0.5 * page_pooled("center-mad", q, kp, scale) + 0.5 * page_pooled("q4", q, kp, scale)
    if kind in ("center-mad", "minmax"):
        if kind == "center-mad":
            c = kp.mean(2)
            m = (kp - c[:, :, None]).abs().mean(2)
            hi, lo = c + m, c - m
        else:
            hi, lo = kp.amax(2), kp.amin(2)
        raw = torch.maximum(torch.einsum("hgd,hpd->hgp", q, hi), torch.einsum("hgd,hpd->hgp", q, lo))
        return torch.softmax(scale * raw, -1).mean(1)
    if kind == "max":
        return best_token(kp)
    if kind == "mass":
        lg = torch.einsum("hgd,hpjd->hgpj", q, kp) * scale
        pr = torch.softmax(lg.reshape(Hkv, G, -1), -1).reshape(lg.shape)
        return pr.sum(-1).mean(1)
    if kind == "sign":
        c = kp.mean(2, keepdim=True)
        m = (kp - c).abs().mean(2, keepdim=True)
        return best_token(c + torch.sign(kp - c) * m)
    if kind == "key-codes":  # kvtier's SummaryMode::kKeyCodes: q4's keys, log-sum-exp
        lo, hi = kp.amin(2, keepdim=True), kp.amax(2, keepdim=True)
        step = (hi - lo) / 16
        code = torch.where(step > 0, ((kp - lo) / step.clamp_min(1e-30)).floor(), torch.zeros_like(kp))
        kh = lo + (code.clamp(0, 15) + 0.5) * step
        lg = torch.einsum("hgd,hpjd->hgpj", q, kh) * scale
        return torch.softmax(torch.logsumexp(lg, -1), -1).mean(1)
    if kind[0] in "qr":
        bits = int(kind[1:]) if kind[0] == "q" else 4
        lo, hi = kp.amin(2, keepdim=True), kp.amax(2, keepdim=True)
        step = (hi - lo).clamp_min(1e-6) / 2 ** bits
        kh = lo + (((kp - lo) / step).floor().clamp(0, 2 ** bits - 1) + 0.5) * step
        if kind[0] == "r":
            width = (hi - lo)[:, :, 0]
            keep = torch.zeros_like(width, dtype=torch.bool)
            keep.scatter_(-1, width.topk(int(kind[1:]), -1).indices, True)
            kh = torch.where(keep[:, :, None], kh, kp.mean(2, keepdim=True))
        return best_token(kh)
    raise ValueError(f"unknown score {kind}")


SPLIT = (1, 2, 1)


def split_pages(budget, page):
    """(sink, selected, recent) pages of a budget split as SPLIT (kvtier's --split)."""
    pages = budget // page
    sink = pages * SPLIT[0] // sum(SPLIT)
    recent = pages * SPLIT[2] // sum(SPLIT)
    return sink, pages - sink - recent, recent


def forward(model, cfg, ids, sparse_from, kind, budget, page, cache=None):
    """Logits for ids; positions >= sparse_from attend through selected working sets. Each
    layer's K and V ([Hkv][T][d]) are appended to `cache` when given."""
    T = len(ids)
    G, d = cfg.q_heads // cfg.kv_heads, cfg.head_dim
    scale = 1 / math.sqrt(d)
    sink, k_sel, recent = split_pages(budget, page)
    cos, sin = train.rope_tables(cfg, T)
    causal = torch.full((T, T), float("-inf")).triu(1)
    x = model.embed(torch.tensor(ids)[None])
    for blk in model.blocks:
        h = blk.attn_norm(x)
        q = blk.wq(h).view(1, T, cfg.q_heads, d).transpose(1, 2)
        k = blk.wk(h).view(1, T, cfg.kv_heads, d).transpose(1, 2)
        v = blk.wv(h).view(1, T, cfg.kv_heads, d).transpose(1, 2)
        q, k = train.apply_rope(q, cos, sin), train.apply_rope(k, cos, sin)
        if cache is not None:
            cache.append([k[0], v[0]])
        mask = causal[None].repeat(cfg.kv_heads, 1, 1)
        if kind != "dense":
            qg = q[0].view(cfg.kv_heads, G, T, d)
            for t in range(sparse_from, T):
                pages = (t + page) // page  # the page holding token t is the last
                first, last = sink, pages - recent  # candidates [first, last)
                allowed = torch.zeros(cfg.kv_heads, T, dtype=torch.bool)
                allowed[:, :sink * page] = True
                allowed[:, max(last, 0) * page:t + 1] = True
                if last > first:
                    kp = k[0, :, :last * page].reshape(cfg.kv_heads, last, page, d)
                    pooled = page_pooled(kind, qg[:, :, t], kp, scale)[:, first:]
                    top = pooled.topk(min(k_sel, last - first), -1).indices + first
                    for hh in range(cfg.kv_heads):
                        for p in top[hh].tolist():
                            allowed[hh, p * page:(p + 1) * page] = True
                allowed[:, t + 1:] = False
                mask[:, t] = torch.where(allowed, 0.0, float("-inf"))
        s = (q.reshape(1, cfg.kv_heads, G * T, d) @ k.transpose(-1, -2)).view(
            1, cfg.kv_heads, G, T, T) * scale
        p = torch.softmax(s + mask[None, :, None], -1).view(1, cfg.kv_heads, G * T, T)
        o = (p @ v).view(1, cfg.q_heads, T, d).transpose(1, 2).reshape(1, T, -1)
        x = x + blk.wo(o)
        h = blk.ffn_norm(x)
        x = x + blk.w_down(F.silu(blk.w_gate(h)) * blk.w_up(h))
    return (model.norm(x) @ model.embed.weight.t())[0]


def prefill(model, cfg, ids):
    """Dense forward over ids: the logits of the last position and every layer's K/V
    ([Hkv][T][d] each), as kvtier's prefill leaves them."""
    cache = []
    logits = forward(model, cfg, ids, len(ids), "dense", 0, 1, cache)
    return logits[-1], cache


def step(model, cfg, cache, token, kind, budget, page):
    """One decode step through selected working sets (kind "dense": every token); appends
    the token's K/V to cache and returns its logits."""
    G, d = cfg.q_heads // cfg.kv_heads, cfg.head_dim
    scale = 1 / math.sqrt(d)
    sink, k_sel, recent = split_pages(budget, page)
    pos = cache[0][0].shape[1]
    cos, sin = train.rope_tables(cfg, torch.tensor([[pos]]))
    x = model.embed(torch.tensor([[token]]))
    for li, blk in enumerate(model.blocks):
        h = blk.attn_norm(x)
        q = blk.wq(h).view(1, 1, cfg.q_heads, d).transpose(1, 2)
        k = blk.wk(h).view(1, 1, cfg.kv_heads, d).transpose(1, 2)
        v = blk.wv(h).view(1, 1, cfg.kv_heads, d).transpose(1, 2)
        q, k = train.apply_rope(q, cos[0], sin[0]), train.apply_rope(k, cos[0], sin[0])
        K = torch.cat([cache[li][0], k[0]], 1)
        V = torch.cat([cache[li][1], v[0]], 1)
        cache[li] = [K, V]
        qg = q[0, :, 0].view(cfg.kv_heads, G, d)
        T = pos + 1
        allowed = torch.ones(cfg.kv_heads, T, dtype=torch.bool)
        if kind != "dense":
            pages = (pos + page) // page
            first, last = sink, pages - recent
            allowed[:] = False
            allowed[:, :sink * page] = True
            allowed[:, max(last, 0) * page:] = True
            if last > first:
                kp = K[:, :last * page].reshape(cfg.kv_heads, last, page, d)
                pooled = page_pooled(kind, qg, kp, scale)[:, first:]
                top = pooled.topk(min(k_sel, last - first), -1).indices + first
                for hh in range(cfg.kv_heads):
                    for p in top[hh].tolist():
                        allowed[hh, p * page:(p + 1) * page] = True
        s = torch.einsum("hgd,htd->hgt", qg, K) * scale
        s = s.masked_fill(~allowed[:, None], float("-inf"))
        o = torch.einsum("hgt,htd->hgd", torch.softmax(s, -1), V).reshape(1, 1, -1)
        x = x + blk.wo(o)
        h = blk.ffn_norm(x)
        x = x + blk.w_down(F.silu(blk.w_gate(h)) * blk.w_up(h))
    return (model.norm(x[:, -1]) @ model.embed.weight.t())[0]


NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = " What is the pass key? The pass key is"


def answer_done(text):
    t = text.lstrip(" ")
    if not t:
        return False
    if not t[0].isdigit():
        return True
    i = 0
    while i < len(t) and t[i].isdigit():
        i += 1
    return i < len(t)


def niah(a, model, cfg, bpe, bos, text, scores, rng, out):
    """kvtier-run eval --task niah's single needle: the key stated once at each depth of the
    filler, the question and the greedy answer stepped through the working sets."""
    budget = a.budget
    out["niah"] = {k: {} for k in scores}
    for di in range(a.depths):
        depth = di / (a.depths - 1) if a.depths > 1 else 0.0
        t0 = time.time()
        for _ in range(a.trials):
            digits = rng.randint(5, 7)
            key = str(rng.randrange(10 ** (digits - 1), 10 ** digits))
            needle = bpe.encode(NEEDLE.replace("{key}", key))
            question = bpe.encode(QUESTION)
            fill = a.niah_context - len(needle) - len(question) - 1
            start = rng.randrange(0, len(text) - fill + 1)
            at = int(math.floor(depth * fill))
            ctx = [bos] + text[start:start + at] + needle + text[start + at:start + fill]
            logits0, cache0 = prefill(model, cfg, ctx)
            for kind in scores:
                cache = [[k.clone(), v.clone()] for k, v in cache0]
                logits = logits0
                for t in question:
                    logits = step(model, cfg, cache, t, kind, budget, a.page_size)
                ans = []
                for i in range(a.max_answer):
                    nxt = int(logits.argmax())
                    ans.append(nxt)
                    txt = bpe.decode(ans)
                    if answer_done(txt) or i + 1 == a.max_answer:
                        break
                    logits = step(model, cfg, cache, nxt, kind, budget, a.page_size)
                got = bpe.decode(ans).lstrip(" ")
                j = 0
                while j < len(got) and got[j].isdigit():
                    j += 1
                out["niah"][kind].setdefault(f"{depth:.2f}", []).append(int(got[:j] == key))
        print(f"depth {depth:.2f} " + " ".join(
            f"{k}={sum(out['niah'][k][f'{depth:.2f}'])}/{a.trials}" for k in scores)
            + f"  ({time.time() - t0:.0f} s)", flush=True)
    for k in scores:
        cells = [x for v in out["niah"][k].values() for x in v]
        print(f"{k}: {sum(cells)}/{len(cells)}", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=os.path.join(HERE, "kvtier-tiny.gguf"))
    ap.add_argument("--text", default=os.path.join(HERE, "golden", "eval.txt"))
    ap.add_argument("--scores", default="dense,center-mad,minmax,max,mass,sign,q2,q3,q4,r8,r16")
    ap.add_argument("--page-size", type=int, default=32)
    ap.add_argument("--divisor", type=int, default=16, help="budget = context / divisor")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--passage", type=int, default=128)
    ap.add_argument("--skip", type=int, default=16)
    ap.add_argument("--distances", default="512,1024,2048,3072")
    ap.add_argument("--trials", type=int, default=2)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--task", choices=["copy", "niah", "text"], default="copy")
    ap.add_argument("--depths", type=int, default=10, help="niah: needle depths")
    ap.add_argument("--steps", type=int, default=512, help="text: tokens stepped and scored")
    ap.add_argument("--niah-context", type=int, default=4080, help="niah: prompt tokens")
    ap.add_argument("--max-answer", type=int, default=12, help="niah: answer tokens at most")
    ap.add_argument("--budget", type=int, default=0,
                    help="working set in tokens (default: the context over --divisor; niah: "
                         "kvtier-run eval's rounding of it, 256 at 1/16)")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--split", default="1:2:1", help="sink:selected:recent parts of the budget")
    a = ap.parse_args()
    global SPLIT
    SPLIT = tuple(int(x) for x in a.split.split(":"))
    torch.set_num_threads(a.threads)
    kv, _ = gguf_write.read(a.model)
    cfg = train.Config(rope_base=float(kv["llama.rope.freq_base"]),
                       context=int(kv["llama.context_length"]))
    _, model = train.load_model_gguf(a.model, cfg)
    model.eval()
    tokens = kv["tokenizer.ggml.tokens"]
    bpe = train.Bpe(tokens, kv["tokenizer.ggml.merges"])
    bos = tokens.index(train.BOS)
    with open(a.text, encoding="utf-8") as f:
        text = bpe.encode(f.read())
    scores = a.scores.split(",")
    budget = a.budget or a.context // a.divisor
    rng = random.Random(a.seed)
    if a.task == "text":
        # kvtier-run eval's perplexity task: the text's first `context` tokens, the last
        # --steps of them stepped through the working sets.
        ids = ([bos] + text)[:a.context]
        L0 = a.context - a.steps
        y = torch.tensor(ids[1:])
        out = {"model": os.path.basename(a.model), "page_size": a.page_size, "budget": budget,
               "context": a.context, "steps": a.steps, "split": a.split, "ppl": {}}
        with torch.no_grad():
            ref = None
            for kind in scores:
                lg = forward(model, cfg, ids[:-1], L0, kind, budget, a.page_size)[L0 - 1:]
                nll = F.cross_entropy(lg, y[L0 - 1:], reduction="none")
                lp = F.log_softmax(lg, -1)
                if ref is None:
                    ref = lp
                kl = (ref.exp() * (ref - lp)).sum(-1).mean().item()
                out["ppl"][kind] = {"ppl": math.exp(nll.mean().item()), "kl": kl}
                print(f"{kind:12s} ppl {math.exp(nll.mean().item()):8.2f}  KL vs first {kl:.4f}",
                      flush=True)
        if a.json:
            with open(a.json, "w") as f:
                json.dump(out, f, indent=1)
        return
    if a.task == "niah":
        unit = 4 * a.page_size
        a.budget = a.budget or max(unit, (a.niah_context + a.max_answer + a.divisor * unit // 2)
                                   // (a.divisor * unit) * unit)
        out = {"model": os.path.basename(a.model), "page_size": a.page_size,
               "budget": a.budget, "context": a.niah_context, "trials": a.trials,
               "seed": a.seed, "split": a.split}
        print(f"niah: page {a.page_size}, budget {a.budget} tokens, {a.trials} trials",
              flush=True)
        with torch.no_grad():
            niah(a, model, cfg, bpe, bos, text, scores, rng, out)
        if a.json:
            with open(a.json, "w") as f:
                json.dump(out, f, indent=1)
        return
    P = a.passage
    out = {"model": os.path.basename(a.model), "page_size": a.page_size, "budget": budget,
           "context": a.context, "passage": P, "skip": a.skip, "trials": a.trials,
           "seed": a.seed, "split": a.split, "loss": {}, "first": {}}
    print(f"page {a.page_size}, budget 1/{a.divisor} = {budget} tokens, {a.trials} trials",
          flush=True)
    with torch.no_grad():
        for dist in [int(s) for s in a.distances.split(",")]:
            # As the eval's copy prompt: filler, the passage, filler, then the repeat.
            prefix, gap = a.context - 1 - dist - P, dist - P
            firsts, losses = [], {k: [] for k in scores}
            t0 = time.time()
            for _ in range(a.trials):
                ps = rng.randrange(0, len(text) - P + 1)
                passage = text[ps:ps + P]
                rest = text[:ps] + text[ps + P:]
                fs = rng.randrange(0, len(rest) - prefix - gap + 1)
                ctx = [bos] + rest[fs:fs + prefix] + passage + rest[fs + prefix:fs + prefix + gap]
                ids = ctx + passage
                y = torch.tensor(ids[1:])
                L0 = len(ctx)
                for kind in scores:
                    nll = F.cross_entropy(forward(model, cfg, ids[:-1], L0, kind, budget,
                                                  a.page_size), y, reduction="none")
                    losses[kind].append(nll[L0 - 1 + a.skip:].mean().item())
                    if kind == "dense":
                        firsts.append(nll[prefix + a.skip:prefix + P].mean().item())
            out["loss"][str(dist)] = {k: sum(v) / len(v) for k, v in losses.items()}
            if firsts:
                out["first"][str(dist)] = sum(firsts) / len(firsts)
            print(f"{dist:5d} " + " ".join(f"{k}={out['loss'][str(dist)][k]:.2f}" for k in scores)
                  + f"  ({time.time() - t0:.0f} s)", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
