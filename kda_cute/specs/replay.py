"""The replay step (kernels/kda_replay_sm90.py; output-only verify: kda_replay_verify_sm90.py):
decode against a checkpoint pool and a ring of the tokens since each slot's checkpoint, instead
of reading and writing the whole state every token. Its config, constraints and argument list;
no DSL import here.

A slot's state after its checkpoint S_c and the c tokens of its ring is

    S = S_c diag(e^G) + sum_j u_j (r_j k_j e^(G - G_j))^T

(G the tokens' running log-decay since the checkpoint, a channel each; k_j the token's key as
given, r_j its inverse norm; u_j its delta-rule correction). A step reads S_c and the ring, takes
its output and correction from them, and appends (k, r, u, G) to the ring; a step at cursor
c >= window - 1 (the run-time window, at most the ring's entries) writes the state instead, as
the new checkpoint, and empties the ring. The cursor moves in place: the row's last tile to
finish (a ticket word a slot, zero between launches) writes it. A cursor outside [0, ring) is
reported as a bad read slot and its row is padding.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..abi import Arg, scalar, tensor
from . import step
from .step import StepConfig

U_DTYPES = ("float16", "float32")
# decode (a token a row, folding at the window), verify (output-only drafts past the cursor),
# flush (the ring folded into the checkpoint, no token), commit (cursors moved by the accepted
# counts)
MODES = ("decode", "verify", "flush", "commit")
MAX_DRAFTS = 16  # a verify's drafts a row


@dataclass(frozen=True)
class ReplayConfig(StepConfig):
    """A token-step tile (one tile a CTA, single-token rows) with a ring of `ring` entries a
    (slot, head), its corrections u held as `u_dtype`."""

    ring: int = 16
    u_dtype: str = "float16"
    mode: str = "decode"  # one of MODES
    drafts: int = 0  # verify: the most drafts a row (its shared areas); 0: min(ring, 16)
    mma: bool = False  # verify: the checkpoint's products with the drafts on mma.sync
    # decode: the fold's first `hoist` entries' decayed keys held in registers across its rows
    # (0: every entry read from shared memory a row)
    hoist: int = 0

    @property
    def name(self) -> str:
        base = super().name.removeprefix("kda_step_")
        u = "uh" if self.u_dtype == "float16" else "uf"
        if self.mode == "commit":  # no state or token touched: the ring's length only
            return f"kda_replay_commit_l{self.ring}"
        return f"kda_replay_{base}_l{self.ring}_{u}" + (
            "" if self.mode == "decode" else f"_{self.mode}") + (
            f"_d{self.drafts}" if self.drafts else "") + ("_mma" if self.mma else "") + (
            f"_h{self.hoist}" if self.hoist else "")


def supports(cfg: ReplayConfig) -> tuple[bool, str]:
    ok, why = step.supports(cfg)
    if not ok:
        return ok, why
    if cfg.ring not in (8, 16, 32):
        return False, f"ring must be 8, 16 or 32, got {cfg.ring}"
    if cfg.u_dtype not in U_DTYPES:
        return False, f"u_dtype must be one of {U_DTYPES}, got {cfg.u_dtype!r}"
    if cfg.tpr < 2:
        return False, f"tpr must be at least 2 (a row's two sums share its lanes), got {cfg.tpr}"
    if cfg.mode not in MODES:
        return False, f"mode must be one of {MODES}, got {cfg.mode!r}"
    if cfg.drafts and (cfg.mode != "verify" or cfg.drafts not in (2, 4, 8, 16)
                       or cfg.drafts > cfg.ring):
        return False, (f"drafts must be 0, or for verify 2, 4, 8 or 16 and at most the ring, "
                       f"got {cfg.drafts} ({cfg.mode}, ring {cfg.ring})")
    if cfg.mma and (cfg.mode != "verify" or (cfg.drafts or min(cfg.ring, MAX_DRAFTS)) % 4
                    or cfg.block_v % 16 or cfg.head_dim_k % 32):
        return False, (f"mma is a verify's with drafts areas of a multiple of 4 and rows and "
                       f"head columns in whole MMA tiles, got {cfg.mode}, drafts {cfg.drafts}, "
                       f"block_v {cfg.block_v}, K {cfg.head_dim_k}")
    if cfg.hoist and (cfg.mode != "decode" or not 0 < cfg.hoist < cfg.ring):
        return False, (f"hoist must be 0, or for decode above 0 and below the ring, got "
                       f"{cfg.hoist} ({cfg.mode}, ring {cfg.ring})")
    if cfg.mode == "verify" and (cfg.tpr != 32 or 2 * cfg.block_v != cfg.threads):
        return False, (f"verify tiles are 32 lanes a row and two threads a row "
                       f"(threads = 2 block_v), got tpr={cfg.tpr}, block_v={cfg.block_v}, "
                       f"threads={cfg.threads}")
    if cfg.persist or cfg.prep or cfg.chunk or cfg.ahead:
        return False, "the replay step is a one-tile tile without persist, prep, chunk or ahead"
    return True, ""


def args(cfg: ReplayConfig) -> list[Arg]:
    """The step's arguments (kda_cute.specs.step.args), with the ring after the error words:
    keys [P, H, ring, K] bf16 as given, their inverse norms [P, H, ring] fp32, corrections
    [P, H, ring, V] (u_dtype), running log-decays [P, H, ring, K] fp32, the cursors (P,) int32
    moved in place, and the tickets (P,) int32 (zeros, put back to zero by each step)."""
    K, V, L = cfg.head_dim_k, cfg.head_dim_v, cfg.ring
    a = step.args(cfg)
    ring = [
        tensor("ring_k", "bfloat16", ("P", "H", L, K), ("sRK", L * K, K, 1), 16),
        tensor("ring_r", "float32", ("P", "H", L), ("sRR", L, 1), 16),
        tensor("ring_u", cfg.u_dtype, ("P", "H", L, V), ("sRU", L * V, V, 1), 16),
        tensor("ring_g", "float32", ("P", "H", L, K), ("sRG", L * K, K, 1), 16),
        tensor("cursor", "int32", ("P",), (1,)),
        tensor("tickets", "int32", ("P",), (1,)),
    ]
    cut = [x.name for x in a].index("errors") + 1
    # the window: a token at cursor c >= window - 1 folds (1 <= window <= ring); the entries
    # past it hold a verify's drafts
    return a[:cut] + ring + a[cut:] + [scalar("window")]


def dsl_class(cfg: ReplayConfig) -> str:
    if cfg.mode == "verify":
        return "kernels.kda_replay_verify_sm90:KdaReplayVerifySm90"
    if cfg.mode == "flush":
        return "kernels.kda_replay_flush_sm90:KdaReplayFlushSm90"
    if cfg.mode == "commit":
        return "kernels.kda_replay_commit_sm90:KdaReplayCommitSm90"
    return "kernels.kda_replay_sm90:KdaReplaySm90"
