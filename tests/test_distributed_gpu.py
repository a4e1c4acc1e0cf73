"""kda_cute.distributed.fwd over NCCL, one process a GPU (skips with fewer than `ranks` GPUs):
a packed batch split into contiguous shards, each rank its shard's forward; the outputs and
final states gathered against the one-GPU forward and the float64 loop."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kda_cute.testing import free_port

pytestmark = pytest.mark.gpu

H, K = 4, 128
SCALE = K ** -0.5
LB = -5.0


def _batch(lens, seed):
    gen = torch.Generator().manual_seed(seed)
    T = sum(lens)

    def rnd(*s):
        return torch.randn(*s, generator=gen).to(torch.bfloat16)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    gate = (torch.randn(H, generator=gen) * 0.5, torch.randn(H * K, generator=gen) * 0.5)
    S0 = torch.randn(len(lens), H, K, K, generator=gen) * 0.3
    return (rnd(1, T, H, K), rnd(1, T, H, K), rnd(1, T, H, K), rnd(1, T, H, K),
            rnd(1, T, H)), cu, gate, S0


def _rank_main(rank, world, port, lens, out_dir, pool=False):
    from kda_cute import context_reference as cp
    from kda_cute import distributed as kd
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank))
    try:
        x, cu, (a_log, dt_bias), S0 = _batch(lens, seed=world)
        sh = cp.split(cu.tolist(), world, align=64)[rank]
        dev = torch.device("cuda", rank)
        toks = [t[:, sh.start:sh.end].to(dev).contiguous() for t in x]
        lcu = torch.tensor(sh.cu, dtype=torch.int32, device=dev)
        init = S0[list(sh.seqs)].to(dev)
        out = torch.empty_like(toks[2])
        final = torch.empty(len(sh.seqs), H, K, K, device=dev)
        if pool:  # sequence n at slot 2n + 1 of a pool of every sequence's initial state
            final = torch.zeros(2 * len(lens) + 1, H, K, K, device=dev)
            final[1::2] = S0.to(dev)
            kd.fwd(*toks, SCALE, out, a_log.to(dev), dt_bias.to(dev), LB, final, final, lcu,
                   carry_in=sh.carry_in, carry_out=sh.carry_out,
                   state_indices=torch.tensor([2 * n + 1 for n in sh.seqs], device=dev))
        else:
            kd.fwd(*toks, SCALE, out, a_log.to(dev), dt_bias.to(dev), LB, init, final, lcu,
                   carry_in=sh.carry_in)
        torch.cuda.synchronize()
        torch.save({"out": out.cpu(), "final": final.cpu(), "seqs": sh.seqs,
                    "carry_out": sh.carry_out, "start": sh.start, "end": sh.end},
                   f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("ranks", [2, 4, 8])
@pytest.mark.parametrize("lens, pool", [([8192], False), ([1500, 4000, 64, 2600], False),
                                        ([1500, 4000, 64, 2600], True)])
def test_ranks_over_nccl(ranks, lens, pool, tmp_path):
    """Each rank its shard (dense states, or its own copy of the pool: the rank holding a
    sequence's last token writes its slot): the outputs and final states against the float64
    loop and the one-GPU forward."""
    if torch.cuda.device_count() < ranks:
        pytest.skip(f"{ranks} GPUs needed, {torch.cuda.device_count()} here")
    import kda_cute
    from kda_cute.reference import kda_reference, rel_err
    from kda_cute.testing import OUT_TOL, STATE_TOL
    mp.start_processes(_rank_main, args=(ranks, free_port(), lens, str(tmp_path), pool),
                       nprocs=ranks, join=True, start_method="spawn")
    x, cu, (a_log, dt_bias), S0 = _batch(lens, seed=ranks)
    T = sum(lens)
    out = torch.zeros(1, T, H, K, dtype=torch.bfloat16)
    final = torch.zeros(len(lens), H, K, K)
    for r in range(ranks):
        d = torch.load(tmp_path / f"rank{r}.pt")
        out[:, d["start"]:d["end"]] = d["out"]
        for i, n in enumerate(d["seqs"]):
            if i < len(d["seqs"]) - 1 or not d["carry_out"]:  # the sequence ends here
                final[n] = d["final"][2 * n + 1] if pool else d["final"][i]
    dev = torch.device("cuda", 0)
    one_o = torch.empty(1, T, H, K, dtype=torch.bfloat16, device=dev)
    one_s = torch.empty(len(lens), H, K, K, device=dev)
    kda_cute.fwd(*(t.to(dev) for t in x), SCALE, one_o, a_log.to(dev), dt_bias.to(dev), LB,
                 S0.to(dev), one_s, cu.to(dev))
    ref_o, ref_s = kda_reference(*x, scale=SCALE, initial_state=S0, cu_seqlens=cu.long(),
                                 A_log=a_log, dt_bias=dt_bias, lower_bound=LB)
    assert rel_err(out, ref_o) < OUT_TOL and rel_err(final, ref_s) < STATE_TOL
    print(f"ranks {ranks} lens {lens}: vs one GPU: out {rel_err(out, one_o.cpu()):.2e}, "
          f"states {rel_err(final, one_s.cpu()):.2e}")
    assert rel_err(final, one_s.cpu()) < STATE_TOL
