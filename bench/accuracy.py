"""Accuracy against the float64 reference on FlashKDA-benchmark-like inputs (K = V = 128):
q, k, v, g ~ N(0,1) bf16, beta logits ~ N(0,1), A_log, dt_bias ~ U(0,1), lower_bound -5, fp32
states in and out; and slowly decaying states (a constant log-space decay per token, gate
"none"). Also the long single sequence (T = 262144) for NaN/Inf and error growth.

    python bench/accuracy.py [--out bench/results/accuracy.json] [--long] [--precise]

--precise: each case also at precision="precise" (its errors beside the default's).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kda_cute import select_config  # noqa: E402
from kda_cute.reference import rel_err  # noqa: E402
from kda_cute.testing import errors, make_inputs, reference  # noqa: E402

CASES = [
    # (name, kwargs)
    ("T512 H8 bounded", dict(B=1, T=512, H=8)),
    ("T1024 H8 bounded", dict(B=1, T=1024, H=8)),
    ("T2048 H8 bounded", dict(B=1, T=2048, H=8)),
    ("T4096 H8 bounded", dict(B=1, T=4096, H=8)),
    ("T4096 H8 unbounded", dict(B=1, T=4096, H=8, gate="unbounded")),
    ("T4096 H8 unbounded g+20", dict(B=1, T=4096, H=8, gate="unbounded", g_shift=20.0)),
    ("varlen mix H8", dict(seqlens=[1300, 547, 2048, 963, 271, 3063], H=8)),
    ("T4096 H4 K64", dict(B=1, T=4096, H=4, K=64)),
    ("T4096 H4 K256", dict(B=1, T=4096, H=4, K=256)),
    # a constant log-space decay per token (gate "none"): a state that remembers many chunks,
    # where the bf16 operands' rounding accumulates (the cases above forget within a chunk)
    ("T4096 H8 slow decay -0.02", dict(B=1, T=4096, H=8, gate="none", decay=-0.02)),
    ("T4096 H8 slow decay -0.005", dict(B=1, T=4096, H=8, gate="none", decay=-0.005)),
    # the raw gate shifted by -6 through the bounded gate: slowly decaying too
    ("T2048 H8 bounded g-6", dict(B=1, T=2048, H=8, g_shift=-6.0)),
]
LONG = ("T262144 H1 bounded", dict(B=1, T=262144, H=1))


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "accuracy.json"))
    ap.add_argument("--long", action="store_true", help="add the T = 262144 sequence")
    ap.add_argument("--fla", action="store_true",
                    help="also fla's Triton chunk_kda on each case but the long one (it compiles "
                         "each new shape: about a minute apiece on a fresh machine)")
    ap.add_argument("--cases", default="",
                    help="only the cases whose name contains this text (e.g. 'slow decay'); "
                         "each keeps its seed")
    ap.add_argument("--precise", action="store_true",
                    help="each case at precision='precise' too")
    a = ap.parse_args(argv)
    rows = []
    for index, (name, kw) in enumerate(CASES + ([LONG] if a.long else [])):
        if a.cases not in name:
            continue
        t0 = time.time()
        kw = {"K": 128, **kw}
        decay = kw.pop("decay", None)
        inp = make_inputs(seed=index + 1, **kw)
        if decay is not None:
            inp["g"] = torch.full_like(inp["g"], decay)
        res = errors(inp)
        if a.precise:
            res.update({f"precise_{n}": x for n, x in errors(inp, precision="precise").items()})
        if a.fla and name != LONG[0]:
            res.update(fla_errors(inp))
        ladder = select_config(kw["K"], kw.get("V") or kw["K"], "seqlens" in kw)
        res.update(case=name, seconds=round(time.time() - t0, 1),
                   config=[ladder.prep.name, ladder.recur.name])
        rows.append(res)
        print(json.dumps(res), flush=True)
    doc = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "commit": os.environ.get("KDA_COMMIT"),
           "bar": {"out": 3.5e-3, "state": 2.5e-3}, "rows": rows}
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown(doc))


def fla_errors(inp) -> dict:
    """fla's chunk_kda (Triton path) on the same inputs and gate form, against the same
    float64 reference."""
    if str(ROOT / "bench") not in sys.path:
        sys.path.insert(0, str(ROOT / "bench"))
    try:
        from bench import fla_chunk_kda
        o, s = fla_chunk_kda(inp)
        torch.cuda.synchronize()
    except Exception as e:  # fla is optional; a case it cannot run says why
        return {"fla_error": repr(e)[:200]}
    ref_o, ref_s = reference(inp)
    return {"fla_out_err": rel_err(o, ref_o), "fla_state_err": rel_err(s, ref_s)}


def markdown(doc):
    """The readable table written beside the JSON."""
    bar = doc["bar"]
    lines = [f"Accuracy on {doc['device']} (commit {doc['commit']}, torch {doc['torch']}); "
             f"bar: output <= {bar['out']}, fp32 state <= {bar['state']}.", "",
             "| case | config (K1, K2) | out err | state err | finite | precise out / state err "
             "| fla out / state err |",
             "|---|---|---:|---:|---|---:|---:|"]
    for r in doc["rows"]:
        fin = r["out_finite"] and r["state_finite"]
        fla = (f"{r['fla_out_err']:.2e} / {r['fla_state_err']:.2e}" if "fla_out_err" in r
               else r.get("fla_error", "-"))
        pre = (f"{r['precise_out_err']:.2e} / {r['precise_state_err']:.2e}"
               if "precise_out_err" in r else "-")
        lines.append(f"| {r['case']} | {', '.join(r['config'])} | {r['out_err']:.2e} | "
                     f"{r['state_err']:.2e} | {fin} | {pre} | {fla} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
