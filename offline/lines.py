"""The Batch API's file formats, one owner for both sides of a job:

- an input line is ``{"custom_id", "method": "POST", "url", "body"}`` (OpenAI's batch file, and
  vLLM's ``run-batch`` input);
- an output or error line is OpenAI's exactly:
  ``{"id", "custom_id", "response": {"status_code", "request_id", "body"} | null, "error": {"code", "message"} | null}``.

A line that cannot run (bad JSON, no custom_id, a duplicate custom_id, another method or URL, a
body that is not an object) becomes its own error line; the job's other lines still run. A file
with no line that could run is not a batch file, and the job fails validation with one clear
error (``not_a_batch_file``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import httpx


@dataclass
class Parsed:
    """A validated input file: ``rows`` to run ({idx, custom_id, body}) and ``errors`` already
    settled ({idx, custom_id, line}); ``fatal`` when the file is not a batch file at all."""

    rows: list[dict[str, Any]] = field(default_factory=list)
    errors: list[dict[str, Any]] = field(default_factory=list)
    fatal: str | None = None


def row_id(batch_id: str, idx: int) -> str:
    """The ``id`` of a row's output line (OpenAI: ``batch_req_…``), stable across re-runs."""
    return f"batch_req_{batch_id.removeprefix('batch-')}_{idx}"


def error_line(batch_id: str, idx: int, custom_id: str | None, code: str, message: str) -> str:
    return json.dumps({"id": row_id(batch_id, idx), "custom_id": custom_id, "response": None,
                       "error": {"code": code, "message": message}})


def response_line(batch_id: str, idx: int, custom_id: str, status: int, request_id: str | None, body: Any) -> str:
    return json.dumps({"id": row_id(batch_id, idx), "custom_id": custom_id,
                       "response": {"status_code": status, "request_id": request_id, "body": body}, "error": None})


def parse_input(text: str, batch_id: str, endpoints: tuple[str, ...], max_rows: int) -> Parsed:
    """Validate an input file for a job whose rows may go to ``endpoints``."""
    out, seen, objects = Parsed(), set(), 0
    lines = [(i, ln) for i, ln in enumerate(text.splitlines()) if ln.strip()]
    if len(lines) > max_rows:
        out.fatal = f"the file has {len(lines)} requests; a batch holds at most {max_rows} (COHORT_BATCH_MAX_ROWS)"
        return out
    for idx, (i, ln) in enumerate(lines):
        def bad(code: str, message: str, cid: str | None = None, idx: int = idx) -> None:
            out.errors.append({"idx": idx, "custom_id": cid, "line": error_line(batch_id, idx, cid, code, message)})
        try:
            obj = json.loads(ln)
        except ValueError:
            bad("invalid_json", f"line {i + 1} is not valid JSON")
            continue
        if not isinstance(obj, dict):
            bad("invalid_json", f"line {i + 1} is not a JSON object")
            continue
        objects += 1
        cid = obj.get("custom_id")
        if not isinstance(cid, str) or not cid:
            bad("missing_custom_id", f"line {i + 1} has no custom_id (a non-empty string)")
            continue
        if cid in seen:
            bad("duplicate_custom_id", f"line {i + 1} repeats custom_id {cid!r}; each must be unique", cid)
            continue
        seen.add(cid)
        if str(obj.get("method", "POST")).upper() != "POST":
            bad("invalid_method", f"line {i + 1}: method must be POST", cid)
        elif obj.get("url") not in endpoints:
            bad("invalid_url", f"line {i + 1}: url {obj.get('url')!r} is not this batch's endpoint "
                f"({' or '.join(endpoints)})", cid)
        elif not isinstance(obj.get("body"), dict):
            bad("invalid_body", f"line {i + 1}: body must be a JSON object (the request to {obj.get('url')})", cid)
        elif obj["body"].get("stream"):
            bad("invalid_body", f"line {i + 1}: stream is not supported in a batch", cid)
        else:
            out.rows.append({"idx": idx, "custom_id": cid, "body": obj["body"], "url": obj["url"]})
    if not out.rows and not objects:
        out.fatal = "the file is not a batch file: no line is a JSON object {custom_id, method, url, body}"
    return out


# What a row's HTTP answer means for it.
DONE, FAILED, RETRY = "done", "failed", "retry"
TRANSIENT = {429, 499, 500, 502, 503, 504}  # a full queue, a shed row, a lost worker or gateway: send it again


def outcome(resp: httpx.Response) -> tuple[str, Any]:
    """(DONE | FAILED | RETRY, body) of a row's answer."""
    try:
        body = resp.json()
    except ValueError:
        body = {"error": {"message": resp.text[:1000], "type": "server_error", "param": None, "code": None}}
    if resp.status_code == 200:
        return DONE, body
    return (RETRY if resp.status_code in TRANSIENT else FAILED), body
