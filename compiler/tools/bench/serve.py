"""`dsv41 bench serve`: the HTTP server under 1, 4, 16 concurrent streaming clients.

Each client sends `--requests` streaming completions one after another (a seeded random prompt
of `--prompt-tokens` ids per request, greedy, `ignore_eos`, `--max-tokens` tokens, so every
request generates the same count) and times them from its side of the socket: time to the first
token (TTFT) and the gaps between tokens. Per client count: aggregate completion tokens per
second (all tokens over the wall time of the round), TTFT p50 / p99, gap p50 / p99.

The long-prompt row: `--long-streams` clients decode (long max_tokens); once each has its first
token, one request with a `--long-prompt-tokens` prompt arrives. The gaps the decoding streams
see while it is prefilled (from its arrival to its first token) against their other gaps:
with prefill chunks interleaved with decode steps, the largest gap is about one chunk's prefill
plus one decode step, not the whole prompt's prefill.

The structured-output row: per `--structured-clients` count, the same round with every request
a `json_schema` (strict) one against plain ones (no response_format): the grammar's cost as
aggregate tokens per second and the gap between tokens, each side measured in turn on the same
server. A JSON reply ends when its JSON is whole (EOS), so its requests may generate fewer
tokens than the plain ones (`ignore_eos`): compare the rates, not the counts.

The client is the standard library's http.client (no extra dependency); SSE lines are parsed as
they arrive.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from dsv41.compiler.tools.assets import COMPILING
from dsv41.compiler.tools.bench.measure import write_json
from dsv41.runtime.serving.app import ServerOptions, ServerThread, create_app
from dsv41.runtime.serving.assembly import ServingOptions, make_batcher, serving_engine
from dsv41.runtime.serving.stall import measure_long_prompt_stall


@dataclass(frozen=True)
class ServeBenchOptions:
    clients: tuple[int, ...] = (1, 4, 16)
    requests: int = 2  # per client, one after another
    prompt_tokens: int = 32
    max_tokens: int = 32
    long_streams: int = 8  # 0: no long-prompt row
    long_prompt_tokens: int = 512
    long_max_tokens: int = 48
    seed: int = 0
    structured_clients: tuple[int, ...] = (1, 8)  # (): no structured-output row

    def validate(self, max_seq_len: int) -> ServeBenchOptions:
        if not self.clients or any(c < 1 for c in self.clients):
            raise ValueError(f"--clients must be counts >= 1, got {self.clients}.")
        if any(c < 1 for c in self.structured_clients):
            raise ValueError(f"--structured-clients must be counts >= 1, got "
                             f"{self.structured_clients}.")
        for name in ("requests", "prompt_tokens", "max_tokens", "long_prompt_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1.")
        if self.long_max_tokens < 4:
            raise ValueError("--long-max-tokens must be at least 4 (the streams decode while "
                             "the long prompt arrives).")
        if self.long_streams < 0:
            raise ValueError("--long-streams must be 0 or more.")
        for total, what in ((self.prompt_tokens + self.max_tokens, "--prompt-tokens + "
                             "--max-tokens"), (self.long_prompt_tokens + self.max_tokens,
                                               "--long-prompt-tokens + --max-tokens"),
                            (self.prompt_tokens + self.long_max_tokens,
                             "--prompt-tokens + --long-max-tokens")):
            if total > max_seq_len:
                raise ValueError(f"{what} is {total}, past the model's max_seq_len "
                                 f"{max_seq_len}.")
        return self


@dataclass
class RequestTrace:
    sent: float  # perf_counter at the request
    token_times: list[float] = field(default_factory=list)  # perf_counter at each token's chunk
    tokens: int = 0  # usage.completion_tokens

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.sent

    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:], strict=False)]


def _percentile(xs: Sequence[float], q: float) -> float | None:
    return float(np.percentile(np.asarray(xs), q)) if xs else None


def stream_completion(host: str, port: int, body: dict, trace: RequestTrace,
                      on_token=None) -> RequestTrace:
    """One streaming completion; every chunk with text is a token (`logprobs: 0` makes each
    token its own chunk even while text is held back)."""
    conn = http.client.HTTPConnection(host, port, timeout=600)
    try:
        conn.request("POST", "/v1/completions", json.dumps(body),
                     {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"The server answered {resp.status}: {resp.read()[:300]!r}")
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"The stream failed: {chunk['error']['message']}")
            if chunk.get("usage"):
                trace.tokens = chunk["usage"]["completion_tokens"]
            for c in chunk.get("choices", ()):
                lp = c.get("logprobs")
                if lp and lp.get("tokens"):
                    trace.token_times.append(time.perf_counter())
                    if on_token is not None:
                        on_token(trace)
    finally:
        conn.close()
    return trace


def _body(model: str, prompt: list[int], max_tokens: int) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "logprobs": 0,
            "stream_options": {"include_usage": True}}


# the structured-output row's schema: nested object, array, enum, bounded number, required
BENCH_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "kind": {"enum": ["file", "dir", "link"]},
        "size": {"type": "integer", "minimum": 0, "maximum": 1000000},
        "tags": {"type": "array", "items": {"type": "string"}},
        "owner": {"type": "object", "properties": {"id": {"type": "integer"}},
                  "required": ["id"], "additionalProperties": False},
    },
    "required": ["name", "kind", "size", "tags", "owner"],
    "additionalProperties": False,
}


def json_schema_body(body: dict) -> dict:
    """`body` as a strict json_schema request (a JSON reply ends with EOS: no ignore_eos)."""
    out = {k: v for k, v in body.items() if k != "ignore_eos"}
    out["response_format"] = {"type": "json_schema", "json_schema": {
        "name": "entry", "strict": True, "schema": BENCH_SCHEMA}}
    return out


@dataclass(frozen=True)
class ClientsRow:
    clients: int
    requests: int
    completion_tokens: int
    wall_s: float
    tokens_per_s: float  # aggregate: every client's tokens over the round's wall time
    ttft_p50_s: float
    ttft_p99_s: float
    gap_p50_s: float | None  # between consecutive tokens of one stream
    gap_p99_s: float | None


def clients_round(host: str, port: int, model: str, n: int, opts: ServeBenchOptions,
                  vocab_size: int, rng: np.random.Generator,
                  shape: Callable[[dict], dict] | None = None) -> ClientsRow:
    """`n` clients, `opts.requests` requests each; `shape`: each request's body made into
    another (the structured row's json_schema requests)."""
    prompts = [[int(x) for x in rng.integers(3, vocab_size, opts.prompt_tokens)]
               for _ in range(n * opts.requests)]
    traces: list[RequestTrace] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def client(k: int) -> None:
        try:
            for r in range(opts.requests):
                body = _body(model, prompts[k * opts.requests + r], opts.max_tokens)
                t = stream_completion(host, port, body if shape is None else shape(body),
                                      RequestTrace(time.perf_counter()))
                with lock:
                    traces.append(t)
        except BaseException as e:  # reported after the round
            errors.append(e)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(k,)) for k in range(n)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    wall = time.perf_counter() - t0
    if errors:
        raise RuntimeError(f"{len(errors)} of {n} clients failed: {errors[0]}")
    tokens = sum(t.tokens for t in traces)
    ttfts = [t.ttft for t in traces]
    gaps = [g for t in traces for g in t.gaps()]
    return ClientsRow(n, len(traces), tokens, wall, tokens / wall, _percentile(ttfts, 50),
                      _percentile(ttfts, 99), _percentile(gaps, 50), _percentile(gaps, 99))


@dataclass(frozen=True)
class StructuredRow:
    """The same round plain and with every request a strict json_schema one."""

    clients: int
    plain_tokens_per_s: float
    json_schema_tokens_per_s: float
    plain_gap_p50_s: float | None
    json_schema_gap_p50_s: float | None
    plain_completion_tokens: int
    json_schema_completion_tokens: int
    tokens_per_s_ratio: float  # json_schema / plain (below 1: the grammar's cost)


def structured_round(host: str, port: int, model: str, n: int, opts: ServeBenchOptions,
                     vocab_size: int, rng: np.random.Generator) -> StructuredRow:
    plain = clients_round(host, port, model, n, opts, vocab_size, rng)
    js = clients_round(host, port, model, n, opts, vocab_size, rng, shape=json_schema_body)
    return StructuredRow(n, plain.tokens_per_s, js.tokens_per_s, plain.gap_p50_s,
                         js.gap_p50_s, plain.completion_tokens, js.completion_tokens,
                         js.tokens_per_s / plain.tokens_per_s if plain.tokens_per_s else 0.0)


@dataclass(frozen=True)
class LongPromptRow:
    streams: int
    long_prompt_tokens: int
    long_ttft_s: float  # the long request's own time to first token
    gap_outside_p50_s: float  # the decoding streams' gaps outside its prefill (before, after)
    gap_during_max_s: float  # their largest gap while it was prefilled
    gap_during_p50_s: float
    gaps_during: int  # how many gaps fell in that interval


def long_prompt_round(host: str, port: int, model: str, opts: ServeBenchOptions,
                      vocab_size: int, rng: np.random.Generator) -> LongPromptRow:
    n = opts.long_streams
    decoding = threading.Condition()  # counts the streams past their second token
    ready = [0]
    traces = [RequestTrace(0.0) for _ in range(n)]
    prompts = [[int(x) for x in rng.integers(3, vocab_size, opts.prompt_tokens)] for _ in range(n)]
    errors: list[BaseException] = []

    def second(trace: RequestTrace) -> None:
        # never blocks: a client that stopped reading would see its tokens late, in a burst
        if len(trace.token_times) == 2:  # two tokens: decoding, past its own prefill
            with decoding:
                ready[0] += 1
                decoding.notify_all()

    def client(k: int) -> None:
        try:
            traces[k].sent = time.perf_counter()
            stream_completion(host, port, _body(model, prompts[k], opts.long_max_tokens), traces[k],
                              on_token=second)
        except BaseException as e:
            errors.append(e)
        finally:
            with decoding:
                decoding.notify_all()

    threads = [threading.Thread(target=client, args=(k,)) for k in range(n)]
    for th in threads:
        th.start()
    with decoding:
        if not decoding.wait_for(lambda: ready[0] == n or bool(errors), timeout=600):
            raise RuntimeError(f"Only {ready[0]} of {n} streams were decoding after 600 s.")
    if errors:
        for th in threads:
            th.join()
        raise RuntimeError(f"{len(errors)} decoding streams failed: {errors[0]}")
    long_prompt = [int(x) for x in rng.integers(3, vocab_size, opts.long_prompt_tokens)]
    long = stream_completion(host, port, _body(model, long_prompt, 2),
                             RequestTrace(time.perf_counter()))
    for th in threads:
        th.join()
    if errors:
        raise RuntimeError(f"{len(errors)} decoding streams failed: {errors[0]}")
    lo, hi = long.sent, long.token_times[0]
    outside, during = [], []
    for t in traces:
        for a, b in zip(t.token_times, t.token_times[1:], strict=False):
            (during if b > lo and a < hi else outside).append(b - a)
    return LongPromptRow(n, opts.long_prompt_tokens, long.ttft, _percentile(outside, 50) or 0.0,
                         max(during) if during else 0.0, _percentile(during, 50) or 0.0,
                         len(during))


def run_serve_bench(host: str, port: int, model: str, opts: ServeBenchOptions, *,
                    vocab_size: int, progress=print) -> dict:
    """Every row, as the JSON `dsv41 bench serve --json` writes."""
    rng = np.random.default_rng(opts.seed)
    # one warm-up request: the first call of each compiled entry loads it
    stream_completion(host, port, _body(model, [5, 6, 7], 2), RequestTrace(time.perf_counter()))
    rows = []
    for n in opts.clients:
        row = clients_round(host, port, model, n, opts, vocab_size, rng)
        progress(f"  {n:3d} clients: {row.tokens_per_s:8.1f} tok/s aggregate, TTFT p50 "
                 f"{row.ttft_p50_s * 1e3:8.1f} ms p99 {row.ttft_p99_s * 1e3:8.1f} ms, gap p50 "
                 f"{(row.gap_p50_s or 0) * 1e3:7.1f} ms ({row.requests} requests, "
                 f"{row.completion_tokens} tokens in {row.wall_s:.1f} s)")
        rows.append(asdict(row))
    out = {"clients": rows, "options": asdict(opts), "model": model}
    if opts.structured_clients:
        out["structured"] = []
        for n in opts.structured_clients:
            sr = structured_round(host, port, model, n, opts, vocab_size, rng)
            progress(f"  {n:3d} clients json_schema: {sr.json_schema_tokens_per_s:8.1f} tok/s "
                     f"against {sr.plain_tokens_per_s:8.1f} plain (x{sr.tokens_per_s_ratio:.2f}),"
                     f" gap p50 {(sr.json_schema_gap_p50_s or 0) * 1e3:.1f} ms against "
                     f"{(sr.plain_gap_p50_s or 0) * 1e3:.1f} ms")
            out["structured"].append(asdict(sr))
    if opts.long_streams:
        lr = long_prompt_round(host, port, model, opts, vocab_size, rng)
        progress(f"  long prompt ({lr.long_prompt_tokens} tokens) while {lr.streams} streams "
                 f"decode: their gap p50 {lr.gap_outside_p50_s * 1e3:.1f} ms outside, max "
                 f"{lr.gap_during_max_s * 1e3:.1f} ms (p50 {lr.gap_during_p50_s * 1e3:.1f} ms) "
                 f"during its prefill (TTFT {lr.long_ttft_s * 1e3:.0f} ms)")
        out["long_prompt"] = asdict(lr)
    return out



# ---- `dsv41 bench serve` ------------------------------------------------------------------------

ENGINE_STALL_CHUNK = 128  # the engine-side stall row's prefill chunk without --prefill-chunk


@dataclass(frozen=True)
class BenchServeOptions:
    """`dsv41 bench serve`: the engine and batcher it serves, the clients' rounds, the JSON."""

    serving: ServingOptions = ServingOptions()
    bench: ServeBenchOptions = ServeBenchOptions()
    json: Path | None = None


def run_command(opts: BenchServeOptions) -> int:
    """The server on a local port under the client rounds, then the long prompt's stall seen
    from the engine's side (no HTTP); prints the rows, writes {"serve": ...} to the JSON."""

    sv = opts.serving
    se = serving_engine(sv, COMPILING)
    args = se.engine.model.args
    batcher = None
    try:
        bench = opts.bench.validate(args.max_seq_len)
        if max((*bench.clients, *bench.structured_clients, bench.long_streams + 1)) > \
                sv.max_running + sv.max_queue:
            raise ValueError("--max-running + --max-queue must hold every client at once.")
        # both long-prompt rows (over HTTP, and the engine's own) prefill in chunks of this size
        chunk = sv.prefill_chunk or ENGINE_STALL_CHUNK
        batcher = make_batcher(sv, se, chunk)
        batcher.start()
        app = create_app(batcher, se.tokenizer, ServerOptions(
            model_name=se.model_name, vocab_size=args.vocab_size, max_seq_len=args.max_seq_len))
        print(f"bench serve: {se.model_name!r} ({se.backend}), --max-running "
              f"{sv.max_running}; noisy when other work shares the machine")
        t0 = time.time()
        with ServerThread(app) as server:
            result = run_serve_bench(server.host, server.port, se.model_name, bench,
                                     vocab_size=args.vocab_size)
        batcher.stop()
        batcher = None
        if bench.long_streams:  # the same stall measured on the engine's side, no HTTP
            stall = measure_long_prompt_stall(
                se.engine, streams=bench.long_streams, stream_prompt=bench.prompt_tokens,
                stream_tokens=bench.long_max_tokens, long_prompt=bench.long_prompt_tokens,
                chunk_tokens=chunk, seed=sv.seed)
            result["long_prompt_engine"] = stall.to_dict()
            print(f"  engine side: worst gap {stall.worst_gap_s * 1e3:.1f} ms during the "
                  f"{stall.chunks}-chunk prefill ({stall.chunk_tokens} tokens a chunk, "
                  f"{stall.chunk_s * 1e3:.1f} ms each), median gap "
                  f"{stall.median_gap_s * 1e3:.1f} ms")
    finally:
        if batcher is not None:
            batcher.stop()
        se.close()
    result.update(backend=se.backend, max_running=sv.max_running,
                  prefill_chunk_tokens=sv.prefill_chunk or ENGINE_STALL_CHUNK)
    if opts.json:
        write_json(opts.json, {"serve": result})
        print(f"json: {opts.json}")
    rows = result["clients"]
    print("summary: " + "; ".join(
        f"{r['clients']} clients {r['tokens_per_s']:.1f} tok/s TTFT p50 "
        f"{r['ttft_p50_s'] * 1e3:.0f} ms p99 {r['ttft_p99_s'] * 1e3:.0f} ms" for r in rows)
        + f" ({time.time() - t0:.0f} s)")
    return 0
