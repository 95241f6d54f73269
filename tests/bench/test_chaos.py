"""The chaos harness's bookkeeping (the experiments themselves run real stacks: `cohort bench chaos`)."""

from __future__ import annotations

import httpx

from bench.chaos import Outcome, tally


class FakeHarness:
    def __init__(self, statuses: dict[str, int], duplicated: int = 0) -> None:
        self._s, self._d = statuses, duplicated

    def duplicated(self) -> int:
        return self._d

    def statuses(self) -> dict[str, int]:
        return self._s


def resp(status: int, body: dict | None = None, text: str = "") -> httpx.Response:
    return httpx.Response(status, json=body) if body is not None else httpx.Response(status, text=text)


def test_tally_counts_what_clients_saw():
    err = {"error": {"message": "m", "type": "t", "param": None, "code": "c"}}
    results = [resp(200, {"text": "ok"}), resp(200, {"text": "ok"}), resp(504, err), resp(507, err),
               resp(500, err), resp(500, text="Internal Server Error"), httpx.ReadTimeout("slow")]
    out = tally("x", results, FakeHarness({"done": 2, "timeout": 1, "failed": 2, "queued": 1}, duplicated=1))
    assert isinstance(out, Outcome)
    assert (out.sent, out.answered, out.explicit_errors, out.lost, out.duplicated) == (7, 2, 3, 2, 1)
    assert out.server_errors_5xx == 2  # 500s are bugs; 504 and 507 are promised answers
    assert out.records_disagree == 1   # the row left queued
