#!/usr/bin/env python3
"""Summarise `ncu --page source --print-source sass --csv` output: per kernel, the warp-state
samples and executed instructions by opcode, and the hottest SASS lines.

Usage: ncu_hot_sass.py FILE.csv [TOP]
The CSV holds one table per profiled kernel; a table starts with a header row that has a
"Source" column. Column names vary between ncu versions, so they are matched by substring and
the header of the first table is printed.
"""
import csv
import sys
from collections import defaultdict


def find(header, *needles, avoid=()):
    for i, h in enumerate(header):
        if all(n.lower() in h.lower() for n in needles) and not any(a.lower() in h.lower() for a in avoid):
            return i
    return None


def num(x):
    try:
        return float(x.replace(",", ""))
    except (ValueError, AttributeError):
        return 0.0


def main():
    path = sys.argv[1]
    top = int(sys.argv[2]) if len(sys.argv) > 2 else 40
    tables, cur, title = [], None, ""
    with open(path, newline="", errors="replace") as f:
        for row in csv.reader(f):
            if not row:
                continue
            if any(c.strip() == "Source" for c in row):
                cur = {"header": row, "rows": [], "title": title}
                tables.append(cur)
            elif cur is not None and len(row) == len(cur["header"]):
                cur["rows"].append(row)
            else:
                title = " ".join(row)[:160]
    if not tables:
        print("no source tables found")
        return
    print("columns:", " | ".join(tables[0]["header"]))
    for t in tables:
        h = t["header"]
        src = h.index("Source") if "Source" in h else find(h, "source")
        addr = find(h, "address")
        samp = find(h, "stall sampling", "all")
        samp_ni = find(h, "stall sampling", "not")
        execd = find(h, "instructions executed", avoid=("predicated",))
        rows = t["rows"]
        tot = sum(num(r[samp]) for r in rows) if samp is not None else 0
        print("\n== kernel:", t["title"])
        print(f"   {len(rows)} SASS lines, {tot:.0f} stall samples (all)")
        if execd is not None:
            by_op = defaultdict(float)
            for r in rows:
                words = r[src].split()  # predicated lines have several spaces after the guard
                op = words[0] if words else ""
                if op.startswith("@") and len(words) > 1:
                    op = words[1]
                by_op[op.split(".")[0]] += num(r[execd])
            total_exec = sum(by_op.values())
            print(f"   warp instructions executed: {total_exec:.0f}; by opcode:")
            for op, n in sorted(by_op.items(), key=lambda kv: -kv[1])[:20]:
                print(f"     {op:12s} {n:12.0f}  {100 * n / max(total_exec, 1):5.1f}%")
        # Where the warps wait, summed over the kernel: the stall_* columns (not-issued samples).
        reasons = [(i, c) for i, c in enumerate(h) if c.startswith("stall_") and c.endswith("(Not Issued)")]
        if reasons:
            sums = sorted(((sum(num(r[i]) for r in rows), c[6:-13]) for i, c in reasons), reverse=True)
            total = sum(v for v, _ in sums) or 1
            print("   not-issued stall reasons: " + ", ".join(f"{c} {100 * v / total:.0f}%" for v, c in sums[:8] if v > 0))
        if samp is not None:
            print(f"   hottest {top} lines (samples all / not-issued, executed):")
            for r in sorted(rows, key=lambda r: -num(r[samp]))[:top]:
                a = r[addr] if addr is not None else ""
                ni = r[samp_ni] if samp_ni is not None else ""
                ex = r[execd] if execd is not None else ""
                print(f"     {a:>8} {num(r[samp]):7.0f} {ni:>7} {ex:>10}  {r[src].strip()[:90]}")


if __name__ == "__main__":
    main()
