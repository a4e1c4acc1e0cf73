"""A bf16 fla model through kda-cute: fla's own `KDAForCausalLM` (flash-linear-attention),
small and random, cast with `.to(torch.bfloat16)` as a user casts it (A_log and dt_bias become
bf16 too), run with kda-cute's fla backend on and off (FLA_KDA_CUTE=0: fla's Triton), against
an fp32 copy of the same weights on fla's Triton path.

Per gate form (fla's softplus gate, and safe_gate with lower_bound -5): the prefill logits of a
prompt, the logits of each decode step fed the fp32 model's greedy tokens (the same path for
all three, so step logits compare), and a greedy `generate` of each; each as relative L2 and
argmax agreement against the fp32 model. kda-cute must be no farther than fla's bf16 path on
either, and take every KDA call of the model (counted by forward hooks on the KDA layers).

    python bench/fla_model.py --out bench/results/fla-model-<device>-<date>-<commit>

writes <out>.json and <out>.md (tests/test_gpu_fla_model.py runs the same comparison).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch

GATES = {"softplus": dict(safe_gate=False, lower_bound=None),
         "safe_gate": dict(safe_gate=True, lower_bound=-5.0)}
SIZES = dict(hidden_size=1024, num_hidden_layers=4, num_heads=8, head_dim=128, vocab_size=4096)


@contextmanager
def backend(on: bool):
    """kda-cute's fla backend on or off for the calls inside (fla reads FLA_KDA_CUTE per call)."""
    from kda_cute.integrations import fla as kda_fla
    was = os.environ.get(kda_fla.ENV_VAR)
    os.environ[kda_fla.ENV_VAR] = "1" if on else "0"
    try:
        yield
    finally:
        if was is None:
            del os.environ[kda_fla.ENV_VAR]
        else:
            os.environ[kda_fla.ENV_VAR] = was


@contextmanager
def counted():
    """Counts of KDA layer calls and of kda-cute's fla entries taken inside."""
    from fla.layers.kda import KimiDeltaAttention

    from kda_cute import fla_forms
    names = ("chunk_kda", "fused_recurrent_kda_fwd")
    seen = {"layer": 0, **dict.fromkeys(names, 0)}
    real = {n: getattr(fla_forms, n) for n in names}

    def wrap(name):
        def f(*a, **kw):
            seen[name] += 1
            return real[name](*a, **kw)
        return f

    def hook(*_):
        seen["layer"] += 1

    for n in names:  # the backend calls the forms through the module: they count here
        setattr(fla_forms, n, wrap(n))
    handles = []
    try:
        yield seen, handles, KimiDeltaAttention, hook
    finally:
        for n in names:
            setattr(fla_forms, n, real[n])
        for h in handles:
            h.remove()


@torch.inference_mode()
def _logits(model, prompt, tokens):
    """Prefill logits [B, P, vocab] and the logits after each of `tokens` fed one at a time
    through the cache [B, S, vocab], in fp32."""
    out = model(prompt, use_cache=True)
    pre, past = out.logits.float(), out.past_key_values
    steps = []
    for t in range(tokens.shape[1]):
        out = model(tokens[:, t:t + 1], past_key_values=past, use_cache=True)
        past = out.past_key_values
        steps.append(out.logits[:, -1].float())
    return pre, torch.stack(steps, 1)


@torch.inference_mode()
def _greedy(model, prompt, n):
    return model.generate(prompt, max_new_tokens=n, do_sample=False, min_new_tokens=n,
                          pad_token_id=0)[:, prompt.shape[1]:]


def _metrics(x, ref):
    return {"rel_l2": float((x - ref).norm() / ref.norm()),
            "argmax_agree": float((x.argmax(-1) == ref.argmax(-1)).float().mean())}


def compare(gate: str, batch: int = 2, prompt_len: int = 300, new_tokens: int = 32,
            seed: int = 0, sizes: dict | None = None) -> dict:
    """The comparison for one gate form: {"kda_cute": ..., "fla_bf16": ..., "calls": ...}, each
    path's prefill, decode-step and generate metrics against the fp32 model."""
    from fla.models import KDAConfig, KDAForCausalLM

    from kda_cute.integrations import fla as kda_fla
    kda_fla.register()
    torch.manual_seed(seed)
    cfg = KDAConfig(**(sizes or SIZES), **GATES[gate], fuse_cross_entropy=False)
    ref = KDAForCausalLM(cfg).cuda().float().eval()
    model = KDAForCausalLM(cfg).cuda().eval()
    model.load_state_dict(ref.state_dict())
    model = model.to(torch.bfloat16)  # A_log and dt_bias too, as a user's cast does
    gen = torch.Generator(device="cuda").manual_seed(seed + 1)
    prompt = torch.randint(0, cfg.vocab_size, (batch, prompt_len), device="cuda", generator=gen)
    t0 = time.time()
    with backend(False):
        tokens = _greedy(ref, prompt, new_tokens)
        ref_pre, ref_steps = _logits(ref, prompt, tokens)
    print(f"{gate}: fp32 reference {time.time() - t0:.1f} s", file=sys.stderr, flush=True)
    result = {"gate": gate, "config": {**(sizes or SIZES), **GATES[gate]}, "batch": batch,
              "prompt_len": prompt_len, "new_tokens": new_tokens,
              "param_dtypes": sorted({str(p.dtype) for p in model.parameters()}),
              "A_log_dtype": str(model.model.layers[0].attn.A_log.dtype)}
    for name, on in (("kda_cute", True), ("fla_bf16", False)):
        with backend(on), counted() as (seen, handles, layer_cls, hook):
            handles += [m.register_forward_hook(hook) for m in model.modules()
                        if isinstance(m, layer_cls)]
            pre, steps = _logits(model, prompt, tokens)
            out = _greedy(model, prompt, new_tokens)
        print(f"{gate}: {name} {time.time() - t0:.1f} s", file=sys.stderr, flush=True)
        result[name] = {"prefill": _metrics(pre, ref_pre), "decode": _metrics(steps, ref_steps),
                        "generate_token_agree": float((out == tokens).float().mean()),
                        "calls": dict(seen)}
    return result


def _md(results: list, meta: dict) -> str:
    lines = [f"# A bf16 fla KDAForCausalLM through kda-cute ({meta['device']}, "
             f"{meta['commit']})", "",
             f"fla {meta['fla']}, torch {meta['torch']}; {SIZES['num_hidden_layers']} layers, "
             f"hidden {SIZES['hidden_size']}, {SIZES['num_heads']} heads of "
             f"{SIZES['head_dim']}, vocab {SIZES['vocab_size']}, random weights cast to bf16 "
             "(A_log and dt_bias bf16). Against an fp32 copy on fla's Triton path: prefill "
             "logits, the logits of each decode step fed the fp32 model's greedy tokens, and "
             "a greedy generate's tokens.", "",
             "| gate | path | prefill rel L2 | prefill argmax | decode rel L2 | decode argmax "
             "| generate tokens | KDA layer calls | kda-cute calls |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        for name in ("kda_cute", "fla_bf16"):
            m = r[name]
            c = m["calls"]
            lines.append(
                f"| {r['gate']} | {name} | {m['prefill']['rel_l2']:.3e} | "
                f"{m['prefill']['argmax_agree']:.4f} | {m['decode']['rel_l2']:.3e} | "
                f"{m['decode']['argmax_agree']:.4f} | {m['generate_token_agree']:.4f} | "
                f"{c['layer']} | {c['chunk_kda']} + {c['fused_recurrent_kda_fwd']} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="path prefix: writes .json and .md")
    a = ap.parse_args(argv)
    import fla
    results = [compare(g) for g in GATES]
    commit = os.environ.get("KDA_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    meta = {"device": torch.cuda.get_device_name(), "commit": commit,
            "fla": getattr(fla, "__version__", "?"), "torch": torch.__version__}
    Path(a.out + ".json").write_text(json.dumps({**meta, "results": results}, indent=1) + "\n")
    Path(a.out + ".md").write_text(_md(results, meta))
    print(_md(results, meta))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
