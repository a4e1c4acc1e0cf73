"""The generated parts of the results' pages, written from the current result files.

    python3 bench/report.py           # rewrite bench/results/INDEX.md, README.md's speed table
                                      # and docs/results.md's tables
    python3 bench/report.py --check   # exit 1 where any of them is stale

Standard library only, so CI runs it without torch. A new result of a table replaces the old one
in bench/results (git history keeps the old one): point CURRENT at it and rerun this.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import textwrap
from pathlib import Path
from statistics import geometric_mean as geomean

ROOT = Path(__file__).resolve().parent.parent

# each table -> (its current JSON in bench/results, what it holds)
CURRENT = {
    "prefill": ("bench-h200-2026-11-30-all-1f76ec1.json", "prefill, K 64 / 128 / 256, vs fla"),
    "prefill-h100": ("bench-h100-2026-12-06-3f0c91c.json",
                     "prefill, K 64 / 128 / 256, H100 (issue 58's tables' call)"),
    "prefill-precise": ("bench-precise-h200-2026-12-02-new.json", "prefill, precise, K 128"),
    "accuracy": ("accuracy-h200-2026-12-02-precise.json", "accuracy vs float64"),
    "accuracy-fla": ("accuracy-fla-h200-2026-11-30-6aed182.json", "accuracy vs float64, fla"),
    "serving": ("serving-h200-2026-12-05-d6eec97.json", "decode and verify vs fla"),
    "verify-tiles": ("chunk-verify-sweep-h200-2026-12-05.json", "verify tiles, bf16 pools"),
    "verify-tiles-f32": ("chunk-verify-sweep-h200-2026-12-05-f32.json", "verify tiles, fp32"),
    "gather-streams": ("gather-streams-h200-2026-12-05-bulk.json", "decode's bytes streamed"),
    "pool-prefill": ("pool-prefill-h200-2026-12-02-e775ce0.json", "pool prefill, K 128"),
    "pool-prefill-k64-k256": ("pool-prefill-h200-2026-12-02-eb2c485-k64-k256.json",
                              "pool prefill, K 64 and 256"),
    "checkpoints": ("checkpoints-h100-2026-12-06-3f0c91c.json", "checkpoint costs"),
    "fla-model": ("fla-model-h100-2026-12-06-56c1de7.json", "a bf16 fla model"),
    "fla-suite": ("fla-suite-h100-2026-12-06-85dbdc6.json", "fla's KDA op tests"),
    "library-overhead": ("ecosystem-h200-2026-12-03-bf82d78.json", "library overhead, wheel"),
    "host": ("host-stub-cpu-2026-12-05-2aad21c.json", "launcher host time, CPU"),
    "peers-tp": ("peers-tp-h100-2026-12-06-3f0c91c.json",
                 "prefill vs cuDNN fused and FlashKDA, TP shapes"),
    "peers-ten": ("peers-ten-h100-2026-12-06-3f0c91c.json",
                  "prefill vs cuDNN fused and FlashKDA, ten cases"),
    "refactor-ab": ("refactor-ab-h100-2026-12-06.json", "one shape for every call, old / new"),
    "replay": ("replay-h100-2026-12-07-7bee323.json",
               "replay decode and verify vs today's, fla, H100"),
    "context": ("context-sim-h200-2026-12-06-1ebca17.json",
                "context parallel, R ranks simulated on one GPU as CUDA graphs, H200"),
    "context-h100": ("context-sim-h100-2026-12-06-a6304a9.json",
                     "context parallel, R ranks simulated on one GPU as CUDA graphs, H100"),
}
# files of a table beyond those sharing its JSON's stem, and results with no JSON
EXTRA = {"host": ("host-stub-cpu-2026-12-05.md", "host-stub-cpu-2026-12-05-6a45ba3.json")}
RECORDS = {"gate-params": ("gate-params-ab-h100-2026-12-06.md", "gate parameters as held, A/B"),
           "gpu-suite": ("gpu-tests-h100-2026-12-07-2094c0b.log", "the GPU suite's last run")}


def table(head, rows, left=1):
    """A Markdown table: the first `left` columns left-aligned, the rest right-aligned."""
    rule = ["---"] * left + ["---:"] * (len(head) - left)
    return [f"| {' | '.join(r)} |" for r in (head, rule, *rows)]


def wrap(text):
    return textwrap.wrap(text, 100, break_long_words=False, break_on_hyphens=False) + [""]


def ms(x):
    return "-" if x is None else f"{x:.3f}"


def us(x):
    """ms as us."""
    return "-" if x is None else f"{x * 1e3:.1f}"


def err(r, pre=""):
    out = r.get(f"{pre}out_err")
    return "-" if out is None else f"{out:.2e} / {r[f'{pre}state_err']:.2e}"


def ratio(a, b):
    return f"{a / b:.2f}x" if a and b else "-"


def meta(d, name):
    """(device, commit, date) of a result: its JSON's, the date from its name."""
    v = d.get("versions", {})
    device = d.get("device") or v.get("device") or f"CPU ({d.get('machine', '?')})"
    date = re.search(r"\d{4}-\d\d-\d\d", name)
    return device, d.get("commit") or v.get("commit") or "-", date.group(0) if date else "-"


def caption(data, name, results):
    md = name.rsplit(".", 1)[0] + ".md"
    shown = md if (results / md).exists() else name
    device, commit, date = meta(data, name)
    return wrap(f"From [`{shown}`](../bench/results/{shown}): {device}, commit {commit} ({date}).")


def case(r):
    s = r.get("schedule", "serial")
    return r["case"] + ("" if s == "serial" else f" ({s})")


def speed(data, name, results):
    """README.md's table: the prefill at K = 128 against its peers in one process (peers.py)."""
    rows = [r for r in data["rows"] if r.get("gate", "random") == "random"]
    device, commit, date = meta(data, name)
    out = wrap(f"Prefill (`kda_cute.fwd`), K = V = 128, bf16 inputs, fp32 states, bounded gate; "
               f"us of a CUDA-graph replay, median of 100, cold L2; cuDNN-frontend's fused sm90 "
               f"kernel and FlashKDA (built from source) timed in the same process "
               f"(`bench/peers.py`; fla's Triton kernels: docs/results.md). {device}, commit "
               f"{commit}, {date}.")
    out += table(["case", "kda_cute us", "cuDNN fused us", "vs cuDNN", "FlashKDA us",
                  "vs FlashKDA"],
                 [[r["case"], us(r["kda_ms"]), us(r.get("cudnn_ms")),
                   ratio(r.get("cudnn_ms"), r["kda_ms"]), us(r.get("flashkda_ms")),
                   ratio(r.get("flashkda_ms"), r["kda_ms"])] for r in rows])
    cd = [r["cudnn_ms"] / r["kda_ms"] for r in rows if r.get("cudnn_ms")]
    fk = [r["flashkda_ms"] / r["kda_ms"] for r in rows if r.get("flashkda_ms")]
    if cd and fk:
        out += ["", f"Geometric mean: {geomean(cd):.2f}x cuDNN fused, {geomean(fk):.2f}x "
                    f"FlashKDA (above 1: kda_cute faster)."]
    return out


def prefill(K):
    def gen(data, name, results):
        rows = [r for r in data["rows"] if r["K"] == K]
        peers = [c for c, key in (("fla", "fla_ms"), ("FlashKDA est.", "flashkda_est_ms"))
                 if any(r.get(key) for r in rows)]
        head = ["case", "roofline ms", "kda_cute ms", "graph ms", "K1 / K2 ms", "% roofline"]
        head += [x for c in peers for x in (f"{c} ms", f"vs {c}")] + ["out / state err"]
        body = []
        for r in rows:
            b = [case(r), ms(r["roofline_ms"]), ms(r["kda_ms"]), ms(r["kda_graph_ms"]),
                 f"{r['kda_k1_gpu_ms']:.3f} / {r['kda_k2_gpu_ms']:.3f}",
                 f"{r['kda_pct_roofline']:.1f}"]
            for key in ("fla_ms", "flashkda_est_ms")[:len(peers)]:
                b += [ms(r.get(key)), ratio(r.get(key), r["kda_ms"])]
            body.append(b + [err(r, "kda_")])
        return caption(data, name, results) + table(head, body)
    return gen


def accuracy(data, name, results):
    cols = [(c, pre) for c, pre in (("kda_cute", ""), ("kda_cute precise", "precise_"),
                                    ("fla", "fla_")) if f"{pre}out_err" in data["rows"][0]]
    b = data["bar"]
    return (caption(data, name, results)
            + wrap(f"Bar: output <= {b['out']}, fp32 state <= {b['state']}.")
            + table(["case"] + [f"{c} out / state err" for c, _ in cols],
                    [[r["case"]] + [err(r, pre) for _, pre in cols] for r in data["rows"]]))


def serving(form):
    def gen(data, name, results):
        rows = [r for r in data["rows"] if r["form"] == form]
        keys = list(dict.fromkeys((r["N"], r["H"], r["T"]) for r in rows))
        pools = list(dict.fromkeys(r["pool"] for r in rows))
        at = {(r["N"], r["H"], r["T"], r["pool"]): r for r in rows}
        body = [[str(n), str(h), str(t)] + [
            f"{at[n, h, t, p]['kda_pct']:.0f}%, {at[n, h, t, p]['speedup_vs_fla']:.2f}x"
            if (n, h, t, p) in at else "-" for p in pools] for n, h, t in keys]
        host = data.get("host") if form == "decode" else None
        note = wrap(f"Host time a decode call: {host['bound_us']:.1f} us bound, "
                    f"{host['eager_us']:.1f} us eager.") if host else []
        return caption(data, name, results) + note + table(
            ["N", "H", "T"] + [f"{p} pool: % of ceiling, vs fla" for p in pools], body, left=3)
    return gen


def pool(data, name, results):
    body = [[r["case"], str(r["K"]), f"{r['pool_over_dense']:.3f}",
             f"{r['pool_over_dense_graph']:.3f}", "yes" if r["bit_identical"] else "no"]
            for r in data["rows"]]
    return caption(data, name, results) + table(
        ["case", "K", "pool / dense, eager", "pool / dense, graph", "bit-identical"], body, 2)


def checkpoints(data, name, results):
    runs = [{(r["case"], m): v for r in p["rows"] for m, v in r["modes"].items()}
            for p in data["processes"]]
    body = []
    for c, m in (k for k in runs[0] if k[1] in data["bars"]):
        g, e = ([x[c, m][f"{w}_paired"] - 1 for x in runs] for w in ("graph", "eager"))
        worst, bar = max(g + e), data["bars"][m]
        body.append([c, m, f"<= {bar:.0%}", " / ".join(f"{x:+.1%}" for x in g),
                     " / ".join(f"{x:+.1%}" for x in e),
                     "yes" if worst <= bar else f"no ({worst:+.1%})"])
    return caption(data, name, results) + table(
        ["case", "mode", "bar", "graph, each process", "eager, each process", "met"], body, 2)


def fla_model(data, name, results):
    body = [[r["gate"], who, f"{x['prefill']['rel_l2']:.2e}", f"{x['prefill']['argmax_agree']:.3f}",
             f"{x['decode']['rel_l2']:.2e}", f"{x['decode']['argmax_agree']:.3f}",
             str(sum(x["calls"][c] for c in ("chunk_kda", "fused_recurrent_kda_fwd")))]
            for r in data["results"] for who, x in ((w, r[w]) for w in ("kda_cute", "fla_bf16"))]
    return caption(data, name, results) + table(
        ["gate", "path", "prefill rel L2", "prefill argmax", "decode rel L2", "decode argmax",
         "KDA calls in kda-cute"], body, left=2)


def replay(data, name, results):
    """The replay calls against today's decode / verify (style a) and fla (bench/replay.py)."""
    body = []
    for r in data["rows"]:
        form = r["form"]
        today = r[f"{form}_ms"]
        body.append([form, r["pool"], str(r["N"]), str(r["H"]), str(r["T"]), str(r["entries"]),
                     ms(today), ms(r["replay_ms"]), f"{r['replay_ms'] / today:.2f}",
                     f"{r['replay_bytes'] / r[f'{form}_bytes']:.2f}", f"{r['replay_pct']:.0f}",
                     ratio(r.get("fla_ms"), r["replay_ms"])])
    note = wrap(f"CUDA graphs, cold L2, median; decode at a window of 8; copy ceiling "
                f"{data['copy_bandwidth'] / 1e9:.0f} GB/s. Replay / today below 1: the replay "
                f"call faster.")
    head = ["form", "pool", "N", "H", "T", "ring", "today ms", "replay ms", "replay / today",
            "bytes ratio", "replay % ceiling", "replay vs fla"]
    return caption(data, name, results) + note + table(head, body, 2)


def context_table(data):
    """Context parallelism's scaling as lines (a note, the table), without the caption: the
    one-GPU forward against R ranks' slowest rank, simulated in turn on one GPU or run over
    NCCL (bench/context.py writes it beside its JSON)."""
    rows = data["rows"]
    if data.get("mode") == "ranks":
        body = [[str(r["H"]), str(r["T"]), str(r["ranks"]), ms(r["one_gpu_ms"]), ms(r["ms"]),
                 f"{r['speedup']:.2f}x"] for r in rows]
        return table(["H", "T", "ranks", "one GPU ms", "ranks ms", "speedup"], body, 0)
    counts = sorted({int(R) for r in rows for R in r["ranks"]})
    body = [[str(r["H"]), str(r["T"]), ms(r["one_gpu_ms"])]
            + [f"{r['ranks'][str(R)]['ms']:.3f} ({r['ranks'][str(R)]['speedup']:.2f}x)"
               for R in counts] for r in rows]
    how = ("each a CUDA graph" if "CUDA graph" in data.get("method", "") else
           "as eager calls (the host's time counts where a shard is short)")
    note = wrap(f"Each rank's work (its shard's summary, the fold, its finish) timed alone on one "
                f"GPU, {how}; a rank count's time is its slowest rank's, the exchange left out.")
    head = ["H", "T", "one GPU ms"] + [f"{R} ranks ms (speedup)" for R in counts]
    return note + table(head, body, 0)


def context(data, name, results):
    """bench/context.py's result (context_table) under its caption."""
    return caption(data, name, results) + context_table(data)


# (file, marker, table, generator): the text between <!-- marker:begin --> and its end
SECTIONS = [("README.md", "speed-table", "peers-ten", speed)] + [
    ("docs/results.md", f"results:{m}", key, gen) for m, key, gen in [
        ("prefill-k128", "prefill", prefill(128)), ("prefill-k256", "prefill", prefill(256)),
        ("prefill-k64", "prefill", prefill(64)), ("precise", "prefill-precise", prefill(128)),
        ("accuracy", "accuracy", accuracy), ("accuracy-fla", "accuracy-fla", accuracy),
        ("decode", "serving", serving("decode")), ("verify", "serving", serving("verify")),
        ("pool-prefill", "pool-prefill", pool), ("pool-k64-k256", "pool-prefill-k64-k256", pool),
        ("checkpoints", "checkpoints", checkpoints), ("fla-model", "fla-model", fla_model),
        ("replay", "replay", replay),
        ("context", "context", context), ("context-h100", "context-h100", context)]]


def index(results, current, records):
    """INDEX.md's text, and the files in results it does not name."""
    body, named = [], {"INDEX.md"}
    for key, (name, what) in current.items():
        stem = name.rsplit(".", 1)[0]
        files = sorted(p.name for p in results.iterdir() if p.name.rsplit(".", 1)[0] == stem)
        body.append([what, *meta(json.loads((results / name).read_text()), name),
                     files + list(EXTRA.get(key, ()))])
    for name, what in records.values():  # no JSON: what its name says
        dev, commit = re.search(r"-(h100|h200)-", name), re.search(r"-([0-9a-f]{7})\.", name)
        body.append([what, f"NVIDIA {dev.group(1).upper()}" if dev else "-",
                     commit.group(1) if commit else "-", meta({}, name)[2], [name]])
    for row in body:
        named.update(row[4])
        row[4] = ", ".join(f"[`{f}`]({f})" for f in row[4])
    text = ["# Current results", "", "Written by `python3 bench/report.py` (its `CURRENT` and "
            "`RECORDS`): the current result of each table. Older results are in git history.", ""]
    stray = sorted(p.name for p in results.iterdir() if p.name not in named)
    return "\n".join(text + table(["table", "device", "commit", "date", "files"], body, 5)) \
        + "\n", stray


def splice(text, marker, body):
    """text with the lines between marker's begin and end comments replaced by body."""
    begin, end = f"<!-- {marker}:begin -->", f"<!-- {marker}:end -->"
    if text.count(begin) != 1 or text.count(end) != 1:
        raise ValueError(f"expected one {begin} and one {end}")
    head, rest = text.split(begin)
    return head + begin + "\n" + "\n".join(body) + "\n" + end + rest.split(end)[1]


def generate(root, current=CURRENT, records=RECORDS):
    """({path: its text as generated}, the files in bench/results that INDEX.md does not name)."""
    results = root / "bench" / "results"
    idx, stray = index(results, current, records)
    out = {results / "INDEX.md": idx}
    for path, marker, key, gen in SECTIONS:
        if key in current:
            p, name = root / path, current[key][0]
            data = json.loads((results / name).read_text())
            out[p] = splice(out[p] if p in out else p.read_text(), marker,
                            gen(data, name, results))
    return out, stray


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 where generated text is stale")
    a = ap.parse_args(argv)
    out, stray = generate(ROOT)
    stale = [p for p, t in out.items() if not p.exists() or p.read_text() != t]
    for name in stray:
        print(f"bench/results/{name}: not named in CURRENT or RECORDS", file=sys.stderr)
    for p in stale:
        if a.check:
            print(f"{p.relative_to(ROOT)}: stale (python3 bench/report.py)", file=sys.stderr)
        else:
            p.write_text(out[p])
            print(f"wrote {p.relative_to(ROOT)}")
    return 1 if stray or (a.check and stale) else 0


if __name__ == "__main__":
    sys.exit(main())
