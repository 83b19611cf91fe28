"""The relay's per-stream state machine (shim/relay/streams.py) and the one routing decision per call."""

from __future__ import annotations

from shim.cri.routing import Router
from shim.relay import http2
from shim.relay.core import RelayCore
from shim.relay.events import Request
from shim.relay.streams import (CLOSED_LOCAL_MEMORY, ENDED, OPEN_LOCAL, OPEN_RELAYED, TRANSITIONS, Event,
                                LocalStream, State, StreamTable)
from tests.unit.test_relay_core import PULL, VERSION, Peers, data, headers, limits, message


def test_every_transition_leads_where_the_table_keeps_it() -> None:
    for (state, _), new in TRANSITIONS.items():
        if state in OPEN_RELAYED:
            assert new in OPEN_RELAYED or new is State.GONE or new in ENDED
        else:
            assert state in OPEN_LOCAL and (new in OPEN_LOCAL or new in ENDED)


def test_a_relayed_stream_is_counted_until_the_runtime_ends_it() -> None:
    t = StreamTable()
    t.relay(1)
    t.relayed_event(1, Event.RUNTIME_HEADERS)
    assert t.relayed == {1: State.RESPONDING} and t.open == 1
    t.relayed_event(1, Event.RUNTIME_HEADERS)  # trailers: no transition
    t.relayed_event(1, Event.RUNTIME_END)
    assert t.relayed == {} and t.closed == {} and t.open == 0


def test_closed_streams_are_remembered_up_to_the_memory_and_forgotten_with_their_runtime_side() -> None:
    t = StreamTable()
    for sid in range(1, 2 * (CLOSED_LOCAL_MEMORY + 1), 2):
        t.drop_runtime.add(sid)
        t.remember(sid, State.ANSWERED)
    assert len(t.closed) == CLOSED_LOCAL_MEMORY and 1 not in t.closed and 1 not in t.drop_runtime
    assert 3 in t.closed and 3 in t.drop_runtime


def test_an_intercepted_stream_leaves_the_open_table_when_it_ends() -> None:
    t = StreamTable()
    s = LocalStream(1, PULL, "handler", [], recv_window=10, send_window=10)  # type: ignore[arg-type]
    t.local[1] = s
    assert t.local_event(s, Event.CLIENT_END) is State.RECEIVING and s.client_ended
    t.local_event(s, Event.SHIM_HEADERS)
    assert t.local_event(s, Event.SHIM_END) is State.ANSWERING
    assert s.done and 1 not in t.local and t.closed == {1: State.CLOSED}


def test_the_route_is_decided_once_at_the_headers_and_the_handler_rides_on_the_stream() -> None:
    router = Router({PULL: "first"})
    calls: list[str] = []

    def route(path: str):  # type: ignore[no-untyped-def]
        calls.append(path)
        return router.route(path)

    p = Peers()
    p.core = RelayCore(limits(), route)
    p.from_client(http2.PREFACE)
    p.events()
    p.core.start_relay()
    p.from_runtime(http2.settings_frame({}))
    p.from_client(headers(1, PULL) + headers(3, VERSION))
    router.set_table({PULL: "second"})  # a reload while the request body is on its way
    p.from_client(data(1, message(b"x"), end_stream=True))
    [ev] = [e for e in p.events() if isinstance(e, Request)]
    assert ev.stream.handler == "first" and ev.stream.path == PULL
    assert calls == [PULL, VERSION]
