"""Compare two runs of the same bench suites (JSON from `ptxforge bench ... --json`), e.g.
the tree before a change (B) and after it (A), timed in one device call:

    python bench/ab_compare.py before/ after/      # each holding gemm.json, grouped.json, ...

Prints, per suite, the geomean of the time ratios (before / after: > 1 is faster after)
and the rows that moved by more than 3%; for decode, both trees' summaries and the rows'
% of the same-size copy side by side."""

import json
import math
import os
import sys

before_dir, after_dir = sys.argv[1:3]


def load(directory, name):
    path = os.path.join(directory, name)
    return json.load(open(path)) if os.path.exists(path) else None


def key(row):
    return tuple(row.get(f) for f in ("family", "layout", "groups", "m", "m_per_group", "n", "k"))


for name in ("gemm.json", "grouped.json", "bf16.json", "decode.json"):
    before, after = load(before_dir, name), load(after_dir, name)
    if not before or not after:
        continue
    rows = {key(r): r for r in before["rows"]}
    ratios = [(rows[key(r)]["ms"] / r["ms"], r) for r in after["rows"] if key(r) in rows]
    geomean = math.exp(sum(math.log(x) for x, _ in ratios) / len(ratios))
    print(f"{name}: {len(ratios)} rows, geomean before/after {geomean:.3f}")
    if name == "decode.json":
        for b, a in zip(before["summary"], after["summary"]):
            print("  before", {k: round(v, 3) if isinstance(v, float) else v for k, v in b.items()})
            print("  after ", {k: round(v, 3) if isinstance(v, float) else v for k, v in a.items()})
        for x, r in ratios:
            print(f"    {r['family']:6} g{r['groups']:<3} m{r['m']:<4} {r['n']:>6}x{r['k']:<6} "
                  f"of copy {rows[key(r)]['of_copy']:.2f} -> {r['of_copy']:.2f}")
    else:
        for x, r in ratios:
            if abs(x - 1) > 0.03:
                print(f"    {key(r)}: {x:.3f}")
