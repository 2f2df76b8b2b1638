"""What a client may send the server, and how long it may take, so that no request can exhaust
the server's memory, its open files or its parser's stack (issue 38):

- a request's head (request line and headers) must arrive within `header_timeout_s` of the
  connection opening, or of the previous response ending on a kept-alive connection: otherwise
  the server answers 408 and closes the connection (`protocol_class`, a uvicorn h11 protocol);
- at most `max_connections` connections are open at once: one beyond it is closed as it opens,
  and uvicorn answers 503 to a request beyond it (its `limit_concurrency`), so a flood of
  half-sent requests costs a bounded number of open files and is reclaimed by the timeouts;
- a body holds at most `max_body_bytes` (a Content-Length over it is refused before anything is
  read, a chunked body is counted as it arrives): 413; it must arrive whole within
  `body_timeout_s` of the head: 408 (`BodyLimits`, an ASGI middleware; both close the
  connection);
- a JSON body nests at most `max_json_depth` arrays and objects, checked by a scan of the text
  before it is parsed (`parse_json_body`): 400.

    limits = HttpLimits()                                    # the defaults below
    app = BodyLimits(app, limits, on_reject=...)             # create_app does this
    uvicorn.Server(server_config(app, host, port, limits))   # ServerThread and `dsv41 serve`
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass

import anyio
import numpy as np
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from dsv41.runtime.serving.openai_api import ApiError, ErrorType, bad_request

# a JSON string as the parser reads it, or an unterminated one running to the end (so every
# quote starts a match and the scan stays linear whatever the text)
_STRING = re.compile(r'"(?:[^"\\]++|\\.)*+(?:"|\\?\Z)', re.DOTALL)
_OPEN, _CLOSE = np.frombuffer(b"[{", np.uint8), np.frombuffer(b"]}", np.uint8)


@dataclass(frozen=True)
class HttpLimits:
    # a body's bytes: room for a chat with one image at MAX_IMAGE_BYTES (20 MiB, 26.7 MiB in
    # base64) and its text; a string prompt longer than the context is refused while it is
    # tokenized (prompts.py), not by this limit
    max_body_bytes: int = 32 << 20
    max_json_depth: int = 64  # arrays and objects nested in a body (tools' schemas nest)
    header_timeout_s: float = 10.0  # a request's head, from the connection or the last response
    body_timeout_s: float = 60.0  # a body's last byte, from its head (a large image, a slow link)
    max_connections: int = 1024  # open at once; keep it under the process's open-file limit

    def validate(self) -> HttpLimits:
        if self.max_body_bytes < 1 or self.max_json_depth < 1 or self.max_connections < 1:
            raise ValueError(f"max_body_bytes, max_json_depth and max_connections must be at "
                             f"least 1, got {self.max_body_bytes}, {self.max_json_depth} and "
                             f"{self.max_connections}.")
        if not (self.header_timeout_s > 0 and self.body_timeout_s > 0):
            raise ValueError(f"The header and body timeouts must be positive seconds, got "
                             f"{self.header_timeout_s} and {self.body_timeout_s}.")
        return self


def json_depth(text: str) -> int:
    """How deep arrays and objects nest in `text` (JSON), its strings' brackets not counted;
    linear time, no recursion. For text that is not JSON it is the depth of its valid prefix
    at least, so a parser never recurses deeper than this on it."""
    skeleton = _STRING.sub("", text).encode("utf-8", "surrogatepass")
    a = np.frombuffer(skeleton, np.uint8)
    step = np.isin(a, _OPEN).astype(np.int32) - np.isin(a, _CLOSE).astype(np.int32)
    return int(np.cumsum(step).max(initial=0))


def parse_json_body(raw: bytes, max_depth: int):
    """A request body as JSON: an ApiError 400 when it is not JSON (UTF-8, -16 or -32, as
    `json.loads` reads bytes) or nests deeper than `max_depth`."""
    try:
        text = raw.decode(json.detect_encoding(raw))
    except UnicodeDecodeError as e:
        raise bad_request(f"The request body is not valid JSON: {e}.") from None
    depth = json_depth(text)
    if depth > max_depth:
        raise bad_request(f"The request body nests arrays and objects {depth} deep; the limit "
                          f"is {max_depth}.")
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise bad_request(f"The request body is not valid JSON: {e}.") from None


def _error_response(e: ApiError) -> tuple[dict, bytes]:
    """(the ASGI start message, the body) of an error that ends the connection."""
    body = json.dumps(e.body()).encode()
    return ({"type": "http.response.start", "status": e.status,
             "headers": [(b"content-type", b"application/json"),
                         (b"content-length", str(len(body)).encode()),
                         (b"connection", b"close")]}, body)


def body_too_large(limit: int) -> ApiError:
    return ApiError(413, f"The request body is larger than the server's limit of {limit:,} "
                    "bytes.", code="request_too_large")


def body_timeout(seconds: float) -> ApiError:
    return ApiError(408, f"The request body did not arrive within {seconds:g} s of its "
                    "headers.", type=ErrorType.TIMEOUT, code="request_timeout")


def head_timeout(seconds: float) -> ApiError:
    return ApiError(408, f"The request's headers did not arrive within {seconds:g} s.",
                    type=ErrorType.TIMEOUT, code="request_timeout")


class BodyLimits:
    """ASGI middleware: every HTTP request's body is read here, within the size and time
    limits (413 / 408, the connection closed), then handed to `app` whole; `on_reject(status)`
    counts a refusal (the metrics)."""

    def __init__(self, app, limits: HttpLimits, on_reject: Callable[[int], None] = lambda s: None):
        self.app, self.limits, self.on_reject = app, limits.validate(), on_reject

    async def refuse(self, send, e: ApiError) -> None:
        self.on_reject(e.status)
        start, body = _error_response(e)
        await send(start)
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = self.limits.max_body_bytes
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            return await self.refuse(send, body_too_large(limit))
        chunks, size, more = [], 0, True
        with anyio.move_on_after(self.limits.body_timeout_s) as late:
            while more:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return None  # the client left before its body was whole
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > limit:
                    return await self.refuse(send, body_too_large(limit))
                chunks.append(chunk)
                more = message.get("more_body", False)
        if late.cancelled_caught:
            return await self.refuse(send, body_timeout(self.limits.body_timeout_s))
        whole = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def replay():
            """The body once, then the client's own messages (a disconnect)."""
            return whole.pop() if whole else await receive()

        return await self.app(scope, replay, send)


def protocol_class(limits: HttpLimits) -> type[H11Protocol]:
    """uvicorn's h11 protocol with the head timeout and the connection cap of `limits`."""
    head_s, cap = limits.header_timeout_s, limits.max_connections
    start, body = _error_response(head_timeout(head_s))
    late_answer = (b"HTTP/1.1 408 Request Timeout\r\n"
                   + b"".join(k + b": " + v + b"\r\n" for k, v in start["headers"])
                   + b"\r\n" + body)

    class LimitedH11Protocol(H11Protocol):
        head_timer = None  # the pending head deadline (an asyncio TimerHandle), if any

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            if len(self.connections) > cap:
                transport.close()  # over the cap: its file is freed at once
                return
            self.arm_head_timer()

        def arm_head_timer(self) -> None:
            self.cancel_head_timer()
            self.head_timer = self.loop.call_later(head_s, self.head_late)

        def cancel_head_timer(self) -> None:
            if self.head_timer is not None:
                self.head_timer.cancel()
                self.head_timer = None

        def waiting_for_head(self) -> bool:
            return self.cycle is None or self.cycle.response_complete

        def head_late(self) -> None:
            self.head_timer = None
            if self.waiting_for_head() and not self.transport.is_closing():
                self.transport.write(late_answer)
                self.transport.close()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if not self.waiting_for_head():
                self.cancel_head_timer()  # a request's head arrived: its body is BodyLimits'

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and self.waiting_for_head():
                self.arm_head_timer()

        def connection_lost(self, exc) -> None:
            self.cancel_head_timer()
            super().connection_lost(exc)

    return LimitedH11Protocol


def server_config(app, host: str, port: int, limits: HttpLimits, *,
                  log_level: str = "info", lifespan: str = "auto") -> uvicorn.Config:
    """uvicorn's configuration for `app` under `limits` (ServerThread, `dsv41 serve`)."""
    limits.validate()
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan=lifespan,
                          http=protocol_class(limits), limit_concurrency=limits.max_connections)
