"""Print the SASS instructions with the most warp-stall samples from `ncu --page source --csv`
(one table per profiled kernel)."""

import csv
import sys


def num(x):
    try:
        return float(x.replace(",", ""))
    except ValueError:
        return 0.0


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


if __name__ == "__main__":
    main(sys.argv[1])
