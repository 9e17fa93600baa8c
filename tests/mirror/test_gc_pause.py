"""gc_paused: decode's pause of the cyclic collector nests, spans threads, and restores what it found."""
from __future__ import annotations

import gc
import threading

import pytest

from flowcheck.capture.mirror.gc_pause import gc_paused


@pytest.fixture(autouse=True)
def _collector_enabled():
    was = gc.isenabled()
    gc.enable()
    yield
    (gc.enable if was else gc.disable)()


def test_the_collector_is_off_inside_and_back_on_after_even_when_the_body_raises():
    with gc_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(RuntimeError), gc_paused():
        raise RuntimeError("boom")
    assert gc.isenabled()


def test_nested_pauses_re_enable_only_when_the_outermost_ends():
    with gc_paused():
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()


def test_a_callers_own_disable_survives_the_pause():
    gc.disable()
    with gc_paused():
        assert not gc.isenabled()
    assert not gc.isenabled()


def test_overlapping_pauses_on_two_threads_re_enable_after_the_last_one():
    inside, release = threading.Event(), threading.Event()

    def other():
        with gc_paused():
            inside.set()
            release.wait(10)

    t = threading.Thread(target=other)
    with gc_paused():
        t.start()
        assert inside.wait(10)
    assert not gc.isenabled()  # the other thread's pause still holds
    release.set()
    t.join(10)
    assert gc.isenabled()
