"""A real Prometheus scrapes a live stack: the stack (with a length predictor, so coverage has rows)
and ``prometheus`` with cohort's rules (deploy/prometheus/cohort-rules.yml, evaluated every second)
scraping the gateway's /metrics every second; load through the ``openai`` SDK (a shared system
prompt, so the prefix cache hits; an SLO on each request); then every recording rule and every query
of the Grafana dashboard (deploy/grafana/cohort.json) must return data through Prometheus's HTTP API."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import yaml
from openai import OpenAI

from procstack.stack import free_port, wait_until_ok
from tests.e2e.stack import TestStack
from tests.ops.tools import DASHBOARD, RULES, require_tool

pytestmark = pytest.mark.e2e
MODEL = "cohort-tiny"
SYSTEM = "You are a careful assistant. " * 12  # several full 16-token pages shared by every request


def recording_rules() -> list[str]:
    return [r["record"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"] if "record" in r]


def dashboard_queries() -> list[str]:
    return [t["expr"] for p in json.loads(DASHBOARD.read_text())["panels"] for t in p.get("targets", [])]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    folder = tmp_path_factory.mktemp("prometheus_scrape")
    data = folder / "lengths.jsonl"
    data.write_text("".join(json.dumps({"task": "t", "instruction": "Answer.", "input": f"question {i}",
                                        "output": " ".join(["word"] * (4 + i % 6))}) + "\n" for i in range(30)))
    subprocess.run([sys.executable, "-m", "launch.cli", "predictor", "train", "--kind", "mean", "--data", str(data),
                    "--out", str(folder / "predictor")], check=True, capture_output=True,
                   env={**os.environ, "HF_HUB_OFFLINE": "1"})
    # the online bound from the first completions on (min_rows 1), so the second wave is planned with one
    s = TestStack(folder / "stack", COHORT_SERVED_MODEL_NAME=MODEL, COHORT_PREDICTOR_DIR=str(folder / "predictor"),
                  COHORT_ONLINE__MIN_ROWS="1", COHORT_ONLINE__CLUSTERS="0", COHORT_ONLINE__INTERVAL_S="0.5")
    try:
        s.start()
    except Exception:
        s.stop()
        raise
    yield s
    s.stop()


@pytest.fixture(scope="module")
def prometheus(stack, tmp_path_factory):
    binary = require_tool("prometheus")
    folder = tmp_path_factory.mktemp("prometheus")
    rules = yaml.safe_load(RULES.read_text())
    for g in rules["groups"]:
        g["interval"] = "1s"
    (folder / "rules.yml").write_text(yaml.safe_dump(rules))
    target = stack.url.removeprefix("http://")
    (folder / "prometheus.yml").write_text(yaml.safe_dump({
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(folder / "rules.yml")],
        "scrape_configs": [{"job_name": "cohort", "honor_labels": True,
                            "static_configs": [{"targets": [target]}]}]}))
    port = free_port()
    log = open(folder / "prometheus.log", "wb")
    proc = subprocess.Popen([binary, f"--config.file={folder / 'prometheus.yml'}",
                             f"--storage.tsdb.path={folder / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        assert wait_until_ok(f"{url}/-/ready", 30), (folder / "prometheus.log").read_text()[-2000:]
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def _load(stack, prometheus: str) -> None:
    """Two waves after Prometheus's first scrape (counters must move between scrapes for a rate), the
    second after the predictor service learnt an online bound from the first."""
    client = OpenAI(base_url=f"{stack.url}/v1", api_key="unused", timeout=120, max_retries=0)
    assert wait_until_ok(f"{prometheus}/api/v1/query?query=up", 20,
                         accept=lambda r: bool(r.json()["data"]["result"]))

    def one(i: int) -> None:
        client.chat.completions.create(model=MODEL, max_tokens=48,
                                       messages=[{"role": "system", "content": SYSTEM},
                                                 {"role": "user", "content": f"Question {i}?"}],
                                       extra_body={"slo_seconds": 60, "emulated_tokens": 4 + i % 5})
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(one, range(12)))
        time.sleep(3)
        list(pool.map(one, range(12, 24)))


def _query(url: str, expr: str) -> list:
    r = httpx.get(f"{url}/api/v1/query", params={"query": expr}, timeout=10)
    assert r.status_code == 200, (expr, r.text)
    return r.json()["data"]["result"]


def test_every_recording_rule_and_dashboard_query_has_data(stack, prometheus):
    _load(stack, prometheus)
    queries = list(dict.fromkeys(recording_rules() + dashboard_queries()))
    empty = queries
    deadline = time.time() + 45
    while empty and time.time() < deadline:
        time.sleep(2)
        empty = [q for q in empty if not _query(prometheus, q)]
    targets = httpx.get(f"{prometheus}/api/v1/targets").json()["data"]["activeTargets"]
    assert all(t["health"] == "up" for t in targets), targets
    assert not empty, f"{len(empty)} of {len(queries)} queries returned no data: {empty}"
    print(f"{len(queries)} of {len(queries)} queries returned data")
