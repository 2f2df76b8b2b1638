"""EPD workers: vision, prefill and decode as separately scaled processes over one Redis server.

    dsv41 serve --role vision  --redis-url redis://host:6379/0 ...   # one or more (images)
    dsv41 serve --role prefill --redis-url redis://host:6379/0 ...   # one or more
    dsv41 serve --role decode  --redis-url redis://host:6379/0 ...   # one or more

A request flows gateway -> [vision ->] prefill -> decode -> gateway. Every worker process is also
a gateway (`EpdGateway`, the OpenAI server's front: any worker's `/v1` takes requests), so
clients may talk to any of them.

- Images: the gateway decodes and prepares each image (`runtime/engine/images.py`: the patches, the
  grid; its span laid out in the prompt), stores it as a record keyed by its content digest
  (`EpdKeys.image`, a TTL) and sends the request to the vision stream; a vision worker runs the
  tower once per image (an image already encoded is not encoded again) and stores its aligned
  rows (`EpdKeys.features`), then passes the request on to the prefill stream. The prefill
  worker splices those rows (features that expired or fail their check are encoded again
  there: never a wrong answer), the decode worker reads the image records for the tiers' keys
  (an image names its span's blocks and snapshots by content). A request whose image record
  is gone ends with an error event.

- The gateway checks the request (as the batcher does), adds it to the prefill stream and reads
  the request's reply stream: token ids with their logprobs, the tier, the finish. Text and
  stop strings are the gateway's (it has the tokenizer); a matched stop string ends the stream
  and sets the request's cancel key, which the decode worker reads between steps.
- A prefill worker takes up to `prefill_requests` requests at once from the prefill stream (a
  consumer group: each request goes to one worker) and prefills them chunk-interleaved on its
  engine (runtime/serving/epd_prefill.py; the tiers: SSD blocks, the shared Redis snapshot
  pool); as each one's prefill ends it samples the first token and sends it; unless that ends
  the request, it hands the finished runtime state over: every complete global block, the
  encoder and decoder rings, the tails and the pointers (`Session.runtime_state`), the first
  token and the sampler's generator, as one `runtime.wire` record (model fingerprint, key,
  sha256) under a hand-off key with a short TTL, and adds the request to the decode stream.
  Then it ends its turn like any turn: the global blocks to its SSD store, the encoder snapshot
  to the pool (what the article persists; the hand-off record is a message, deleted when read).
- A decode worker takes hand-offs while it has free rows, checks each record (fingerprint,
  kind, key, checksum, layout) before use, restores the cache byte for byte (`Engine.adopt`)
  and joins it to its continuous `DecodeBatch`; each step sends every row's token. A hand-off
  that is missing (expired) or fails a check is counted and the request prefilled here from
  the tiers instead (its first token was already sent, the same one: never a wrong answer).

Faults (nothing lost, nothing twice, nothing wedged):

- Idempotency: an entry names its request and attempt (`EpdRequest.attempt`); a worker claims
  each (request, attempt, stage) once (`EpdKeys.claim`, SET NX), so an entry delivered twice
  (a redelivery, a retry) is skipped. Each reply event carries its attempt and a sequence number
  (`ReplyEvent`: the prefill worker's first token is 0, the decode worker's tokens 1, 2, ...):
  the gateway delivers each once and in order, drops what it has seen or another attempt's, and
  fails the request on a gap (events lost with a restarted Redis) rather than skip a token.
- Liveness: `EpdKeys.lease(rid)` says where a request is: `queued:<stage>` while it waits in a
  stream, else the consumer name of the worker running it, whose heartbeat thread renews the
  lease (a short TTL) and writes it again after a Redis restart. The gateway reads its
  requests' leases; one gone for longer than its grace means the worker died (or Redis lost
  the queued entry): a request that has no event yet is queued again as its next attempt, any
  other ends with an error that says which.
- Reclaim (issue 42): a worker's entry stays pending in its group while it runs the request
  (a decode row: until the row leaves), and its heartbeats touch it (XCLAIM to itself, JUSTID:
  the idle time starts again). An entry idle for `reclaim_idle_s` (3 s: below the lease's TTL
  plus the gateway's grace) belongs to a dead worker: a live worker of the same stage takes it
  over (XPENDING's idle filter, then XCLAIM with that minimum idle: XAUTOCLAIM without its own
  entries), takes over its claim and lease, and runs it again from the prompt (a decode
  worker: its hand-off was consumed, so it prefills from the tiers and decodes from token 1).
  The gateway drops the events it delivered already, checking each token equals the one
  delivered (a greedy or seeded request runs again the same; a different token ends the
  request with an error, never a changed or doubled response): the client gets one complete,
  unduplicated response. With no live worker of the stage, the lease lapses as before.
- Routing (issue 42): the prefill worker sends each hand-off to one decode worker (the entry's
  `to`; `choose_decoder`): among the live ones (a heartbeat key within its lease), the one that
  took the longest run of the prompt's leading blocks (`EpdKeys.locality`: a session's next
  turn extends its prompt, so its blocks name the worker of its last turn), else the least
  loaded (`EpdKeys.load`), ties by name. A decode worker that reads another live worker's entry
  moves it into that worker's pending entries (XCLAIM), which that worker reads as its own.
- A Redis restart without persistence deletes the consumer groups: a worker whose read answers
  NOGROUP makes its group again (`ensure_group`) and carries on.

Why Redis streams: the pool's server is already there; a consumer group hands each entry to
exactly one of the workers reading it (start more processes of a stage to scale it), keeps a
per-group lag (the queue length `/metrics` shows) and acknowledgements; a reply stream per
request keeps its events in order for a reader that resumes from the last id. Lists would need
our own bookkeeping for all three.

All stages of one deployment run the same model, weights, page size and backend: the queues'
names carry the model fingerprint (runtime/engine/salt.py), so stages of another model never meet.

The modules: this one is the stages' common vocabulary (the Redis names, the request that
travels, the reply events); epd_stages.py the workers (vision, prefill with its hand-off,
decode with its adoption) and their /metrics; epd_gateway.py the gateway, a `Frontend` over the
queues.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from enum import StrEnum

import redis

from dsv41.runtime.engine.requests import (
    RequestError,
    TurnLimits,
    TurnRequest,
    check_token_ids,
    check_turn,
)
from dsv41.runtime.engine.sampling import SampledToken, SamplingParams, TokenLogprob
from dsv41.runtime.serving.frontend import FinishReason
from dsv41.runtime.tiers.wire import RecordKind

log = logging.getLogger(__name__)

HANDOFF_KIND = RecordKind.HANDOFF
VISION_GROUP, PREFILL_GROUP, DECODE_GROUP = "vision", "prefill", "decode"
QUEUED = "queued:"  # a lease's value while the request waits in a stream: `queued:<stage>`


class Role(StrEnum):
    """A serving process's part (the strings are `dsv41 serve --role`'s)."""

    VISION = "vision"
    PREFILL = "prefill"
    DECODE = "decode"
    ALL = "all"  # the single-process server (runtime/serving/batcher.py)


@dataclass(frozen=True)
class EpdKeys:
    """The Redis names of one model's deployment (`fingerprint`: the engines' key salt)."""

    fingerprint: bytes

    @property
    def base(self) -> str:
        return f"dsv41:epd:{self.fingerprint.hex()[:32]}"

    @property
    def vision(self) -> str:
        return f"{self.base}:vision"

    @property
    def prefill(self) -> str:
        return f"{self.base}:prefill"

    def image(self, digest: str) -> str:
        return f"{self.base}:image:{digest}"

    def features(self, digest: str) -> str:
        return f"{self.base}:features:{digest}"

    @property
    def decode(self) -> str:
        return f"{self.base}:decode"

    def handoff(self, rid: str) -> str:
        return f"{self.base}:handoff:{rid}"

    def out(self, rid: str) -> str:
        return f"{self.base}:out:{rid}"

    def cancel(self, rid: str) -> str:
        return f"{self.base}:cancel:{rid}"

    def lease(self, rid: str) -> str:
        """Where the request is: `queued:<stage>`, or the consumer running it (a short TTL)."""
        return f"{self.base}:lease:{rid}"

    def claim(self, rid: str, attempt: int, stage: str) -> str:
        """Set once (NX) by the worker that takes this stage of this attempt of the request."""
        return f"{self.base}:claim:{rid}:{attempt}:{stage}"

    def decoder(self, consumer: str) -> str:
        """Set (a short TTL) by each heartbeat of a live decode worker."""
        return f"{self.base}:decoder:{consumer}"

    @property
    def decoders(self) -> str:
        """The set of decode workers' names (live or not: `decoder` says which live)."""
        return f"{self.base}:decoders"

    @property
    def load(self) -> str:
        """A hash: decode worker -> requests routed to it and not yet left (its load)."""
        return f"{self.base}:load"

    def locality(self, block_key: str) -> str:
        """The decode worker that last took a request whose prompt holds this block."""
        return f"{self.base}:prefix:{block_key}"


@dataclass(frozen=True)
class Route:
    """Where a hand-off goes: the decode worker, and whether it was chosen because it holds
    the request's prefix (a prefix hit) rather than by load."""

    consumer: str | None  # None: no live decode worker is known (the shared queue decides)
    prefix_hit: bool = False
    matched_blocks: int = 0  # the prompt's leading blocks that worker took before


def choose_decoder(loads: dict[str, int], holders: list[str | None]) -> Route:
    """Session affinity and prefix locality, load the tie-breaker: the live worker (a key of
    `loads`) that took the longest run of the prompt's leading blocks (`holders[i]`: the worker
    that last took block i; a session's next turn extends its prompt, so its blocks name the
    worker that ran its last turn), else the least loaded (ties: the first name)."""
    for n in range(len(holders), 0, -1):
        h = holders[n - 1]
        if h is not None and h in loads:
            return Route(h, True, n)
    if not loads:
        return Route(None)
    return Route(min(loads, key=lambda c: (loads[c], c)))


def ensure_group(client, stream: str, group: str) -> None:
    """The stream's consumer group, made (with the stream) unless it is there; its new
    readers get every entry the stream holds (a restarted Redis: those queued since)."""
    try:
        client.xgroup_create(stream, group, id="0", mkstream=True)
    except redis.ResponseError as e:  # BUSYGROUP: another worker made it
        if "BUSYGROUP" not in str(e):
            raise


@dataclass(frozen=True)
class EpdRequest:
    """What travels through the queues: a new session's prompt and its sampling."""

    rid: str
    prompt: tuple[int, ...]
    sampling: SamplingParams  # stop strings removed: they are the gateway's
    image_keys: tuple[str, ...] = ()  # each image's content digest (hex): its records' keys
    image_offsets: tuple[int, ...] = ()  # where each image's span starts in `prompt`
    attempt: int = 0  # the gateway queues a lost request again as its next attempt

    def to_json(self) -> str:
        if self.sampling.constraint is not None:
            raise ValueError("The EPD stages do not carry logits constraints (tool_choice "
                             "required, a named function or none with tools); serve such "
                             "requests without EPD.")
        return json.dumps({"rid": self.rid, "prompt": list(self.prompt),
                           "sampling": asdict(self.sampling), "image_keys": list(self.image_keys),
                           "image_offsets": list(self.image_offsets),
                           "attempt": self.attempt})

    @classmethod
    def from_json(cls, text: str | bytes) -> EpdRequest:
        d = json.loads(text)
        s = dict(d["sampling"])
        s["stop"], s["stop_token_ids"] = tuple(s["stop"]), tuple(s["stop_token_ids"])
        s.pop("constraint", None)
        keys = tuple(str(k) for k in d.get("image_keys", ()))
        offsets = tuple(int(o) for o in d.get("image_offsets", ()))
        if len(keys) != len(offsets):
            raise ValueError(f"The request names {len(keys)} images but {len(offsets)} spans.")
        attempt = d.get("attempt", 0)
        if type(attempt) is not int or attempt < 0:
            raise ValueError(f"The request's attempt must be a whole number >= 0, got "
                             f"{attempt!r}.")
        return cls(str(d["rid"]), tuple(int(t) for t in d["prompt"]), SamplingParams(**s),
                   keys, offsets, attempt)

    def turn(self, vocab_size: int, max_seq_len: int) -> TurnRequest:
        """The engine's turn of a new session (RequestError when it does not fit)."""
        ids = check_token_ids(self.prompt, vocab_size=vocab_size, what="the request")
        room = max_seq_len - len(ids)
        if room < 1:
            raise RequestError(f"The prompt's {len(ids)} tokens leave no room to generate "
                               f"within the model's max_seq_len of {max_seq_len}.")
        return check_turn(ids, TurnLimits(vocab_size, max_seq_len, 0), max_new_tokens=room,
                          sampling=self.sampling)


def reply_event(token: SampledToken | None, finish: FinishReason | None, *, seq: int,
                attempt: int, tier: str | None = None, reused: int | None = None,
                error: str | None = None) -> dict:
    """One event of a request's reply stream (the gateway reads it as a `ReplyEvent`): `seq`
    the token's place in the reply (0: the prefill worker's first token), `attempt` the
    request's (`EpdRequest.attempt`)."""
    e: dict = {"q": seq, "a": attempt}
    if token is not None:
        e["t"] = token.token_id
        if token.logprob is not None:
            e["lp"] = token.logprob
            e["top"] = [[x.token_id, x.logprob] for x in token.top]
    if finish is not None:
        e["fin"] = finish.value
    if tier is not None:
        e["tier"], e["reused"] = tier, reused
    if error is not None:
        e["err"] = error
    return {"e": json.dumps(e)}


@dataclass(frozen=True)
class ReplyEvent:
    """One reply-stream event as the gateway reads it (`reply_event` writes it)."""

    seq: int  # the token's place in the reply (an error-only event: the place it would take)
    attempt: int  # the request attempt that sent it
    token: SampledToken | None
    finish: FinishReason | None
    tier: str | None = None  # the prefill's tier and reused tokens (the first token's event)
    reused: int = 0
    error: str | None = None

    @classmethod
    def from_fields(cls, fields: dict) -> ReplyEvent:
        """ValueError (a full sentence) when the entry is not a well-formed event."""
        try:
            raw = fields[b"e"] if b"e" in fields else fields["e"]
            e = json.loads(raw)
            if not isinstance(e, dict):
                raise TypeError("not an object")
            seq, attempt = e["q"], e["a"]
            if type(seq) is not int or type(attempt) is not int or seq < 0 or attempt < 0:
                raise TypeError("its sequence number or attempt is not a whole number >= 0")
            token = None
            if "t" in e:
                lp = e.get("lp")
                token = SampledToken(_whole(e["t"]), None if lp is None else float(lp),
                                     tuple(TokenLogprob(_whole(i), float(x))
                                           for i, x in e.get("top", ())))
            finish = FinishReason(e["fin"]) if "fin" in e else None
            if token is None and finish is None:
                raise TypeError("it has neither a token nor a finish")
            tier = e.get("tier")
            err = e.get("err")
            return cls(seq, attempt, token, finish,
                       None if tier is None else str(tier),
                       _whole(e["reused"]) if tier is not None else 0,
                       None if err is None else str(err))
        except (KeyError, ValueError, TypeError, UnicodeDecodeError) as err:
            raise ValueError(f"The reply event is malformed ({type(err).__name__}: {err}).") \
                from None


def _whole(x) -> int:
    if type(x) is not int:
        raise TypeError(f"{x!r} is not a whole number")
    return x


def parse_entry(fields: dict) -> EpdRequest | None:
    """A queue entry's request; None (logged, dropped) when it is not one."""
    try:
        return EpdRequest.from_json(fields[b"req"])
    except (KeyError, ValueError, TypeError) as e:
        log.error("dropped a queue entry that is not a request: %s", e)
        return None


def finish_of(turn) -> FinishReason | None:
    """Why a stage's turn ended (None while it runs)."""
    if not turn.done:
        return None
    return FinishReason.STOP if turn.tokens[-1] in turn.stop else FinishReason.LENGTH
