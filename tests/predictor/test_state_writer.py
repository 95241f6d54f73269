"""The online state file has one writer among the processes that share it: the holder of its lock,
taken over by another once the holder lets go (or dies: the kernel lets a dead process's lock go)."""

from __future__ import annotations

import subprocess
import sys

from predictor.state_writer import StateWriter


def test_one_writer_and_a_takeover(tmp_path):
    path = tmp_path / "online.json"
    first, second = StateWriter(path), StateWriter(path)
    assert first.held() and first.held()  # kept once taken
    assert not second.held()
    first.release()
    assert second.held() and not first.held()
    second.release()


def test_a_dead_holders_lock_is_taken_over(tmp_path):
    path = tmp_path / "online.json"
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time\nfrom predictor.state_writer import StateWriter\n"
                               f"w = StateWriter({str(path)!r}); assert w.held(); print('held', flush=True); "
                               "time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        mine = StateWriter(path)
        assert not mine.held()
        holder.kill()
        holder.wait()
        assert mine.held()
        mine.release()
    finally:
        if holder.poll() is None:
            holder.kill()
