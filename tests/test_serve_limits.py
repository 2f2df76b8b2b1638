"""The HTTP server's limits under hostile input (issue 38): a body over the size limit (413, by
its Content-Length or counted as it streams), a prompt longer than the context (a 400 found
before the text is tokenized whole), images whose spans cannot fit (refused from their headers,
before any is decoded), half-sent requests (408 and closed by the head and body timeouts, the
connection cap, /health answering), JSON nested past the depth limit (a JSON 400 on every
endpoint that parses a body).

The app runs over a stand-in frontend (no engine: every request here is refused or only
tokenized) with the small preset's byte-level BPE and shared-small's 128-position context."""

from __future__ import annotations

import base64
import json
import socket
import struct
import zlib

import httpx
import pytest

from dsv41.graph.config import load_config
from dsv41.runtime.engine import images as runtime_images
from dsv41.runtime.engine.requests import RequestError
from dsv41.runtime.serving.app import HttpLimits, ServerOptions, ServerThread, create_app
from dsv41.runtime.serving.frontend import BatcherStats
from dsv41.runtime.serving.http_limits import json_depth
from dsv41.runtime.serving.prompts import CHUNK_CHARS
from dsv41.runtime.serving.tokenizer import Tokenizer

MODEL = "small"
LIMITS = HttpLimits(max_body_bytes=1 << 20, max_json_depth=64, header_timeout_s=0.5,
                    body_timeout_s=0.5, max_connections=48)
WAIT_S = 20  # the most a socket waits for the server's answer (a bound, never a timing assert)


class NoEngine:
    """A frontend that takes no request (every request in this file stops before it)."""

    def submit(self, prompt_ids, params, images=()):
        raise AssertionError("no request here reaches the frontend")

    def stats(self) -> BatcherStats:
        return BatcherStats(0, 0, 0, 0, 0, 0, {})


@pytest.fixture(scope="module")
def tok(small_case):
    return Tokenizer.for_model(load_config(small_case.checkpoint), small_case.checkpoint)


@pytest.fixture(scope="module")
def served(tok):
    opts = ServerOptions(model_name=MODEL, vocab_size=512, max_seq_len=128, limits=LIMITS)
    with ServerThread(create_app(NoEngine(), tok, opts), limits=LIMITS) as srv:
        yield srv.url


def error_of(r: httpx.Response) -> tuple[int, str, str | None]:
    body = r.json()["error"]
    return r.status_code, body["message"], body["code"]


# ---- 1. the body's size --------------------------------------------------------------------------


def test_a_body_over_the_limit_is_413_by_its_length_or_as_it_streams(served):
    too_big = b'{"model": "small", "prompt": "' + b"a" * LIMITS.max_body_bytes + b'"}'
    want = (413, "The request body is larger than the server's limit of 1,048,576 bytes.",
            "request_too_large")
    r = httpx.post(served + "/v1/completions", content=too_big, timeout=WAIT_S)
    assert error_of(r) == want and r.headers["connection"] == "close"

    def chunks():  # no Content-Length: chunked transfer encoding, counted as it arrives
        for i in range(0, len(too_big), 1 << 16):
            yield too_big[i:i + (1 << 16)]

    r = httpx.post(served + "/tokenize", content=chunks(), timeout=WAIT_S)
    assert error_of(r) == want
    # a body at the limit is read and parsed (its prompt is then too long: a 400, not a 413)
    at_limit = b'{"prompt": "' + b"a" * (LIMITS.max_body_bytes - 14) + b'"}'
    assert len(at_limit) == LIMITS.max_body_bytes
    assert httpx.post(served + "/tokenize", content=at_limit, timeout=WAIT_S).status_code == 400
    assert httpx.get(served + "/health").json() == {"status": "ok"}


# ---- 2. a prompt longer than the context ---------------------------------------------------------


@pytest.fixture
def encoded_lengths(monkeypatch):
    """The longest text the tokenizer was asked to encode."""
    seen = [0]
    for name in ("encode", "encode_text"):
        orig = getattr(Tokenizer, name)

        def spy(self, text, orig=orig):
            seen[0] = max(seen[0], len(text))
            return orig(self, text)

        monkeypatch.setattr(Tokenizer, name, spy)
    return seen


def test_a_prompt_longer_than_the_context_is_refused_before_it_is_tokenized(served, tok,
                                                                              encoded_lengths):
    text = "hello world " * 80_000  # ~1 MB, ~160,000 tokens of the small BPE
    want = ("is longer than the model's context: it has more than 127 tokens, and the model's "
            "max_seq_len is 128 (one position is left to generate).")
    for path, body, what in [
        ("/v1/completions", {"model": MODEL, "prompt": text}, "The prompt"),
        ("/tokenize", {"prompt": text}, "The prompt"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [
            {"role": "system", "content": "be brief"}, {"role": "user", "content": text}]},
         "The chat"),
        ("/tokenize", {"messages": [{"role": "user", "content": text}]}, "The chat"),
    ]:
        r = httpx.post(served + path, json=body, timeout=WAIT_S)
        assert r.status_code == 400 and r.json()["error"]["message"] == f"{what} {want}", path
    assert encoded_lengths[0] <= CHUNK_CHARS  # measured chunk by chunk, never tokenized whole
    # one run of letters without a space: bounded by its bytes, not tokenized at all
    r = httpx.post(served + "/tokenize", json={"prompt": "x" * 200_000}, timeout=WAIT_S)
    assert r.status_code == 400 and r.json()["error"]["message"] == f"The prompt {want}"
    assert encoded_lengths[0] <= CHUNK_CHARS
    # a prompt that fits is tokenized as before
    r = httpx.post(served + "/tokenize", json={"prompt": "hello world"}, timeout=WAIT_S)
    assert r.status_code == 200 and r.json()["tokens"] == [0] + tok.encode("hello world")


# ---- 3. images whose spans cannot fit ------------------------------------------------------------


def png_header(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height (its pixel data is not there: decoding it
    fails, reading its size does not)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b""))
            + chunk(b"IEND", b""))


def test_image_spans_are_checked_from_their_headers_before_any_decode(vmodel, monkeypatch):
    """Eight 8192 x 8192 images (exactly at the pixel cap): their spans (planned from the
    headers) cannot fit shared-vision-small's 256 positions, so none is decoded."""
    decoded = []
    monkeypatch.setattr(runtime_images, "prepare", lambda model, im: decoded.append(im))
    a = vmodel.args
    at_cap = png_header(8192, 8192)
    uri = "data:image/png;base64," + base64.b64encode(at_cap).decode()
    assert runtime_images.data_uri_image(uri) == at_cap  # the header is within the cap
    ids = [0, 5] + [a.image_token_id] * 8 + [7]
    with pytest.raises(RequestError) as e:
        runtime_images.expand_placeholders(vmodel, ids, [at_cap] * 8)
    span = runtime_images.plan_image_grid(8192, 8192, a).span_length
    assert str(e.value) == (f"The prompt with its 8 image span(s) takes {3 + 8 * span} "
                            "positions, leaving no room to generate within the model's "
                            "max_seq_len of 256.")
    assert decoded == []
    # the same as a data URL, and one image past the pixel cap, refused from its header too
    with pytest.raises(RequestError, match="8 image span"):
        runtime_images.expand_placeholders(vmodel, ids, [uri] * 8)
    with pytest.raises(RequestError, match="9000 x 8000 pixels; at most 67,108,864"):
        runtime_images.expand_placeholders(vmodel, [0, a.image_token_id],
                                           [png_header(9000, 8000)])
    assert decoded == []
    over = "data:image/png;base64," + base64.b64encode(png_header(9000, 8000)).decode()
    with pytest.raises(RequestError, match="9000 x 8000 pixels; at most 67,108,864"):
        runtime_images.data_uri_image(over)


# ---- 4. half-sent requests -----------------------------------------------------------------------


def answer_of(s: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection."""
    s.settimeout(WAIT_S)
    out = b""
    while chunk := s.recv(65536):
        out += chunk
    return out


def test_half_sent_requests_are_timed_out_and_health_answers(served):
    host, port = served.removeprefix("http://").split(":")
    heads, bodies = [], []
    for _ in range(10):  # a request line and half the headers, never ended
        s = socket.create_connection((host, int(port)))
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Ty")
        heads.append(s)
    for _ in range(10):  # a whole head, then 10 of the 100 bytes its body claims
        s = socket.create_connection((host, int(port)))
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                  b"\r\nContent-Length: 100\r\n\r\n{\"model\": ")
        bodies.append(s)
    assert httpx.get(served + "/health", timeout=WAIT_S).json() == {"status": "ok"}
    for s in heads:
        got = answer_of(s)
        assert got.startswith(b"HTTP/1.1 408 Request Timeout\r\n")
        assert json.loads(got.split(b"\r\n\r\n", 1)[1])["error"]["message"] == (
            "The request's headers did not arrive within 0.5 s.")
        s.close()
    for s in bodies:
        got = answer_of(s)
        assert got.startswith(b"HTTP/1.1 408 ")
        assert json.loads(got.split(b"\r\n\r\n", 1)[1])["error"]["message"] == (
            "The request body did not arrive within 0.5 s of its headers.")
        s.close()
    # a kept-alive connection that starts its next request and stalls is closed the same way
    with socket.create_connection((host, int(port))) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\nGET /hea")
        got = answer_of(s)
        assert got.startswith(b"HTTP/1.1 200 OK") and b"HTTP/1.1 408 Request Timeout" in got
    assert httpx.get(served + "/health", timeout=WAIT_S).json() == {"status": "ok"}


def test_connections_past_the_cap_are_closed_at_once(served):
    host, port = served.removeprefix("http://").split(":")
    held = [socket.create_connection((host, int(port))) for _ in range(LIMITS.max_connections)]
    try:
        extra = socket.create_connection((host, int(port)))
        assert answer_of(extra) == b""  # closed as it opened: no file held for it
        extra.close()
    finally:
        for s in held:
            s.close()
    assert httpx.get(served + "/health", timeout=WAIT_S).json() == {"status": "ok"}


# ---- 5. nesting --------------------------------------------------------------------------------


def test_deep_nesting_is_a_json_400_on_every_endpoint(served):
    deep = b"[" * 200_000
    for path in ("/v1/chat/completions", "/v1/completions", "/tokenize"):
        r = httpx.post(served + path, content=deep, timeout=WAIT_S)
        assert error_of(r) == (400, "The request body nests arrays and objects 200000 deep; "
                               "the limit is 64.", None), path
    # at the limit it is parsed (and refused for what it is, not for its depth)
    nested: object = "x"
    for _ in range(63):
        nested = [nested]
    r = httpx.post(served + "/tokenize", json={"prompt": nested}, timeout=WAIT_S)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


def test_json_depth_counts_brackets_outside_strings_only():
    assert json_depth('{"a": [1, {"b": "[[[{{{"}], "c": "\\"[["}') == 3
    assert json_depth('"[[[') == 0 and json_depth("[[[") == 3 and json_depth("") == 0
    assert json_depth('[["\\\\"], [[]]]') == 3
