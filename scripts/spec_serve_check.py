"""`dsv41 serve --speculative on` against `--speculative off` through the `openai` client: the
same greedy text for the same requests, and the speculating server's /metrics counts of drafted
and accepted tokens (one JSON object; exit status 1 when the texts differ or nothing was
drafted).

    python scripts/spec_serve_check.py --requests 4 --max-tokens 16 -- --backend torch

Arguments after `--` go to both `dsv41 serve` commands (the preset, backend, artifact, ...).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import httpx
import openai

PROMPTS = ("Write the number 0 in words, then stop.", "用中文写数字零，然后停下。",
           "List three colours.", "Emoji 👩‍👩‍👧‍👦 and accents: café, naïve.")


def _wait(base: str, proc: subprocess.Popen, timeout_s: float) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"dsv41 serve exited with {proc.returncode} before answering.")
        try:
            if httpx.get(f"{base}/v1/models", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError(f"dsv41 serve did not answer within {timeout_s:.0f} s.")


def run_mode(mode: str, port: int, serve_args: list[str], requests: int, max_tokens: int,
             timeout_s: float) -> dict:
    """One server in this mode: each prompt's greedy chat text, then its /metrics."""
    base = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "dsv41.compiler.tools.cli", "serve", "--port", str(port),
           "--speculative", mode, "--log-level", "warning", *serve_args]
    proc = subprocess.Popen(cmd)
    try:
        _wait(base, proc, timeout_s)
        c = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0,
                          timeout=timeout_s)
        model = c.models.list().data[0].id
        texts, usage = [], []
        for i in range(requests):
            r = c.chat.completions.create(
                model=model, messages=[{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
                max_tokens=max_tokens, temperature=0.0)
            texts.append(r.choices[0].message.content)
            usage.append((r.usage.model_extra or {}).get("speculative"))
        metrics = [line for line in httpx.get(f"{base}/metrics", timeout=60).text.splitlines()
                   if line.startswith(("vllm:spec_decode_", "dsv41:spec_"))]
        return {"texts": texts, "usage_speculative": usage, "metrics": metrics}
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    serve_args = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--port", type=int, default=8391)
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per server and call")
    args = p.parse_args(own)
    out = {mode: run_mode(mode, args.port, serve_args, args.requests, args.max_tokens,
                          args.timeout) for mode in ("on", "off")}
    drafted = sum(u["drafted"] for u in out["on"]["usage_speculative"] if u)
    out["same_text"] = out["on"]["texts"] == out["off"]["texts"]
    out["drafted"] = drafted
    print(json.dumps(out, ensure_ascii=False, indent=1))
    return 0 if out["same_text"] and drafted > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
