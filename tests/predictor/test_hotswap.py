"""The one hot-reload rule both predictor services use."""

from __future__ import annotations

from predictor.hotswap import HotSwap


def test_follows_its_source_and_does_not_retry_a_broken_version():
    state = {"key": 1, "fail": False, "loads": 0}

    def load():
        state["loads"] += 1
        if state["fail"]:
            raise RuntimeError("corrupt model file")
        return f"model-{state['key']}"

    swap = HotSwap("test", lambda: (state["key"], f"v{state['key']}", load), "default", interval_s=3600)
    assert swap.current == ("default", None)
    assert swap.maybe_reload(force=True) and swap.current == ("model-1", "v1")
    state["key"] = 2
    assert not swap.maybe_reload()                     # checked at most once per interval
    state["fail"] = True
    assert not swap.maybe_reload(force=True) and swap.current == ("model-1", "v1")  # keeps what it had
    assert not swap.maybe_reload(force=True) and state["loads"] == 2                # not retried
    state.update(key=3, fail=False)
    assert swap.maybe_reload(force=True) and swap.current == ("model-3", "v3")


def test_nothing_to_load_keeps_the_current_model():
    swap = HotSwap("test", lambda: ("k", None, None), "default", interval_s=0)
    assert not swap.maybe_reload() and swap.current == ("default", None)
