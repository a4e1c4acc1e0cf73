"""Alongside forwards on different streams, one after another; and the side streams a plan's
Fork steps run on.

Each K2 grid of an alongside forward holds up to half of the SMs while it waits for its K1, so
two at once can leave K1 none: a hang, ended by K2's trap. One launched on another stream than
the last waits (on the device, not the host) for that one's end; then an event marks its own
end (one event per device, reused: a wait takes its last record at the time of the wait). The
lock keeps host threads launching at once in order. Off during capture: a captured stream
cannot wait on an event recorded outside it (graphs replayed at once on several streams are not
covered)."""

from __future__ import annotations

import contextlib
import threading

from . import driver

# per device: (the stream of the last alongside forward launched, an event recorded after it)
_last: dict[int, tuple[int, int]] = {}
_lock = threading.Lock()
# per device: the side stream of every call stream (Fork steps); per (device, call stream): the
# fork and join events. Work of calls on different streams shares the side stream: ordered
# after each of their forks, never before one (its own events say what a call waits for).
_side: dict[tuple[int, bool], int] = {}
_events: dict[tuple[int, int], tuple[int, int]] = {}


def side(device: int, stream: int, first: bool = False) -> tuple[int, int, int]:
    """The side stream of `device` (made on first use, non-blocking; `first`: the one of the
    greatest priority, whose blocks the device's scheduler places before the call stream's)
    and the fork and join events of `stream` on it, in the current context."""
    with _lock:
        s = _side.get((device, first))
        if s is None:
            s = _side[(device, first)] = driver.new_stream(first)
        ev = _events.get((device, stream))
        if ev is None:
            ev = _events[(device, stream)] = (driver.new_event(), driver.new_event())
        return s, ev[0], ev[1]


@contextlib.contextmanager
def alongside_order(device: int, stream: int, enabled: bool):
    if not enabled:
        yield
        return
    with _lock:
        last = _last.get(device)
        if last is not None and last[0] != stream:
            driver.wait_event(stream, last[1])
        yield
        event = last[1] if last is not None else driver.new_event()
        driver.record_event(event, stream)
        _last[device] = (stream, event)


def set_aside() -> tuple:
    """The streams and events known now, forgotten until `put_back` (a substituted driver's
    block: kda_cute.launch.driver.substitute)."""
    with _lock:
        held = (dict(_last), dict(_side), dict(_events))
    forget()
    return held


def put_back(held: tuple) -> None:
    """Those of `set_aside` known again, the ones made since forgotten."""
    forget()
    with _lock:
        for d, saved in zip((_last, _side, _events), held, strict=True):
            d.update(saved)


def forget() -> None:
    """Forget the last alongside forwards and the side streams (their streams and events
    belong to a driver being replaced)."""
    for d in (_last, _side, _events):
        d.clear()


driver.holds_driver_objects(set_aside, put_back)
