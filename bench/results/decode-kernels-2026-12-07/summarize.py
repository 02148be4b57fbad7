import json,statistics as st,sys,glob
# usage: summ_md.py MODEL before now
m,bef,now=sys.argv[1:4]
def metrics(d):
    out={'prefill 512 tok/s':d['prefill'][0]['tok_per_s']}
    for x in d['decode']: out['decode b%d tok/s'%x['batch']]=x['tok_per_s']
    out['RSS after load MiB']=d['rss_after_load_bytes']/2**20
    return out
rounds=sorted({f.rsplit('-',1)[1].split('.')[0] for f in glob.glob(f'llama-{m}-*.json')})
vals={}
for i in rounds:
    try:
        L=metrics(json.load(open(f'llama-{m}-{i}.json'))); B=metrics(json.load(open(f'{bef}-{m}-{i}.json'))); N=metrics(json.load(open(f'{now}-{m}-{i}.json')))
    except Exception as e: continue
    for k in L: vals.setdefault(k,[]).append((L[k],B[k],N[k]))
print(f"### {m}\nrounds complete: {len(next(iter(vals.values())))}\n")
print("| metric | llama.cpp | duet before | duet now | before / llama.cpp | now / llama.cpp | now / before | now / llama.cpp per round |")
print("|---|---:|---:|---:|---:|---:|---:|---|")
for k,xs in vals.items():
    med=lambda f: st.median(f(x) for x in xs)
    print(f"| {k} | {med(lambda x:x[0]):.1f} | {med(lambda x:x[1]):.1f} | {med(lambda x:x[2]):.1f} | {med(lambda x:x[1]/x[0]):.2f}x | {med(lambda x:x[2]/x[0]):.2f}x | {med(lambda x:x[2]/x[1]):.2f}x | {', '.join('%.2f'%(x[2]/x[0]) for x in xs)} |")
print()
