"""The Batch API on the real stack (issue 21): Redis, a Celery worker, the batcher, the gateway
and the job runner as processes, driven by the unmodified ``openai`` SDK — upload, create, poll,
download the output and error files, list, cancel — with two API keys that cannot see each
other's files and batches, and no key answered 401."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import httpx
import openai
import pytest
from openai import OpenAI

pytestmark = pytest.mark.e2e
KEY_A, KEY_B = "sk-team-a", "sk-team-b"
STACK_ENV = {"COHORT_SERVED_MODEL_NAME": "cohort-tiny", "COHORT_API_KEYS": f"{KEY_A},{KEY_B}",
             "COHORT_OFFLINE__POLL_S": "0.2"}


def row(cid: str, **body) -> str:
    return json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
                       "body": {"model": "cohort-tiny", "messages": [{"role": "user", "content": f"Say {cid}."}],
                                "max_tokens": 4, **body}})


@pytest.fixture(scope="module")
def runner(stack):
    stack.env["COHORT_OFFLINE__GATEWAY_URL"] = stack.url
    stack.spawn("batch-runner", "batch", "runner")
    return stack


def client(stack, key: str) -> OpenAI:
    return OpenAI(base_url=f"{stack.url}/v1", api_key=key, timeout=60, max_retries=0)


def wait(c: OpenAI, batch_id: str, statuses: tuple[str, ...], timeout_s: float = 240.0):
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        b = c.batches.retrieve(batch_id)
        if b.status in statuses:
            return b
        time.sleep(0.5)
    raise TimeoutError(f"{batch_id} is still {b.status}")


def test_the_sdk_round_trip_with_keys(stack, runner):
    a, b = client(stack, KEY_A), client(stack, KEY_B)
    lines = [row(f"r{i}") for i in range(6)] + ["{broken", row("r0"), row("bad-model", model="no-such-model")]
    f = a.files.create(file=("eval.jsonl", ("\n".join(lines) + "\n").encode()), purpose="batch")
    assert f.purpose == "batch" and f.bytes > 0
    job = a.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h",
                           metadata={"suite": "e2e"})
    assert job.status == "validating" and job.metadata == {"suite": "e2e"}

    with pytest.raises(openai.NotFoundError):           # another key: not there
        b.batches.retrieve(job.id)
    with pytest.raises(openai.NotFoundError):
        b.files.retrieve(f.id)
    no_key = httpx.get(f"{stack.url}/v1/files")          # the SDK insists on a key: plain HTTP without one
    assert no_key.status_code == 401 and no_key.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):      # a wrong key
        client(stack, "sk-wrong").batches.list()

    done = wait(a, job.id, ("completed", "failed", "expired", "cancelled"))
    assert done.status == "completed", stack.tail("batch-runner")
    assert done.request_counts.total == 9 and done.request_counts.completed == 6 and done.request_counts.failed == 3
    out = [json.loads(x) for x in a.files.content(done.output_file_id).text.splitlines()]
    assert sorted(o["custom_id"] for o in out) == [f"r{i}" for i in range(6)]
    for o in out:
        assert o["error"] is None and o["response"]["status_code"] == 200 and o["response"]["request_id"]
        assert o["response"]["body"]["object"] == "chat.completion"
        assert o["response"]["body"]["usage"]["completion_tokens"] > 0
    errs = [json.loads(x) for x in a.files.content(done.error_file_id).text.splitlines()]
    assert {((e["error"] or {}).get("code"), (e["response"] or {}).get("status_code")) for e in errs} == {
        ("invalid_json", None), ("duplicate_custom_id", None), (None, 404)}
    assert job.id in [x.id for x in a.batches.list(limit=10).data]
    assert job.id not in [x.id for x in b.batches.list(limit=10).data]
    with pytest.raises(openai.NotFoundError):
        b.files.content(done.output_file_id)


def test_cancel_stops_the_queued_rows(stack, runner):
    a = client(stack, KEY_A)
    lines = [row(f"c{i}", max_tokens=64, ignore_eos=True) for i in range(200)]
    f = a.files.create(file=("big.jsonl", ("\n".join(lines) + "\n").encode()), purpose="batch")
    job = a.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    wait(a, job.id, ("in_progress",), 60)
    cancelling = a.batches.cancel(job.id)
    assert cancelling.status in ("cancelling", "cancelled")
    final = wait(a, job.id, ("cancelled",), 60)
    counts = final.request_counts
    assert counts.total == 200 and counts.completed + counts.failed == 200 and counts.failed > 0
    errs = [json.loads(x) for x in a.files.content(final.error_file_id).text.splitlines()]
    assert {e["error"]["code"] for e in errs} == {"batch_cancelled"} and len(errs) == counts.failed
    if final.output_file_id:  # rows finished before the cancel are kept
        assert len(a.files.content(final.output_file_id).text.splitlines()) == counts.completed


def test_cohort_batch_run_writes_one_line_per_input_line(stack, tmp_path):
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    lines = [row("x0"), json.dumps({"custom_id": "x1", "method": "POST", "url": "/v1/completions",
                                    "body": {"prompt": "Once", "max_tokens": 3}}), "{broken", row("x2")]
    src.write_text("\n".join(lines) + "\n")
    done = subprocess.run([sys.executable, "-m", "launch.cli", "batch", "run", str(src), "-o", str(out),
                           "--url", stack.url, "--api-key", KEY_A], env=stack.env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    got = [json.loads(x) for x in out.read_text().splitlines()]
    assert [g["custom_id"] for g in got] == ["x0", "x1", None, "x2"]
    assert [g["response"]["status_code"] if g["response"] else g["error"]["code"] for g in got] == [
        200, 200, "invalid_json", 200]
    assert got[1]["response"]["body"]["object"] == "text_completion"
