"""Fuzz a running `dsv41 serve` over HTTP (issue 38): schemathesis against its /openapi.json,
`--examples` generated cases per operation (valid bodies and mutated ones), then the hostile
inputs of the issue (a body over the limit, a string prompt of tens of MB, 200,000 nested `[`,
half-sent requests): print the cases run, the 5xx answers, the connection errors, and the
server's peak RSS (its VmHWM, when `--pid` names it). Each generated request's `max_tokens` is
capped at `--max-tokens` (and set when absent) so the run is bounded on a CPU.

    dsv41 serve --backend torch --port 8000 &
    python scripts/fuzz_serve.py --base-url http://127.0.0.1:8000 --pid $! --examples 200

The exit status is 1 when any answer was a 5xx or the server stopped answering.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import time
from collections import Counter
from pathlib import Path

import httpx
import schemathesis
from hypothesis import HealthCheck, given, settings


def peak_rss_mb(pid: int | None) -> float | None:
    if pid is None:
        return None
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return None


def capped(body, max_tokens: int):
    if isinstance(body, dict):
        for k in ("max_tokens", "max_completion_tokens"):
            v = body.get(k)
            if isinstance(v, int) and not isinstance(v, bool) and v > max_tokens:
                body[k] = max_tokens
        if "max_tokens" not in body and "max_completion_tokens" not in body:
            body["max_tokens"] = max_tokens
    return body


def schema_fuzz(url: str, examples: int, max_tokens: int, statuses: Counter,
                failures: list) -> None:
    schema = schemathesis.openapi.from_url(url + "/openapi.json")

    def fuzz(op) -> None:
        @settings(max_examples=examples, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(case=op.as_strategy())
        def run(case):
            case.body = capped(case.body, max_tokens)
            try:
                r = case.call(base_url=url, timeout=300)
            except (httpx.HTTPError, OSError) as e:
                statuses["connection error"] += 1
                failures.append((op.path, repr(case.body)[:200], repr(e)))
                return
            statuses[r.status_code] += 1
            if r.status_code >= 500:
                failures.append((op.path, repr(case.body)[:200], r.text[:200]))

        run()

    for result in schema.get_all_operations():
        op = result.ok()
        fuzz(op)
        print(f"{op.method.upper()} {op.path}: done", file=sys.stderr, flush=True)


def hostile(url: str, statuses: Counter, failures: list) -> dict:
    """The issue's inputs; their answers are counted with the rest."""
    out = {}

    def post(path: str, content: bytes, what: str) -> None:
        try:
            r = httpx.post(url + path, content=content, timeout=300,
                           headers={"content-type": "application/json"})
        except httpx.HTTPError as e:
            statuses["connection error"] += 1
            failures.append((path, what, repr(e)))
            return
        statuses[r.status_code] += 1
        out[what] = r.status_code
        if r.status_code >= 500:
            failures.append((path, what, r.text[:200]))

    post("/v1/completions", b'{"model": "x", "prompt": "' + b"a" * (40 << 20) + b'"}',
         "40 MB body")
    prompt = json.dumps({"model": "small", "prompt": "hello world " * 2_500_000}).encode()
    post("/v1/completions", prompt, "30 MB string prompt")
    for path in ("/v1/chat/completions", "/v1/completions", "/tokenize"):
        post(path, b"[" * 200_000, f"200,000 nested [ on {path}")
    host, port = url.removeprefix("http://").split(":")
    socks = []
    for _ in range(200):
        s = socket.create_connection((host, int(port)))
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Le")
        socks.append(s)
    health = httpx.get(url + "/health", timeout=60).status_code
    closed = 0
    for s in socks:
        s.settimeout(120)
        try:
            while s.recv(65536):
                pass
            closed += 1
        except OSError:
            pass
        s.close()
    out["half-sent requests closed by the server"] = f"{closed} of {len(socks)}"
    out["/health while they were open"] = health
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--pid", type=int, default=None, help="the server's pid (its peak RSS)")
    ap.add_argument("--examples", type=int, default=200, help="cases per operation")
    ap.add_argument("--max-tokens", type=int, default=4)
    a = ap.parse_args()
    statuses: Counter = Counter()
    failures: list = []
    t0 = time.monotonic()
    rss0 = peak_rss_mb(a.pid)
    schema_fuzz(a.base_url, a.examples, a.max_tokens, statuses, failures)
    rss_fuzz = peak_rss_mb(a.pid)
    extra = hostile(a.base_url, statuses, failures)
    server_errors = sum(n for s, n in statuses.items() if isinstance(s, int) and s >= 500)
    report = {
        "cases": sum(statuses.values()),
        "statuses": {str(k): v for k, v in sorted(statuses.items(), key=str)},
        "server_errors_5xx": server_errors,
        "connection_errors": statuses["connection error"],
        "hostile": extra,
        "peak_rss_mb": {"before": rss0, "after the schema fuzz": rss_fuzz,
                        "after the hostile inputs": peak_rss_mb(a.pid)},
        "health_after": httpx.get(a.base_url + "/health", timeout=60).status_code,
        "seconds": round(time.monotonic() - t0, 1),
        "failures": failures[:20],
    }
    print(json.dumps(report, indent=1, default=str))
    return 1 if server_errors or statuses["connection error"] or report["health_after"] != 200 \
        else 0


if __name__ == "__main__":
    sys.exit(main())
