"""From `ncu --page source --csv` (one table per profiled kernel): the SASS instructions with the
most warp-stall samples, and, where the table has executed-instruction counts, where a kernel's
executed instructions go: per region between CTA barriers (BAR.SYNC) and TMA stores, with each
region's busiest opcodes (static counts overstate a kernel with untaken branches: K1 carries all
three gate modes and both phase B forms, of which one of each runs)."""

import collections
import csv
import re
import sys


def num(x):
    try:
        return float(x.replace(",", ""))
    except ValueError:
        return 0.0


def opcode(source: str) -> str:
    """The opcode of a SASS line ('@!P0 BRA ...' -> 'BRA', 'HMMA.16816.F32 ...' -> 'HMMA')."""
    words = [w for w in source.split() if not w.startswith("@")]
    return re.split(r"[.\s]", words[0])[0] if words else ""


def regions(table, src: int, executed: int):
    """[(first row index, executed total, Counter of opcode -> executed)] split after every
    BAR.SYNC and UTMASTG (the phases of a kernel that synchronises its CTA between them)."""
    out, start, tot, ops = [], 0, 0.0, collections.Counter()
    for i, r in enumerate(table):
        op = opcode(r[src])
        n = num(r[executed])
        tot += n
        ops[op] += n
        if op in ("BAR", "UTMASTG") or r[src].lstrip().startswith("BAR."):
            out.append((start, tot, ops))
            start, tot, ops = i + 1, 0.0, collections.Counter()
    out.append((start, tot, ops))
    return out


def main(path, top=40):
    rows = list(csv.reader(open(path, errors="replace")))
    heads = [i for i, r in enumerate(rows) if "Source" in r and "Address" in r]
    if not heads:
        print("no SASS table in", path)
        print("".join(open(path, errors="replace").readlines()[:20]))
        return
    for n, hi in enumerate(heads):
        head = rows[hi]
        end = heads[n + 1] if n + 1 < len(heads) else len(rows)
        table = [r for r in rows[hi + 1:end] if len(r) == len(head)]
        col = next((i for i, h in enumerate(head) if h.startswith("Warp Stall Sampling (All")),
                   None)
        if col is None:
            print("columns:", head)
            continue
        src, addr = head.index("Source"), head.index("Address")
        total = sum(num(r[col]) for r in table) or 1.0
        print(f"== kernel table {n}: {len(table)} SASS rows, {total:.0f} stall samples")
        for r in sorted(table, key=lambda r: -num(r[col]))[:top]:
            print(f"{100 * num(r[col]) / total:5.1f}%  {r[addr]:>6}  {r[src][:110]}")
        ex = next((i for i, h in enumerate(head) if h == "Instructions Executed"), None)
        if ex is None:
            print("(no 'Instructions Executed' column; columns:", ", ".join(head), ")")
            continue
        all_ex = sum(num(r[ex]) for r in table) or 1.0
        print(f"-- executed warp instructions: {all_ex:.0f}, by region (first address, share, "
              "busiest opcodes)")
        for first, tot, ops in regions(table, src, ex):
            if tot / all_ex < 0.01:
                continue
            mix = " ".join(f"{k}:{100 * v / tot:.0f}%" for k, v in ops.most_common(8))
            print(f"{100 * tot / all_ex:5.1f}%  {table[first][addr]:>6}  {mix}")


if __name__ == "__main__":
    main(sys.argv[1])
