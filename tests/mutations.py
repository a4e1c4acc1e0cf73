"""Bad arguments for the argument-check tests (tests/test_serving.py, tests/test_validation.py):
each tensor argument of a valid call mutated, odd values for any argument, and what a refusal
must say (a TypeError / ValueError whose message starts with the call's own argument names)."""

from __future__ import annotations

import inspect

import torch

# odd values for any argument: what a caller may pass by mistake
ODD = [None, float("nan"), float("inf"), -1, 0, 10**30, "x", [], True, False, object(), 1.5,
       -5.0, 64, "bounded", torch.zeros(3)]
TOKEN_ARGS = ("q", "k", "v", "g", "beta", "out")
TABLE_ARGS = ("cu_seqlens", "state_indices", "output_state_indices", "checkpoint_offsets",
              "checkpoint_slots", "checkpoint_first", "ssm_state_indices", "num_accepted_tokens",
              "intermediate_state_indices", "retrieve_parent_token", "accepted_step")
FLOATS = ("dtype torch.float16", "dtype torch.float32", "dtype torch.bfloat16",
          "dtype torch.float64")


def mutations(x: torch.Tensor) -> list:
    """(what, tensor or other value) for one argument: other dtypes, one more or one fewer
    dimension, each size one larger and one smaller, every other element of a dimension, a
    base one element off, the last two dimensions swapped, no rows, a sparse tensor, a list,
    None."""
    out = [(f"dtype {d}", x.to(d)) for d in (torch.float16, torch.float32, torch.bfloat16,
                                              torch.int32, torch.int64, torch.bool,
                                              torch.float64) if d != x.dtype]
    out += [("one more dim", x.unsqueeze(0)), ("one fewer dim", x[0]),
            ("base off by one", torch.zeros(x.numel() + 1, dtype=x.dtype)[1:].view(x.shape)),
            ("swapped", x.transpose(-1, -2) if x.dim() >= 2 else x.flip(0)),
            ("no rows", x[:0]), ("sparse", x.to_sparse()), ("a list", x.flatten()[:4].tolist()),
            ("None", None)]
    for i in range(x.dim()):
        grown = list(x.shape)
        grown[i] += 1
        out.append((f"dim {i} + 1", torch.zeros(grown, dtype=x.dtype)))
        if x.shape[i] > 1:
            out += [(f"dim {i} - 1", x.narrow(i, 0, x.shape[i] - 1)),
                    (f"dim {i} every other", x[(slice(None),) * i + (slice(None, None, 2),)])]
    return out


def must_refuse(arg: str, what: str) -> bool:
    """Mutations no call may accept: a token tensor of another dtype, rank or size; an index,
    offset, count or slot table of floating point values; a sparse tensor."""
    token_shape = (arg in TOKEN_ARGS and what.startswith(("dtype", "one ", "dim "))
                   and "every other" not in what)
    return token_shape or (arg in TABLE_ARGS and what in FLOATS) or what == "sparse"


def tensor_swaps(kw: dict):
    """(arg, what, the arguments with that one mutated) for each tensor argument in `kw`."""
    for arg, value in kw.items():
        if isinstance(value, torch.Tensor):
            for what, bad in mutations(value):
                yield arg, what, {**kw, arg: bad}


def odd_swaps(fn, kw: dict, positional=()):
    """(arg, odd value, the arguments with that one replaced) for each keyword parameter of
    `fn` (the positional ones named in `positional` left out)."""
    for arg, prm in inspect.signature(fn).parameters.items():
        if arg in positional or prm.kind in (prm.VAR_KEYWORD, prm.VAR_POSITIONAL):
            continue
        for odd in ODD:
            yield arg, repr(odd)[:20], {**kw, arg: odd}


def outcome(fn, kw: dict, names: set, positional=(), what=()) -> Exception | None:
    """Call fn with `kw` (the names in `positional` passed by position): None if it went
    through, or the TypeError / ValueError it raised, whose message must start with argument
    names in `names` ("a: ..." or "a / b: ..."); any other exception propagates."""
    try:
        fn(*(kw[n] for n in positional), **{n: v for n, v in kw.items() if n not in positional})
    except (TypeError, ValueError) as e:
        said = str(e).split(": ")[0]
        assert said and {p.strip() for p in said.split("/")} <= names, (*what, str(e))
        return e
    return None
