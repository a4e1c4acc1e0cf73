"""A real client: fla's KDAForCausalLM (flash-linear-attention), small and random, cast to bf16
as a user casts it, through kda-cute's fla backend (bench/fla_model.py's comparison): its
prefill logits, decode steps and greedy generate against an fp32 copy on fla's Triton, no
farther than fla's own bf16 path, and every KDA call of the model taken by kda-cute. Skips
without a Hopper GPU or without flash-linear-attention and transformers."""

import importlib.util
from pathlib import Path

import pytest

# fla's Triton kernels compile cold on a fresh machine, for minutes
pytestmark = [pytest.mark.gpu, pytest.mark.timeout(900)]
pytest.importorskip("fla.models", reason="needs flash-linear-attention (fla.models)")
pytest.importorskip("transformers")

_spec = importlib.util.spec_from_file_location(
    "_bench_fla_model", Path(__file__).resolve().parent.parent / "bench" / "fla_model.py")
fla_model = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fla_model)


@pytest.mark.parametrize("gate", list(fla_model.GATES))
def test_bf16_model_through_kda_cute(gate):
    r = fla_model.compare(gate)
    ours, theirs = r["kda_cute"], r["fla_bf16"]
    assert r["A_log_dtype"] == "torch.bfloat16"  # the cast the backend once refused
    # every KDA call of the model taken: a prefill per layer (two: the comparison's prompt and
    # generate's), then one step per layer per token
    c = ours["calls"]
    assert c["layer"] > 0 and c["chunk_kda"] + c["fused_recurrent_kda_fwd"] == c["layer"], c
    assert theirs["calls"]["chunk_kda"] == theirs["calls"]["fused_recurrent_kda_fwd"] == 0
    for part in ("prefill", "decode"):
        assert ours[part]["rel_l2"] <= theirs[part]["rel_l2"], (part, ours, theirs)
        assert ours[part]["argmax_agree"] >= theirs[part]["argmax_agree"], (part, ours, theirs)
    assert ours["prefill"]["rel_l2"] < 0.05 and ours["decode"]["rel_l2"] < 0.05
