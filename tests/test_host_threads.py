"""`hal.host_threads.in_a_thread_that_ends`, and the server loading its target with it (so that
the engine loop's thread is the only one with an OpenMP team; the speed is a benchmark,
benchmarks/serve_decode.py)."""

import threading

import pytest

from hal.errors import HalError
from hal.host_threads import in_a_thread_that_ends


def test_it_runs_in_another_thread_that_has_ended_and_returns_the_value():
    seen = []

    def fn():
        seen.append(threading.current_thread())
        return 42
    assert in_a_thread_that_ends(fn) == 42
    assert seen[0] is not threading.current_thread() and not seen[0].is_alive()


def test_its_exception_is_raised_in_the_caller():
    def fn():
        raise HalError("model: expected a GGUF file, got nothing")
    with pytest.raises(HalError, match="model: expected"):
        in_a_thread_that_ends(fn)


def test_the_server_loads_its_target_off_the_main_thread(monkeypatch, capsys):
    import hal.launch.start
    from hal.server.app import main
    seen = []

    def start(*args, **kw):   # records where it runs, then ends start-up as a refused model would
        seen.append(threading.current_thread())
        raise HalError("model: stop here")
    monkeypatch.setattr(hal.launch.start, "start", start)
    assert main(["--port", "0", "--draft", "none"]) == 2
    assert "model: stop here" in capsys.readouterr().err
    assert seen and seen[0] is not threading.main_thread() and not seen[0].is_alive()
