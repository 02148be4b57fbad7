# usage (in this directory): python3 summarize.py MODEL
import glob, json, statistics as st, sys
m = sys.argv[1]
def metrics(d):
    out = {'prefill 512 tok/s': d['prefill'][0]['tok_per_s']}
    for x in d['decode']:
        out['decode b%d tok/s' % x['batch']] = x['tok_per_s']
    out['RSS after load MiB'] = d['rss_after_load_bytes'] / 2**20
    return out
vals = {}
for f in sorted(glob.glob(f'llama-{m}-*.json')):
    i = f.rsplit('-', 1)[1].split('.')[0]
    try:
        L = metrics(json.load(open(f))); D = metrics(json.load(open(f'duet-{m}-{i}.json')))
    except Exception:
        continue
    for k in L:
        vals.setdefault(k, []).append((L[k], D[k]))
print(f"### {m}\nrounds complete: {len(next(iter(vals.values())))}\n")
print("| metric | llama.cpp | duet | duet / llama.cpp (median of rounds) | per round |")
print("|---|---:|---:|---:|---|")
for k, xs in vals.items():
    print(f"| {k} | {st.median(x[0] for x in xs):.1f} | {st.median(x[1] for x in xs):.1f} | "
          f"{st.median(x[1] / x[0] for x in xs):.2f}x | {', '.join('%.2f' % (x[1] / x[0]) for x in xs)} |")
print()
