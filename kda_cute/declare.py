"""Each public call declared once. The eager function is the definition; `op` makes from it

- the torch.library op(s) that torch.compile traces the call into (`torch.ops.kda_cute.<name>`),
  whose schema is the function's signature less the host-only options (a config object, a
  stream, `bind`), and which return nothing: their outputs are the caller's tensors;
- each op's fake: the function run dry (its metadata checks, nothing allocated for real,
  planned or launched), so a bad shape, dtype or option raises while tracing, naming the
  argument;
- `.check(*args, **kwargs)`: the same dry run for a caller that asks before it calls (the fla
  backend's verifiers): raises what the call would raise before its launch, else None.

Eagerly the function is called as written (no dispatcher, no wrapper): torch.compile meets it
as a function substituted in its graphs by its traced form. A function is written to run dry:
where `dry()` is true it stops after its checks (kda_cute.checks), before its memo, plan and
launch; whatever it allocates is a FakeTensor then.

A call whose state is read and written in place (`initial_state is final_state`) traces into a
`<name>_inplace` op taking the one tensor as `state` (an op may not take two aliasing
arguments of which one is written). A call with two forms that write different tensors (verify's
styles) names one op per form.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import typing

import torch
from torch import Tensor

NAMESPACE = "kda_cute"
OPS: list[str] = []  # every op declared, by name

_dry = contextvars.ContextVar("kda_cute_dry", default=False)


def dry() -> bool:
    """Whether the call running is a dry run (an op's fake or a `.check`)."""
    return _dry.get()


@contextlib.contextmanager
def _dry_run(fake: bool):
    """A dry run: `dry()` true; with `fake`, what the call allocates or copies is a FakeTensor
    (an op's fake runs in the tracer's fake mode already)."""
    token = _dry.set(True)
    try:
        if fake:
            from torch._subclasses.fake_tensor import FakeTensorMode
            with FakeTensorMode(allow_non_fake_inputs=True):
                yield
        else:
            yield
    finally:
        _dry.reset(token)


class _NoHint(Exception):
    pass


def _hint(x):
    if isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        h = x.node.hint
        if h is None:  # unbacked: nothing to check against until it runs
            raise _NoHint
        return type(h)(h)
    return x


def _symbolic(x) -> bool:
    if isinstance(x, Tensor):
        return any(isinstance(d, torch.SymInt) for d in (*x.shape, *x.stride()))
    return isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool))


def _concrete(kwargs: dict) -> dict | None:
    """Under dynamic shapes the fake checks stand-ins of the example sizes (fake tensors of the
    same dtypes and devices) rather than adding guards; the eager checks of the real call see
    every actual shape. None where a size is unbacked."""
    if not any(_symbolic(a) for a in kwargs.values()):
        return kwargs
    try:
        return {n: torch.empty_strided([_hint(d) for d in a.shape],
                                       [_hint(d) for d in a.stride()], dtype=a.dtype,
                                       device=a.device) if isinstance(a, Tensor) else _hint(a)
                for n, a in kwargs.items()}
    except _NoHint:
        return None


class _Form(typing.NamedTuple):
    """One op of a declared call: its name, the arguments it writes, and (in place) the
    argument pair it takes as one `state`."""

    name: str
    writes: tuple[str, ...]
    alias: tuple[str, str] | None


def op(name: str, *, writes, host_only=(), out_like=None, returns=None, inplace=None,
       forms=None):
    """Declare the public call below it (see the module's docstring).

    writes: the arguments the call writes. host_only: options an op cannot take (they must be
    None / False under torch.compile). out_like: with `out` None, the traced call allocates it
    as bf16 of this argument's shape (as the eager call does). returns: the argument returned
    (None: nothing). inplace: (initial, final) argument names: where the call passes one tensor
    for both, it traces into `<name>_inplace`. forms: {op name: (writes, test)} for a call with
    several forms, `test(args)` picking the form from the bound arguments (the first true)."""
    def wrap(fn):
        sig = inspect.signature(fn)
        hints = typing.get_type_hints(fn)
        params = [p for n, p in sig.parameters.items() if n not in host_only]
        variants = [(_Form(n, tuple(w), None), test)
                    for n, (w, test) in (forms or {name: (writes, None)}).items()]
        if inplace is not None:
            variants.append((_Form(f"{name}_inplace", tuple(
                "state" if w in inplace else w for w in writes), inplace), None))
        for form, _ in variants:
            _register(fn, form, params, hints)
            OPS.append(form.name)

        names = list(sig.parameters)
        defaults = {n: p.default for n, p in sig.parameters.items()
                    if p.default is not inspect.Parameter.empty}
        floats = {n for n in names if hints.get(n) in (float, float | None)}

        # torch.compile traces this wherever it meets the function; eagerly the function is
        # called as written, with nothing in front of it
        @functools.wraps(fn)
        def traced(*args, **kwargs):
            bound = dict(defaults)
            bound.update(zip(names, args, strict=False))
            bound.update(kwargs)
            for n in host_only:
                if bound.get(n) not in (None, False):
                    raise ValueError(
                        f"{n}: expected {'False' if n == 'bind' else 'None'} under "
                        f"torch.compile (the ops take tensors and scalars only), got "
                        f"{bound[n]!r}")
                bound.pop(n, None)
            for n in floats:  # the schema's floats (an int given is a float to the call)
                x = bound[n]
                if type(x) is int:
                    bound[n] = float(x)
            if out_like is not None and bound.get("out") is None:
                like = bound[out_like]
                bound["out"] = torch.empty(like.shape, dtype=torch.bfloat16, device=like.device)
            if inplace is not None and bound[inplace[0]] is not None and \
                    bound[inplace[1]] is bound[inplace[0]]:
                chosen = f"{name}_inplace"
                bound["state"] = bound.pop(inplace[0])
                del bound[inplace[1]]
            else:
                chosen = next(form.name for form, test in variants
                              if form.alias is None and (test is None or test(bound)))
            getattr(getattr(torch.ops, NAMESPACE), chosen).default(**bound)
            return None if returns is None else bound[returns]

        torch.compiler.substitute_in_graph(fn, skip_signature_check=True)(traced)
        fn.check = _checker(fn)
        fn.ops = tuple(form.name for form, _ in variants)
        return fn
    return wrap


def composite(fn):
    """Declare a public call made of declared ones (fla's forms, which allocate, copy and call
    fwd / verify / recurrent): torch.compile traces through it into their ops; it gains
    `.check`, its dry run."""
    fn.check = _checker(fn)
    return fn


def _checker(fn):
    def check(*args, **kwargs) -> None:
        """The call's checks alone: raises what the call with these arguments would raise
        before its launch, else returns None. Reads metadata (and the addresses of tensors
        that have one) only: what the call would allocate or copy is a FakeTensor, nothing is
        planned, launched or synced."""
        with _dry_run(fake=True):
            fn(*args, **kwargs)
    check.__name__ = f"check_{fn.__name__}"
    return check


def _register(fn, form: _Form, params, hints):
    """The torch.library op of one form: schema from `params`, eager body `fn`, fake `fn` run
    dry."""
    if form.alias is not None:  # the pair becomes one `state`, where the first stood
        first, second = form.alias
        params = [p.replace(name="state") if p.name == first else p
                  for p in params if p.name != second]
        hints = {**hints, "state": Tensor}

    names = [p.name for p in params]

    def named(args, kw):
        kw = dict(zip(names, args, strict=False), **kw)
        if form.alias is not None:
            kw[form.alias[0]] = kw[form.alias[1]] = kw.pop("state")
        return kw

    def impl(*args, **kw):
        fn(**named(args, kw))

    def fake(*args, **kw):
        kw = _concrete(named(args, kw))
        if kw is not None:
            with _dry_run(fake=False):
                fn(**kw)

    # every argument positional or keyword (an op takes no keyword-only tensors) and without a
    # default (torch's in-place bookkeeping indexes the written arguments among those passed;
    # the traced call passes all)
    impl.__signature__ = inspect.Signature(
        [p.replace(annotation=hints[p.name], kind=inspect.Parameter.POSITIONAL_OR_KEYWORD,
                   default=inspect.Parameter.empty) for p in params],
        return_annotation=None)
    impl.__name__ = form.name
    op_ = torch.library.custom_op(f"{NAMESPACE}::{form.name}", impl, device_types="cuda",
                                  mutates_args=form.writes)
    op_.register_fake(fake)
    return op_
