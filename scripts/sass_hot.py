"""Print the SASS instructions with the most warp-stall samples from `ncu --page source --csv`."""

import csv
import sys


def main(path, top=45):
    rows = list(csv.reader(open(path, errors="replace")))
    head_i = next((i for i, r in enumerate(rows) if "Source" in r and "Address" in r), None)
    if head_i is None:
        print("no SASS table in", path)
        print("".join(open(path, errors="replace").readlines()[:20]))
        return
    head = rows[head_i]
    col = next((i for i, h in enumerate(head) if h.startswith("Warp Stall Sampling (All")), None)
    src = head.index("Source")
    table = [r for r in rows[head_i + 1:] if len(r) == len(head)]
    if col is None:
        print("columns:", head)
        return

    def num(x):
        try:
            return float(x.replace(",", ""))
        except ValueError:
            return 0.0
    total = sum(num(r[col]) for r in table) or 1.0
    print(f"{len(table)} SASS rows (last kernel in the report), {total:.0f} stall samples")
    for r in sorted(table, key=lambda r: -num(r[col]))[:top]:
        print(f"{100 * num(r[col]) / total:5.1f}%  {r[head.index('Address')]:>6}  {r[src][:110]}")


if __name__ == "__main__":
    main(sys.argv[1])
