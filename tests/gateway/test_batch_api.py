"""The Batch API and API keys on the real gateway app (harness: fakeredis, a fake
worker answering every request): files, batches, the job runner carrying a job through the
gateway, output/error lines in OpenAI's format, key isolation, 401 and 429."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from cohort import jobdb
from cohort.settings import Settings
from offline.runner import JobRunner, row_priority
from tests.gateway.harness import answering, gateway

MSG = [{"role": "user", "content": "hi"}]


def line(cid: str, body: dict | None = None, url: str = "/v1/chat/completions") -> str:
    return json.dumps({"custom_id": cid, "method": "POST", "url": url,
                       "body": body or {"messages": MSG, "max_tokens": 4}})


async def upload(client, text: str, key: str | None = None, purpose: str = "batch") -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return await client.post("/v1/files", files={"file": ("in.jsonl", text.encode())}, data={"purpose": purpose},
                             headers=headers)


async def run_job(app, client, batch_id: str, timeout_s: float = 20.0) -> dict:
    """Step a job runner (talking to the app in-process) until the job ends; its batch object."""
    runner = JobRunner(app.state.settings, client=httpx.AsyncClient(transport=httpx.ASGITransport(app),
                                                                    base_url="http://gw", timeout=30))
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while loop.time() < deadline:
        await runner.step()
        b = (await client.get(f"/v1/batches/{batch_id}")).json()
        if b["status"] in ("completed", "failed", "expired", "cancelled"):
            return b
        await asyncio.sleep(0.05)
    raise TimeoutError(f"job {batch_id} did not end: {b}")


def test_files_round_trip(tmp_path):
    async def scenario():
        async with gateway(tmp_path) as (_, client, _redis):
            up = await upload(client, line("a") + "\n")
            fid = up.json()["id"]
            listed = (await client.get("/v1/files")).json()
            got = (await client.get(f"/v1/files/{fid}")).json()
            content = await client.get(f"/v1/files/{fid}/content")
            wrong_purpose = await upload(client, line("a"), purpose="fine-tune")
            deleted = (await client.delete(f"/v1/files/{fid}")).json()
            gone = await client.get(f"/v1/files/{fid}")
            return up, listed, got, content, wrong_purpose, deleted, gone

    up, listed, got, content, wrong_purpose, deleted, gone = asyncio.run(scenario())
    assert up.status_code == 200, up.text
    f = up.json()
    assert f["object"] == "file" and f["purpose"] == "batch" and f["bytes"] == len(line("a")) + 1
    assert [x["id"] for x in listed["data"]] == [f["id"]] and got == f
    assert content.content.decode() == line("a") + "\n"
    assert wrong_purpose.status_code == 400 and wrong_purpose.json()["error"]["param"] == "purpose"
    assert deleted == {"id": f["id"], "object": "file", "deleted": True}
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "file_not_found"


def test_a_file_over_the_limit_is_413(tmp_path):
    async def scenario():
        async with gateway(tmp_path, max_file_bytes=100) as (_, client, _redis):
            return await upload(client, line("a") * 5)

    r = asyncio.run(scenario())
    assert r.status_code == 413 and r.json()["error"]["code"] in ("file_too_large", "body_too_large")


def test_a_job_runs_through_the_gateway_with_bad_lines_in_the_error_file(tmp_path):
    rows = [line("a"), line("b", {"prompt": "hello", "max_tokens": 3}, "/v1/completions"), "{not json",
            line("a"), line("c", {"messages": MSG, "model": "no-such-model"}), line("d", {"messages": "x"}), line("e")]

    async def scenario():
        async with gateway(tmp_path) as (app, client, redis):
            fid = (await upload(client, "\n".join(rows) + "\n")).json()["id"]
            created = await client.post("/v1/batches", json={"input_file_id": fid, "endpoint": "/v1/chat/completions",
                                                             "completion_window": "24h", "metadata": {"k": "v"}})
            assert created.status_code == 200, created.text
            async with answering(redis, text="ok"):
                done = await run_job(app, client, created.json()["id"])
            out = (await client.get(f"/v1/files/{done['output_file_id']}/content")).text
            err = (await client.get(f"/v1/files/{done['error_file_id']}/content")).text
            metrics = (await client.get("/metrics")).text
            return created.json(), done, out, err, metrics

    created, done, out, err, metrics = asyncio.run(scenario())
    assert 'cohort_batch_jobs{status="completed"} 1.0' in metrics
    assert created["status"] == "validating" and created["metadata"] == {"k": "v"} and created["object"] == "batch"
    assert done["status"] == "completed", done
    assert done["request_counts"] == {"total": 7, "completed": 2, "failed": 5}
    assert all(done[k] for k in ("in_progress_at", "finalizing_at", "completed_at"))
    outs = [json.loads(x) for x in out.splitlines()]
    assert [o["custom_id"] for o in outs] == ["a", "e"]
    for o in outs:
        assert set(o) == {"id", "custom_id", "response", "error"} and o["error"] is None
        assert set(o["response"]) == {"status_code", "request_id", "body"} and o["response"]["status_code"] == 200
        assert o["response"]["body"]["object"] == "chat.completion"
        assert o["response"]["body"]["choices"][0]["message"]["content"] == "ok"
    errs = {(e["custom_id"], (e["error"] or {}).get("code"), (e["response"] or {}).get("status_code"))
            for e in map(json.loads, err.splitlines())}
    assert errs == {("b", "invalid_url", None), (None, "invalid_json", None), ("a", "duplicate_custom_id", None),
                    ("c", None, 404), ("d", None, 400)}


def test_a_file_that_is_not_a_batch_file_fails_validation(tmp_path):
    async def scenario():
        async with gateway(tmp_path) as (app, client, _redis):
            fid = (await upload(client, "just some text\nnot json either\n")).json()["id"]
            b = (await client.post("/v1/batches", json={"input_file_id": fid, "endpoint": "/v1/chat/completions",
                                                        "completion_window": "24h"})).json()
            return await run_job(app, client, b["id"])

    b = asyncio.run(scenario())
    assert b["status"] == "failed" and b["failed_at"]
    assert b["errors"]["data"][0]["code"] == "not_a_batch_file"


@pytest.mark.slow  # 0.32 s of real work on the 2-core VM: `make test` runs it, the fast loop does not
def test_cancel_keeps_finished_rows_and_stops_the_rest(tmp_path):
    async def scenario():
        async with gateway(tmp_path) as (app, client, _redis):  # no worker answers: rows stay queued
            fid = (await upload(client, "\n".join(line(str(i)) for i in range(4)))).json()["id"]
            b = (await client.post("/v1/batches", json={"input_file_id": fid, "endpoint": "/v1/chat/completions",
                                                        "completion_window": "24h"})).json()
            runner = JobRunner(app.state.settings, client=httpx.AsyncClient(
                transport=httpx.ASGITransport(app), base_url="http://gw", timeout=30))
            await runner.step()   # validated
            await runner.step()   # rows sent, waiting for answers
            await asyncio.sleep(0.2)
            cancelling = (await client.post(f"/v1/batches/{b['id']}/cancel")).json()
            await runner.step()
            final = (await client.get(f"/v1/batches/{b['id']}")).json()
            again = await client.post(f"/v1/batches/{b['id']}/cancel")
            err = (await client.get(f"/v1/files/{final['error_file_id']}/content")).text
            return cancelling, final, again, err

    cancelling, final, again, err = asyncio.run(scenario())
    assert cancelling["status"] == "cancelling" and cancelling["cancelling_at"]
    assert final["status"] == "cancelled" and final["request_counts"] == {"total": 4, "completed": 0, "failed": 4}
    assert again.status_code == 200
    assert {json.loads(e)["error"]["code"] for e in err.splitlines()} == {"batch_cancelled"}


def test_keys_401_404_and_isolation(tmp_path):
    async def scenario():
        async with gateway(tmp_path, api_keys="key-one,key-two") as (_, client, _redis):
            none = await client.get("/v1/files")
            wrong = await client.get("/v1/files", headers={"authorization": "Bearer nope"})
            fid = (await upload(client, line("a"), key="key-one")).json()["id"]
            b = (await client.post("/v1/batches", headers={"authorization": "Bearer key-one"}, json={
                "input_file_id": fid, "endpoint": "/v1/chat/completions", "completion_window": "24h"})).json()
            two = {"authorization": "Bearer key-two"}
            other = [await client.get(f"/v1/files/{fid}", headers=two),
                     await client.get(f"/v1/files/{fid}/content", headers=two),
                     await client.get(f"/v1/batches/{b['id']}", headers=two),
                     await client.post(f"/v1/batches/{b['id']}/cancel", headers=two),
                     await client.post("/v1/batches", headers=two, json={
                         "input_file_id": fid, "endpoint": "/v1/chat/completions", "completion_window": "24h"})]
            listed = (await client.get("/v1/batches", headers=two)).json()
            mine = await client.get(f"/v1/batches/{b['id']}", headers={"authorization": "Bearer key-one"})
            health = await client.get("/health")
            return none, wrong, other, listed, mine, health

    none, wrong, other, listed, mine, health = asyncio.run(scenario())
    for r in (none, wrong):
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert set(r.json()["error"]) >= {"message", "type", "param", "code"}
    assert [r.status_code for r in other] == [404] * 5
    assert listed["data"] == [] and mine.status_code == 200
    assert health.status_code in (200, 503)  # not behind the keys


def test_requests_per_minute_answer_429_with_retry_after(tmp_path):
    async def scenario():
        async with gateway(tmp_path, api_keys="k", api_key_rpm=2) as (_, client, _redis):
            h = {"authorization": "Bearer k"}
            return [await client.get("/v1/files", headers=h) for _ in range(3)]

    rs = asyncio.run(scenario())
    assert [r.status_code for r in rs] == [200, 200, 429]
    assert rs[2].json()["error"]["code"] == "rate_limit_exceeded" and 1 <= int(rs[2].headers["retry-after"]) <= 60


def test_tokens_per_minute_and_usage_per_key(tmp_path):
    async def scenario():
        async with gateway(tmp_path, api_keys="k", api_key_tpm=1) as (app, client, redis):
            h = {"authorization": "Bearer k"}
            async with answering(redis):
                first = await client.post("/v1/chat/completions", json={"messages": MSG, "max_tokens": 2}, headers=h)
                second = await client.post("/v1/chat/completions", json={"messages": MSG, "max_tokens": 2}, headers=h)
            metrics = (await client.get("/metrics")).text
            return first, second, jobdb.usage_by_key(app.state.db), metrics

    first, second, used, metrics = asyncio.run(scenario())
    assert first.status_code == 200 and second.status_code == 429 and "retry-after" in second.headers
    (kid,) = used
    assert used[kid]["requests"] == 1 and used[kid]["completion_tokens"] == 1 and used[kid]["prompt_tokens"] > 0
    assert f'cohort_api_key_tokens_total{{key="{kid}",kind="completion"}} 1.0' in metrics


def test_streamed_answers_count_their_tokens_without_a_usage_chunk(tmp_path):
    async def scenario():
        async with gateway(tmp_path, api_keys="k", api_key_tpm=1) as (app, client, redis):
            h = {"authorization": "Bearer k"}
            async with answering(redis):
                first = await client.post("/v1/chat/completions", headers=h,
                                          json={"messages": MSG, "max_tokens": 2, "stream": True})
                second = await client.post("/v1/chat/completions", json={"messages": MSG, "max_tokens": 2}, headers=h)
            metrics = (await client.get("/metrics")).text
            return first, second, jobdb.usage_by_key(app.state.db), metrics

    first, second, used, metrics = asyncio.run(scenario())
    assert first.status_code == 200 and "data: [DONE]" in first.text and '"usage"' not in first.text
    assert second.status_code == 429  # the streamed answer's tokens spent the key's minute
    (kid,) = used
    assert used[kid]["requests"] == 1 and used[kid]["completion_tokens"] == 1 and used[kid]["prompt_tokens"] > 0
    assert f'cohort_api_key_tokens_total{{key="{kid}",kind="completion"}} 1.0' in metrics


@pytest.mark.slow  # 0.57 s of real work on the 2-core VM: `make test` runs it, the fast loop does not
def test_admin_keys_create_use_revoke(tmp_path):
    async def scenario():
        async with gateway(tmp_path, admin_token="adm") as (_, client, _redis):
            adm = {"authorization": "Bearer adm"}
            open_before = await client.get("/v1/files")
            made = (await client.post("/admin/keys", json={"name": "team-a", "rpm": 100}, headers=adm)).json()
            no_key = await client.get("/v1/files")
            with_key = await client.get("/v1/files", headers={"authorization": f"Bearer {made['key']}"})
            listed = (await client.get("/admin/keys", headers=adm)).json()
            revoked = await client.delete(f"/admin/keys/{made['id']}", headers=adm)
            after = await client.get("/v1/files", headers={"authorization": f"Bearer {made['key']}"})
            return open_before, made, no_key, with_key, listed, revoked, after

    open_before, made, no_key, with_key, listed, revoked, after = asyncio.run(scenario())
    assert open_before.status_code == 200  # no key exists: open, as before
    assert made["key"].startswith("sk-cohort-") and made["rpm"] == 100
    assert no_key.status_code == 401 and with_key.status_code == 200
    assert [k["id"] for k in listed["data"]] == [made["id"]] and "key" not in listed["data"][0]
    assert revoked.status_code == 200 and after.status_code == 401  # and the API stays closed


def test_rows_rise_in_priority_as_the_window_closes():
    s = Settings(_env_file=None, offline={"priority": 10, "urgent_after": 0.5})
    assert row_priority(s, 0, 0, 100) == 10 and row_priority(s, 50, 0, 100) == 10
    assert row_priority(s, 70, 0, 100) == 5 and row_priority(s, 90, 0, 100) == 0 and row_priority(s, 99, 0, 100) == 0


def test_a_row_is_answered_once_however_often_it_is_sent(tmp_path):
    db = jobdb.jobs_engine(f"sqlite:///{tmp_path}/j.db")
    jobdb.insert_rows(db, "batch-x", [{"idx": 0, "custom_id": "a", "body": {}}])
    (r,) = jobdb.claim_rows(db, "batch-x", 5)
    assert jobdb.release_all_running(db) == 1          # a runner restarted: the row is sent again
    (r2,) = jobdb.claim_rows(db, "batch-x", 5)
    assert r2["attempts"] == 1  # the same attempt, so the same request id: it re-attaches (gateway.reattach)
    assert jobdb.settle_row(db, r["id"], jobdb.ROW_DONE, "first") is True
    assert jobdb.settle_row(db, r["id"], jobdb.ROW_DONE, "second") is False
    assert jobdb.settled_lines(db, "batch-x", jobdb.ROW_DONE) == ["first"]


@pytest.mark.slow  # half a second or more of real work: `make test` runs it, the fast loop does not
def test_a_job_past_its_window_expires(tmp_path):
    async def scenario():
        async with gateway(tmp_path) as (app, client, _redis):  # no worker: the rows never finish
            fid = (await upload(client, "\n".join(line(str(i)) for i in range(3)))).json()["id"]
            b = (await client.post("/v1/batches", json={"input_file_id": fid, "endpoint": "/v1/chat/completions",
                                                        "completion_window": "2s"})).json()
            runner = JobRunner(app.state.settings, client=httpx.AsyncClient(
                transport=httpx.ASGITransport(app), base_url="http://gw", timeout=30))
            await runner.step()
            await asyncio.sleep(2.2)
            await runner.step()
            final = (await client.get(f"/v1/batches/{b['id']}")).json()
            err = (await client.get(f"/v1/files/{final['error_file_id']}/content")).text
            bad_window = await client.post("/v1/batches", json={"input_file_id": fid, "endpoint": "/v1/chat/completions",
                                                                "completion_window": "48h"})
            return final, err, bad_window

    final, err, bad_window = asyncio.run(scenario())
    assert final["status"] == "expired" and final["expired_at"] and final["output_file_id"] is None
    assert final["request_counts"] == {"total": 3, "completed": 0, "failed": 3}
    assert {json.loads(e)["error"]["code"] for e in err.splitlines()} == {"batch_expired"}
    assert bad_window.status_code == 400 and bad_window.json()["error"]["param"] == "completion_window"


def test_the_runner_yields_while_interactive_requests_arrive(tmp_path):
    async def scenario():
        async with gateway(tmp_path, offline={"max_outstanding": 100, "yield_outstanding": 4}) as (app, client, redis):
            runner = JobRunner(app.state.settings, client=httpx.AsyncClient(
                transport=httpx.ASGITransport(app), base_url="http://gw"))
            runner.redis = redis
            idle = await runner.in_flight_limit()
            async with answering(redis):
                r = await client.post("/v1/chat/completions", json={"messages": MSG, "max_tokens": 2})
            busy = await runner.in_flight_limit()
            return idle, r.status_code, busy

    idle, status, busy = asyncio.run(scenario())
    assert (idle, status, busy) == (100, 200, 4)
