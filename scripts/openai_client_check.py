"""Drive a running `dsv41 serve` with the `openai` client as a user would, and print what it
answered (one JSON object): text in English, Chinese and emoji (chat and completions, streamed
and not), `reasoning_content` in thinking mode only, the effort line as `/tokenize` shows it,
`tool_choice` required / named / none over seeded sampled requests, malformed tools.

    dsv41 serve &                                  # the default: the small preset, CPU
    python scripts/openai_client_check.py --base-url http://127.0.0.1:8000 --requests 50

Every count is printed; the exit status is 1 when any check failed.
"""

from __future__ import annotations

import argparse
import json
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai

TEXTS = ("Write the number 0 in words, then stop.", "用中文写数字零，然后停下。",
         "Emoji 👩‍👩‍👧‍👦🇯🇵 and accents: café, naïve.")
CLOCK = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a zone.",
    "parameters": {"type": "object", "properties": {
        "zone": {"type": "string", "enum": ["UTC", "CET"]}, "precise": {"type": "boolean"}},
        "required": ["zone"]}}}
MSGS = [{"role": "user", "content": "What time is it?"}]
THINK = {"chat_template_kwargs": {"thinking": True}}


def text_checks(c: openai.OpenAI, model: str) -> dict:
    out = {}
    for i, text in enumerate(TEXTS):
        msgs = [{"role": "user", "content": text}]
        r = c.chat.completions.create(model=model, messages=msgs, max_tokens=8)
        s = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
            model=model, messages=msgs, max_tokens=8, stream=True) if ch.choices)
        p = c.completions.create(model=model, prompt=text, max_tokens=8)
        ps = "".join(ch.choices[0].text for ch in c.completions.create(
            model=model, prompt=text, max_tokens=8, stream=True) if ch.choices)
        out[f"text{i}"] = {"chat": r.choices[0].finish_reason, "chat_stream_chars": len(s),
                           "completion": p.choices[0].finish_reason,
                           "completion_stream_chars": len(ps),
                           "prompt_tokens": r.usage.prompt_tokens}
    return out


def reasoning_checks(c: openai.OpenAI, model: str) -> dict:
    think = c.chat.completions.create(model=model, messages=MSGS, max_tokens=16,
                                      extra_body=THINK)
    streamed = [(ch.choices[0].delta.model_extra or {}).get("reasoning_content")
                for ch in c.chat.completions.create(model=model, messages=MSGS, max_tokens=16,
                                                    extra_body=THINK, stream=True)
                if ch.choices]
    chat = c.chat.completions.create(model=model, messages=MSGS, max_tokens=16)
    return {"thinking_has_reasoning": bool(think.choices[0].message.model_extra
                                           .get("reasoning_content")),
            "thinking_stream_has_reasoning": any(streamed),
            "chat_has_reasoning": "reasoning_content" in (chat.choices[0].message.model_extra
                                                          or {})}


def effort_lines(base_url: str) -> dict:
    out = {}
    for effort in ("low", "high", "max", None):
        body = {"messages": MSGS, **THINK}
        if effort is not None:
            body["reasoning_effort"] = effort
        prompt = httpx.post(f"{base_url}/tokenize", json=body, timeout=60).json()["prompt"]
        line = next((ln for ln in prompt.split("\n") if "Reasoning Effort" in ln), None)
        out[effort or "default"] = line
    return out


def tool_choice_checks(c: openai.OpenAI, model: str, n: int) -> dict:
    def one(seed: int, choice, parallel: bool):
        r = c.chat.completions.create(model=model, messages=MSGS, tools=[CLOCK],
                                      tool_choice=choice, temperature=1.0, seed=seed,
                                      parallel_tool_calls=parallel,
                                      max_tokens=260)  # the small BPE spells a call in ~150
        m = r.choices[0]
        calls = m.message.tool_calls or []
        good = [x for x in calls if x.function.name == "get_time"
                and json.loads(x.function.arguments).get("zone") in ("UTC", "CET")]
        return m.finish_reason, len(calls), len(good)

    out = {}
    named = {"type": "function", "function": {"name": "get_time"}}
    # one call per reply (parallel off): a reply ends after its call. With parallel calls on,
    # random weights may go on calling until max_tokens cuts the block (reported apart).
    for label, choice, parallel in (("required", "required", False), ("named", named, False),
                                    ("none", "none", False),
                                    ("required_parallel", "required", True)):
        with ThreadPoolExecutor(8) as pool:
            res = list(pool.map(lambda s, ch=choice, p=parallel: one(s, ch, p), range(n)))
        out[label] = {"requests": n,
                      "with_a_well_formed_call": sum(1 for _, k, g in res if k and g == k),
                      "with_any_call": sum(1 for _, k, _ in res if k),
                      "finish_reasons": sorted({f for f, _, _ in res})}
    return out


def malformed_tools(c: openai.OpenAI, model: str) -> dict:
    bad = {"no name": {"type": "function", "function": {"parameters": {"type": "object"}}},
           "bad schema": {"type": "function", "function": {"name": "f",
                                                           "parameters": {"type": "objekt"}}}}
    out = {}
    for label, tool in bad.items():
        try:
            c.chat.completions.create(model=model, messages=MSGS, tools=[tool], max_tokens=2)
            out[label] = "accepted"
        except openai.BadRequestError as e:
            out[label] = f"400: {e.body.get('message', '')[:80]}"
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--requests", type=int, default=50, help="sampled requests per tool_choice")
    args = ap.parse_args(argv)
    c = openai.OpenAI(base_url=args.base_url + "/v1", api_key="unused", max_retries=0,
                      timeout=600)
    model = c.models.list().data[0].id
    report = {"model": model, "text": text_checks(c, model),
              "reasoning": reasoning_checks(c, model), "effort": effort_lines(args.base_url),
              "tool_choice": tool_choice_checks(c, model, args.requests),
              "malformed_tools": malformed_tools(c, model)}
    print(json.dumps(report, indent=1, ensure_ascii=False))
    tc, rs = report["tool_choice"], report["reasoning"]
    ok = (tc["required"]["with_a_well_formed_call"] == args.requests
          and tc["named"]["with_a_well_formed_call"] == args.requests
          and tc["none"]["with_any_call"] == 0
          and rs["thinking_has_reasoning"] and rs["thinking_stream_has_reasoning"]
          and not rs["chat_has_reasoning"]
          and all(v.startswith("400") for v in report["malformed_tools"].values()))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
