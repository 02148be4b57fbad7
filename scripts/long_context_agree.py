#!/usr/bin/env python3
"""Greedy agreement of duet's KV policies with full attention on long prompts.

For each prompt (passages of the bench corpus, each followed by a question about its
beginning), `duet run --attention POLICY --json` generates greedily; a policy's agreement on
a prompt is the number of leading tokens equal to full attention's. Also reports the KV a
sequence keeps after its prompt (tokens of KV held per layer and head).

    long_context_agree.py DUET MODEL CORPUS OUT.jsonl [--prompts 8] [--tokens 1500]
        [--max-tokens 64] [--policies "window=1024,sinks=4 snapkv=1024"] [--table]

A policy's share on a prompt is its leading tokens equal to full attention's over the
tokens full attention generated (it may stop early at an end-of-sequence token).

A policy written `NAME@ROUTER` (e.g. `int8@http://127.0.0.1:50051`) is served instead: the
prompt goes through `duet generate --router ROUTER` under full attention, so what the cluster
behind that router does to the KV (a remote prefill with `--kv-compression int8`, say) is
compared with `duet run`'s full attention; rows name it NAME.
"""
import argparse
import json
import statistics
import subprocess
import sys


def passages(corpus, n, approx_tokens):
    text = open(corpus, encoding="utf-8").read()
    # About 4.2 characters per token in this corpus; passages start at even offsets.
    size = int(approx_tokens * 4.2)
    step = max(1, (len(text) - size) // n)
    out = []
    for i in range(n):
        body = text[i * step:i * step + size]
        out.append(body + "\n\nQuestion: who is named in the first sentence of the text above?\nAnswer:")
    return out


def run(duet, model, prompt, policy, max_tokens, chat=False):
    o = subprocess.run(
        [duet, "run", "--model", model, "--prompt", prompt, "--max-tokens", str(max_tokens),
         "--attention", policy, "--json"] + (["--chat"] if chat else []),
        capture_output=True, text=True, check=False)
    if o.returncode != 0:
        sys.exit(f"duet run --attention {policy}: {o.stderr}")
    r = json.loads(o.stdout)
    return r["prompt_ids"], r["ids"]


def served(duet, router, prompt, max_tokens, chat=False):
    o = subprocess.run(
        [duet, "generate", "--router", router, "--prompt", prompt, "--max-tokens",
         str(max_tokens), "--attention", "full", "--json"] + (["--chat"] if chat else []),
        capture_output=True, text=True, check=False)
    if o.returncode != 0:
        sys.exit(f"duet generate --router {router}: {o.stderr}")
    return json.loads(o.stdout)["ids"]


def generate(a, prompt, policy, max_tokens, chat=False):
    """Greedy ids of `prompt` under `policy` (`NAME@ROUTER`: served by that router)."""
    if "@" in policy:
        return served(a.duet, policy.split("@", 1)[1], prompt, max_tokens, chat)
    return run(a.duet, a.model, prompt, policy, max_tokens, chat)[1]


def label(policy):
    return policy.split("@", 1)[0]


def kept_tokens(policy, prompt_len):
    """KV positions per layer and head a sequence keeps once its prompt is computed."""
    if "@" in policy:
        return prompt_len
    if policy == "full":
        return prompt_len
    kv = dict(p.split("=") for p in policy.split(","))
    if "window" in kv:
        w, s = int(kv["window"]), int(kv.get("sinks", 4))
        return min(prompt_len, w + s)
    return min(prompt_len, int(kv["snapkv"]))


def lead(a, b):
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("duet")
    ap.add_argument("model")
    ap.add_argument("corpus")
    ap.add_argument("out")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=1500)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--policies",
                    default="window=1024,sinks=4 window=512,sinks=4 snapkv=1024 snapkv=512")
    ap.add_argument("--table", action="store_true", help="only print the table of OUT.jsonl")
    ap.add_argument("--reference", help="llama.cpp's reference cases (JSONL) instead of passages")
    a = ap.parse_args()
    policies = a.policies.split()
    if a.reference:
        return reference(a, policies)
    if a.table:
        rows = [json.loads(line) for line in open(a.out) if line.strip()]
        table(rows, policies, a.prompts, a.tokens, a.max_tokens)
        return
    rows = []
    with open(a.out, "w") as f:
        for i, p in enumerate(passages(a.corpus, a.prompts, a.tokens)):
            prompt_ids, full = run(a.duet, a.model, p, "full", a.max_tokens)
            for policy in policies:
                ids = generate(a, p, policy, a.max_tokens)
                r = {"prompt": i, "prompt_tokens": len(prompt_ids), "policy": label(policy),
                     "agree": lead(ids, full), "generated": len(full),
                     "kept": kept_tokens(policy, len(prompt_ids))}
                rows.append(r)
                f.write(json.dumps(r) + "\n")
                f.flush()
    table(rows, policies, a.prompts, a.tokens, a.max_tokens)


def table(rows, policies, prompts, tokens, max_tokens):
    print(f"{prompts} prompts of about {tokens} tokens, up to {max_tokens} greedy tokens each")
    print()
    print("| policy | KV kept after the prompt (median) | vs full | first token equal | "
          "share of full's tokens equal before the first difference (mean) | prompts fully equal |")
    print("|---|---|---|---|---|---|")
    full_kept = statistics.median(r["prompt_tokens"] for r in rows)
    for policy in map(label, policies):
        xs = [r for r in rows if r["policy"] == policy]
        kept = statistics.median(r["kept"] for r in xs)
        first = sum(r["agree"] >= 1 for r in xs)
        share = statistics.mean(r["agree"] / r["generated"] for r in xs)
        equal = sum(r["agree"] == r["generated"] for r in xs)
        print(f"| {policy} | {kept:.0f} tokens | {kept / full_kept - 1:+.0%} | {first}/{len(xs)} "
              f"| {share:.0%} | {equal}/{len(xs)} |")


def reference(a, policies):
    """The reference prompts (their own lengths, as many tokens as llama.cpp generated)."""
    cases = [json.loads(line) for line in open(a.reference) if line.strip()]
    rows = []
    with open(a.out, "w") as f:
        for c in cases:
            chat = c["kind"] == "chat"
            n = len(c["greedy_ids"])
            prompt_ids, full = run(a.duet, a.model, c["prompt"], "full", n, chat)
            if prompt_ids != c["prompt_ids"]:
                sys.exit(f"{c['id']}: prompt ids differ from the reference's")
            for policy in policies:
                ids = generate(a, c["prompt"], policy, n, chat)
                r = {"prompt": c["id"], "prompt_tokens": len(prompt_ids), "policy": label(policy),
                     "agree": lead(ids, full), "generated": len(full),
                     "kept": kept_tokens(policy, len(prompt_ids))}
                rows.append(r)
                f.write(json.dumps(r) + "\n")
    print(f"{len(cases)} reference prompts ({min(r['prompt_tokens'] for r in rows)} to "
          f"{max(r['prompt_tokens'] for r in rows)} tokens)")
    print()
    print("| policy | prompts equal to full attention | tokens equal before the first difference |")
    print("|---|---|---|")
    for policy in map(label, policies):
        xs = [r for r in rows if r["policy"] == policy]
        equal = [r["prompt"] for r in xs if r["agree"] == r["generated"]]
        differ = [f"{r['prompt']}: {r['agree']}/{r['generated']}" for r in xs if r["agree"] != r["generated"]]
        print(f"| {policy} | {len(equal)}/{len(xs)} | {'; '.join(differ) or 'all'} |")


if __name__ == "__main__":
    main()
