"""`hal.server.engine_loop.Handle`: a request answered in one body with no stop string holds
its tokens and wakes the event loop once, at its end; a streamed one (or one whose stop
strings need the text as it grows) gets every step's tokens as they come."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from hal.server.engine_loop import Finished, Handle, Tokens


@pytest.mark.parametrize("stream,stop,events", [(False, [], 1), (True, [], 5), (False, ["\n"], 5)])
def test_tokens_are_held_only_for_a_whole_answer(stream, stop, events):
    loop = asyncio.new_event_loop()
    try:
        q: asyncio.Queue = asyncio.Queue()
        h = Handle(SimpleNamespace(stream=stream, stop=stop), q, loop)
        for t in range(5):
            h.tokens([t], [f"lp{t}"])
        h.flush()
        h.push(Finished("length"))
        loop.run_until_complete(asyncio.sleep(0))   # run the pushes (call_soon_threadsafe)
        got = [q.get_nowait() for _ in range(q.qsize())]
    finally:
        loop.close()
    tokens = [e for e in got if isinstance(e, Tokens)]
    assert len(tokens) == events and isinstance(got[-1], Finished)
    assert [t for e in tokens for t in e.ids] == list(range(5))
    assert [lp for e in tokens for lp in e.logprobs] == [f"lp{t}" for t in range(5)]
    assert not h.held and h.held_logprobs is None
