#!/usr/bin/env python3
"""The project's model in Hugging Face transformers, generating with kvtier's cache.

Takes (or exports, from the GGUF with engine/model/train.py's --export-hf) the model in
transformers' format, loads it as LlamaForCausalLM, and generates N tokens greedily from a
prompt three times:
  1. transformers alone: SDPA attention and DynamicCache (the reference);
  2. KvtierCache in full mode, the attention "kvtier" (kvtier.hf.register()): the K/V live in
     kvtier and every decode step is kvtier's attention over all of them — the tokens must be
     identical to 1's;
  3. KvtierCache in speculative mode at a small budget: agreement with 1's tokens and the
     correction rate are reported.
It also checks the export: with the golden prompt in float32, transformers' logits at the
last prompt position against engine/model/golden/logits.f32 (train.py's own forward).
Writes a JSON result (--out) and exits 1 when a check fails, 2 when something it needs is
missing (transformers, torch, the kvtier package or library).

  PYTHONPATH=client/python KVTIER_LIBRARY=build/libkvtier.so \\
      python3 client/python/examples/hf_generate.py --device cuda --out hf_generate.json

Needs torch and transformers (5.x; 4.56+ should do), the kvtier package (client/python, or a
build tree's) and libkvtier (KVTIER_LIBRARY, or the build tree's), built with CUDA for
--device cuda.
"""

import argparse
import importlib.util
import json
import os
import platform
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.normpath(os.path.join(HERE, "..", "..", ".."))
# The model, its golden files and train.py: $KVTIER_MODEL_DIR (the GPU bundle's data/model),
# else the repository's engine/model.
MODEL_DIR = os.environ.get("KVTIER_MODEL_DIR") or os.path.join(REPO, "engine", "model")


def fail(code, message):
    print("hf_generate.py: " + message, file=sys.stderr)
    sys.exit(code)


def import_kvtier_hf():
    if os.environ.get("KVTIER_PYTHONPATH"):
        sys.path.insert(0, os.environ["KVTIER_PYTHONPATH"])
    try:
        import kvtier  # noqa: F401
    except ImportError:
        sys.path.insert(0, os.path.normpath(os.path.join(HERE, "..")))  # the source package
    try:
        import kvtier.hf as khf
        from kvtier import local
        local._native.lib()
    except (ImportError, OSError) as e:
        fail(2, "the kvtier package or libkvtier is not usable (PYTHONPATH=client/python, "
                "KVTIER_LIBRARY=build/libkvtier.so): %s" % e)
    if not khf.HAVE_TRANSFORMERS:
        fail(2, "kvtier.hf found no usable transformers: " + khf.TRANSFORMERS_ERROR)
    return khf


def hf_directory(args):
    """The transformers directory: --hf-dir when it holds config.json, else exported there (or
    to a temporary directory) from --gguf by train.py."""
    if args.hf_dir and os.path.exists(os.path.join(args.hf_dir, "config.json")):
        return args.hf_dir, False
    out = args.hf_dir or os.path.join(tempfile.mkdtemp(prefix="kvtier-hf-"), "kvtier-tiny")
    spec = importlib.util.spec_from_file_location("kvtier_train",
                                                  os.path.join(MODEL_DIR, "train.py"))
    train = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(train)
    except ImportError as e:
        fail(2, "exporting needs engine/model/train.py's imports (numpy, regex): %s" % e)
    train.export_hf_from_gguf(args.gguf, out)
    return out, True


def prompt_ids(args):
    """--prompt-ids (a JSON list, or a JSON object with "prompt_ids"), default the golden
    prompt; cut to --prompt-tokens when given."""
    path = args.prompt_ids or os.path.join(MODEL_DIR, "golden", "golden.json")
    with open(path) as f:
        data = json.load(f)
    ids = data["prompt_ids"] if isinstance(data, dict) else data
    if args.prompt_tokens:
        ids = ids[:args.prompt_tokens]
    return [int(i) for i in ids], path


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hf-dir", help="the model in transformers' format (exported here from "
                                     "--gguf when it has no config.json)")
    ap.add_argument("--gguf", default=os.path.join(MODEL_DIR, "kvtier-tiny.gguf"),
                    help="the GGUF to export when --hf-dir has no model")
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--dtype", choices=("float32", "float16", "bfloat16"),
                    help="the model's dtype (default float32 on cpu, float16 on cuda)")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--prompt-ids", help="JSON token ids (default engine/model/golden's prompt)")
    ap.add_argument("--prompt-tokens", type=int, default=0, help="use the first N prompt ids")
    ap.add_argument("--budget-tokens", type=int, default=128,
                    help="speculative mode's working set (a multiple of 4 pages)")
    ap.add_argument("--page-size", type=int, default=32)
    ap.add_argument("--out", help="write the JSON result here (it is printed either way)")
    args = ap.parse_args()

    try:
        import torch
        import transformers
        from transformers import DynamicCache, LlamaForCausalLM
    except ImportError as e:
        fail(2, "needs torch and transformers (pip install torch 'transformers>=5'); not "
                "importable here: %s" % e)
    khf = import_kvtier_hf()

    device = torch.device(args.device)
    dtype_name = args.dtype or ("float16" if device.type == "cuda" else "float32")
    dtype = getattr(torch, dtype_name)
    version = tuple(int("".join(c for c in x if c.isdigit()) or 0)
                    for x in transformers.__version__.split(".")[:2])
    hf_dir, exported = hf_directory(args)
    ids, prompt_path = prompt_ids(args)
    n = args.new_tokens
    input_ids = torch.tensor([ids], device=device)

    def load(attn):
        kw = {"attn_implementation": attn, ("dtype" if version >= (4, 56) else "torch_dtype"):
              dtype}
        return LlamaForCausalLM.from_pretrained(hf_dir, **kw).to(device).eval()

    def generate(model, cache):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.time()
        with torch.no_grad():
            out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                                 past_key_values=cache, max_new_tokens=n, min_new_tokens=n,
                                 do_sample=False, num_beams=1,
                                 pad_token_id=model.config.eos_token_id)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return out[0, len(ids):].tolist(), round(time.time() - t0, 3)

    def compare(tokens, reference):
        same = [a == b for a, b in zip(tokens, reference)]
        first = same.index(False) if False in same else None
        return {"agreement": round(sum(same) / max(1, len(reference)), 4),
                "first_divergence": first, "identical": tokens == reference}

    result = {"ok": True, "checks": [], "device": str(device), "dtype": dtype_name,
              "versions": {"python": platform.python_version(), "torch": torch.__version__,
                           "transformers": transformers.__version__},
              "hf_dir": hf_dir, "exported": exported, "prompt": prompt_path,
              "prompt_tokens": len(ids), "new_tokens": n}

    def check(name, ok, detail):
        result["checks"].append({"name": name, "ok": bool(ok), "detail": detail})
        result["ok"] = result["ok"] and bool(ok)

    if device.type == "cuda":
        result["gpu"] = torch.cuda.get_device_name()

    # 1. transformers alone.
    base = load("sdpa")
    golden_logits = os.path.join(MODEL_DIR, "golden", "logits.f32")
    if not args.prompt_ids and not args.prompt_tokens and dtype_name == "float32" and \
            os.path.exists(golden_logits):
        import numpy as np
        with torch.no_grad():
            last = base(input_ids).logits[0, -1].float().cpu()
        want = torch.from_numpy(np.fromfile(golden_logits, dtype="<f4")[:last.numel()].copy())
        diff = float((last - want).abs().max())
        check("export: transformers' logits at the last prompt position equal train.py's "
              "golden ones (atol 2e-3)", diff < 2e-3 and int(last.argmax()) == int(want.argmax()),
              {"max_abs_diff": diff})
    try:
        dynamic = DynamicCache(config=base.config)
    except TypeError:
        dynamic = DynamicCache()
    reference, seconds = generate(base, dynamic)
    result["dynamic"] = {"tokens": reference, "seconds": seconds}
    del base

    # 2. and 3. kvtier's cache and attention.
    khf.register()
    model = load(khf.ATTN_IMPLEMENTATION)
    runs = (("kvtier_full", dict(mode="full")),
            ("kvtier_speculative", dict(mode="speculative", budget_tokens=args.budget_tokens)))
    for name, options in runs:
        cache = khf.KvtierCache(model.config, page_size=args.page_size,
                                max_tokens=len(ids) + n + args.page_size, **options)
        tokens, seconds = generate(model, cache)
        steps = [state.steps for state in cache.core.layers]
        stats = cache.stats()
        entry = {"options": options, "tokens": tokens, "seconds": seconds,
                 "decode_steps_per_layer": steps, "correction_rate": cache.correction_rate(),
                 "stats": {k: stats.get(k, 0) for k in (
                     "steps", "appended_tokens", "checked_heads", "corrected_heads",
                     "recalled_pages", "host_waits")}}
        entry.update(compare(tokens, reference))
        result[name] = entry
        check("%s: every decode step ran kvtier's attention (%d per layer)" % (name, n - 1),
              steps == [n - 1] * len(steps), {"steps": steps})
        cache.core.close()
    check("kvtier_full: the tokens are DynamicCache's", result["kvtier_full"]["identical"],
          {"first_divergence": result["kvtier_full"]["first_divergence"]})

    text = json.dumps(result, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text)
    for c in result["checks"]:
        print("%s  %s" % ("ok  " if c["ok"] else "FAIL", c["name"]), file=sys.stderr)
    print("speculative (budget %d tokens): agreement %.3f, correction rate %.3f"
          % (args.budget_tokens, result["kvtier_speculative"]["agreement"],
             result["kvtier_speculative"]["correction_rate"]), file=sys.stderr)
    sys.exit(0 if result["ok"] else 1)


if __name__ == "__main__":
    main()
