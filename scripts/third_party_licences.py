#!/usr/bin/env python3
"""Every crate compiled into the `duet` binary, with the licence it declares, as Markdown.

Reads `cargo metadata` (for x86_64 Linux) on stdin and walks the resolve from the `duet`
package through normal and build dependencies. scripts/build-image.sh puts the output in the
image at /usr/share/licenses/duet/THIRD-PARTY.md.
"""
import json
import sys

m = json.load(sys.stdin)
pk = {p["id"]: p for p in m["packages"]}
nodes = {n["id"]: n for n in m["resolve"]["nodes"]}
root = next(i for i, p in pk.items() if p["name"] == "duet")
seen, todo = set(), [root]
while todo:
    i = todo.pop()
    if i in seen:
        continue
    seen.add(i)
    todo += [
        d["pkg"]
        for d in nodes[i]["deps"]
        if any(k["kind"] in (None, "build") for k in d["dep_kinds"])
    ]
print("# Crates compiled into duet, with the licences they declare\n")
for p in sorted((pk[i] for i in seen if pk[i]["source"]), key=lambda p: p["name"]):
    print(f"- {p['name']} {p['version']}: {p['license'] or p['license_file']}")
