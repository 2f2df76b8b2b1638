"""The OpenAI API's JSON, in and out: request bodies -> typed requests, events -> response bodies.

    req = parse_chat(body, tok, model_name=..., vocab_size=...)  # ApiError on a bad request
    req.prompt_ids, req.params                                     # what the batcher takes
    chunk = chat_chunk(ids, req, delta={"content": "w3"}, ...)    # one SSE `data:` object

No HTTP here (runtime/serving/app.py and its routers do that), so everything is testable on
plain dicts. A bad field is an `ApiError` carrying OpenAI's error shape: `{"error": {"message",
"type", "param", "code"}}`.

The fields read (others are ignored, as OpenAI's own SDK fields `user`, `metadata` are):
`model` (must be the served one: 404 `model_not_found` otherwise), `messages` / `prompt`,
`stream`, `stream_options.include_usage`, `temperature` (default 1), `top_p`, `top_k` (vLLM's -1
is 0: off), `min_p`, `presence_penalty`, `frequency_penalty`, `repetition_penalty`, `seed`,
`max_tokens` / chat's `max_completion_tokens` (chat default: until a stop or the model's
max_seq_len; completions default 16, OpenAI's), `stop` (a string or a list), `stop_token_ids`,
`ignore_eos`, chat `logprobs` + `top_logprobs`, completions `logprobs` (an int), `n` (1 to 16
choices: the prompt prefilled once, each choice its own seed stream; streamed chunks carry each
choice's `index`) and completions' `best_of` (n to 16 samples, the n of highest mean token
logprob returned, best first; not with `stream`; the usage counts every sample's tokens),
chat `tools` (each checked, its `parameters` a JSON Schema of an object: a 400 names the bad one;
rendered into the prompt; a reply's DSML block comes back as `tool_calls` with finish_reason
`tool_calls`, runtime/serving/tool_calls.py), `tool_choice` (`none`: the block's opening is
masked and nothing is read as a call; `auto`; `required` or a named function: the reply is
constrained to a call whose arguments follow the tool's schema, runtime/serving/tool_grammar.py;
strict tools under `auto`: once the reply opens a call) and `parallel_tool_calls`
(false: one call), `response_format` (`text`; `json_object` or `json_schema` with `name`,
`schema`, `strict`: the reply is constrained to JSON that satisfies the schema, on chat and
completions, runtime/serving/structured.py; a schema feature the grammar engine cannot enforce
is a 400 naming it), assistant messages' `reasoning_content`,
`chat_template_kwargs.thinking` (thinking mode; default false: chat mode) and
`reasoning_effort` (`low` 50, `high` 75, `max` 100 or a whole number 1-100; default high; it
only shows in thinking mode, and anything else is a 400), user messages' `image_url` parts
(base64 PNG or JPEG data URIs, for a model with a vision tower: checked here, decoded by the
batcher; a bad one is a 400 naming what is wrong). Fields this server cannot honour (`echo`,
`suffix`, chat's `best_of`, `logit_bias`, `min_tokens`) are 400s, never silently dropped.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import Enum

from dsv41.runtime.engine.images import data_uri_image
from dsv41.runtime.engine.records import SpecCounts
from dsv41.runtime.engine.sampling import MAX_LOGPROBS, MAX_SAMPLES, SamplingParams, TokenLogprob
from dsv41.runtime.serving.chat_format import (
    ChatOptions,
    Message,
    ReasoningEffort,
    ToolCall,
    chat_images,
    messages_from_openai,
)
from dsv41.runtime.serving.prompts import (
    PromptFormat,
    TextBudget,
    chat_prompt_ids,
    completion_prompt_ids,
    prompt_format,
)
from dsv41.runtime.serving.structured import FormatKind, GrammarVocab, ResponseFormat
from dsv41.runtime.serving.tokenizer import Tokenizer
from dsv41.runtime.serving.tool_calls import CallDelta
from dsv41.runtime.serving.tool_choice import ChoiceKind, TokenTexts, ToolChoice, tool_specs

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


class ErrorType(Enum):
    INVALID_REQUEST = "invalid_request_error"
    AUTHENTICATION = "authentication_error"
    NOT_FOUND = "not_found_error"
    RATE_LIMIT = "rate_limit_error"
    TIMEOUT = "timeout_error"
    SERVER = "server_error"


class ApiError(Exception):
    """An error answer: HTTP status and OpenAI's error body."""

    def __init__(self, status: int, message: str, *, type: ErrorType = ErrorType.INVALID_REQUEST,
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status, message, type, param, code)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type.value, "param": self.param,
                          "code": self.code}}


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)


class Endpoint(Enum):
    CHAT = "chat"
    COMPLETIONS = "completions"


class LogprobsForm(Enum):
    NONE = "none"
    CHAT = "chat"  # choices[].logprobs.content[] with top_logprobs lists
    COMPLETIONS = "completions"  # tokens / token_logprobs / top_logprobs dicts / text_offset


@dataclass(frozen=True)
class GenerationRequest:
    endpoint: Endpoint
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with the usage
    logprobs: LogprobsForm
    id: str = field(default_factory=lambda: f"cmpl-{uuid.uuid4().hex}")
    reads_tool_calls: bool = False  # chat with tools: replies are read for DSML tool calls
    parallel_tool_calls: bool = True  # off: only a reply's first call is returned
    thinking: bool = False  # chat in thinking mode: the text before `</think>` is reasoning
    created: int = field(default_factory=lambda: int(time.time()))
    # the image parts' data (PNG / JPEG bytes), one per image placeholder of prompt_ids, in order
    images: tuple[bytes, ...] = ()
    n: int = 1  # choices returned
    samples: int = 1  # samples generated: completions' best_of (the n best returned), else n
    # chat with tools: the request's tools, whose `check_call` says why an unconstrained call's
    # arguments miss their schema (the reply's `dsv41_argument_error`; None: not checked)
    tool_choice: ToolChoice | None = None


def _get(body: Mapping, name: str, types: type | tuple[type, ...], what: str, default=None):
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise bad_request(f"{name} must be {what}, not {v!r}.", name)
    if not isinstance(v, types):
        raise bad_request(f"{name} must be {what}, not {v!r:.60}.", name)
    return v


def _check_model(body: Mapping, model_name: str) -> None:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("model is required: the name of the served model "
                          f"({model_name!r}).", "model")
    if model != model_name:
        raise ApiError(404, f"The model {model!r} does not exist; this server serves "
                       f"{model_name!r}.", type=ErrorType.NOT_FOUND, param="model",
                       code="model_not_found")


def _check_unsupported(body: Mapping) -> None:
    if body.get("echo"):
        raise bad_request("echo is not supported by this server.", "echo")
    if body.get("suffix") not in (None, ""):
        raise bad_request("suffix is not supported by this server.", "suffix")
    if body.get("logit_bias"):
        raise bad_request("logit_bias is not supported by this server.", "logit_bias")
    if body.get("min_tokens") not in (None, 0):
        raise bad_request("min_tokens is not supported by this server.", "min_tokens")


def _count(body: Mapping, name: str, default: int) -> int:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= MAX_SAMPLES:
        raise bad_request(f"{name} must be a whole number from 1 to {MAX_SAMPLES}, not "
                          f"{v!r:.60}.", name)
    return v


def _samples(body: Mapping, endpoint: Endpoint, stream: bool) -> tuple[int, int]:
    """(n, samples generated): `n`, and completions' `best_of` (at least n; not streamed)."""
    n = _count(body, "n", 1)
    if endpoint is Endpoint.CHAT:
        if body.get("best_of") not in (None, 1):
            raise bad_request("best_of is a /v1/completions field; chat completions take n "
                              "alone.", "best_of")
        return n, n
    best = _count(body, "best_of", n)
    if best < n:
        raise bad_request(f"best_of ({best}) must be at least n ({n}): the n best of best_of "
                          f"samples are returned.", "best_of")
    if best > n and stream:
        raise bad_request("best_of cannot be streamed: the best samples are known only at "
                          "the end (leave stream off, or best_of equal to n).", "best_of")
    return n, best


def _stop(body: Mapping) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (stop,)
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return tuple(stop)
    raise bad_request("stop must be a string or a list of strings.", "stop")


def _sampling(body: Mapping, *, max_tokens, logprobs: int | None,
              vocab_size: int) -> SamplingParams:
    top_k = body.get("top_k", 0)
    stop_ids = body.get("stop_token_ids") or []
    if not isinstance(stop_ids, list):
        raise bad_request("stop_token_ids must be a list of token ids.", "stop_token_ids")

    def value(name: str, default):
        v = body.get(name)
        return default if v is None else v

    params = SamplingParams(
        temperature=value("temperature", 1.0), top_p=value("top_p", 1.0),
        top_k=0 if top_k in (None, -1) else top_k, min_p=value("min_p", 0.0),
        presence_penalty=value("presence_penalty", 0.0),
        frequency_penalty=value("frequency_penalty", 0.0),
        repetition_penalty=value("repetition_penalty", 1.0), seed=body.get("seed"),
        max_tokens=max_tokens, stop=_stop(body), stop_token_ids=tuple(stop_ids),
        ignore_eos=value("ignore_eos", False), logprobs=logprobs)
    try:
        return params.validate(vocab_size)
    except ValueError as e:
        msg = str(e)
        param = msg.split(" ", 1)[0] if msg.split(" ", 1)[0] in body else None
        raise bad_request(msg, param) from None


def _structured(body: Mapping, params: SamplingParams, vocab: Callable[[], GrammarVocab],
                *, thinking: bool = False,
                texts: Callable[[], TokenTexts] | None = None) -> SamplingParams:
    """`params` with `response_format`'s constraint (structured.py) when it asks for JSON."""
    try:
        fmt = ResponseFormat.parse(body.get("response_format"))
    except ValueError as e:
        raise bad_request(str(e), "response_format") from None
    if fmt.kind is FormatKind.TEXT:
        return params
    if params.ignore_eos:
        raise bad_request("ignore_eos cannot be combined with a JSON response_format: the "
                          "reply ends with EOS once its JSON is whole.", "ignore_eos")
    if params.constraint is not None:
        raise bad_request("A JSON response_format cannot be combined with tool_choice "
                          "\"required\", a named function or \"none\" with tools.",
                          "response_format")
    try:
        constraint = fmt.constraint(vocab(), thinking=thinking, texts=texts)
    except ValueError as e:
        raise bad_request(str(e), "response_format") from None
    return replace(params, constraint=constraint)


def _body(body) -> Mapping:
    if not isinstance(body, Mapping):
        raise bad_request("The request body must be a JSON object.")
    return body


def _stream_flags(body: Mapping) -> tuple[bool, bool]:
    stream = _get(body, "stream", bool, "true or false", False)
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, Mapping):
        raise bad_request("stream_options must be an object.", "stream_options")
    include = _get(opts or {}, "include_usage", bool, "true or false", False)
    if opts is not None and not stream:
        raise bad_request("stream_options is only allowed with stream: true.", "stream_options")
    return stream, include


@dataclass(frozen=True)
class ChatPrompt:
    """What a chat request's prompt is made of."""

    messages: tuple[Message, ...]
    options: ChatOptions
    tool_choice: ToolChoice


def chat_prompt(body: Mapping) -> ChatPrompt:
    """The messages and the format's options of a chat request: `messages`, `tools`,
    `chat_template_kwargs.thinking` (default false: chat mode) and `reasoning_effort` (`low`,
    `high`, `max` or 1-100; default high = 75; rendered in thinking mode only)."""
    try:
        messages = messages_from_openai(body.get("messages"))
    except ValueError as e:
        raise bad_request(str(e), "messages") from None
    kwargs = _get(body, "chat_template_kwargs", dict, "an object", {})
    thinking = _get(kwargs, "thinking", bool, "true or false", False)
    tools = _get(body, "tools", list, "a list of tools", [])
    effort = ReasoningEffort()
    if body.get("reasoning_effort") is not None:
        try:
            effort = ReasoningEffort.parse(body["reasoning_effort"])
        except ValueError as e:
            raise bad_request(str(e), "reasoning_effort") from None
    try:
        specs = tool_specs(tools)
    except ValueError as e:
        raise bad_request(str(e), "tools") from None
    parallel = _get(body, "parallel_tool_calls", bool, "true or false", True)
    try:
        choice = ToolChoice.parse(body.get("tool_choice"), specs, parallel=parallel)
    except ValueError as e:
        raise bad_request(str(e), "tool_choice") from None
    return ChatPrompt(messages, ChatOptions(thinking=thinking, effort=effort,
                                            tools=tuple(tools)), choice)


def parse_chat(body, tok: Tokenizer, *, model_name: str, vocab_size: int,
               image_token_id: int | None = None,
               texts: Callable[[], TokenTexts] | None = None,
               budget: TextBudget | None = None,
               grammar: Callable[[], GrammarVocab] | None = None) -> GenerationRequest:
    """`image_token_id`: the model's image placeholder id (None: a model without a vision
    tower, whose chats take text parts only). `texts`: the tokenizer's token texts, built
    once by the caller (`TokenTexts.of(tok)` otherwise), for `tool_choice`'s constraints.
    `budget`: the context's (`TextBudget.of`, built once by the caller): a prompt longer than
    the context is a 400 before it is tokenized whole (None: the batcher's check only).
    `grammar`: the tokenizer as llguidance sees it, built once by the caller
    (`GrammarVocab.of(tok)` otherwise), for `response_format`'s constraint."""
    body = _body(body)
    _check_model(body, model_name)
    _check_unsupported(body)
    stream, include_usage = _stream_flags(body)
    n, _ = _samples(body, Endpoint.CHAT, stream)
    chat = chat_prompt(body)
    want = _get(body, "logprobs", bool, "true or false", False)
    top = _get(body, "top_logprobs", int, "a whole number", None)
    if top is not None and not want:
        raise bad_request("top_logprobs needs logprobs: true.", "top_logprobs")
    if top is not None and not 0 <= top <= MAX_LOGPROBS:
        raise bad_request(f"top_logprobs must be a whole number from 0 to {MAX_LOGPROBS}, "
                          f"not {top}.", "top_logprobs")
    max_tokens = body.get("max_completion_tokens")
    if max_tokens is None:
        max_tokens = body.get("max_tokens")
    params = _sampling(body, max_tokens=max_tokens, logprobs=(top or 0) if want else None,
                       vocab_size=vocab_size)
    chat_form = prompt_format(tok) is PromptFormat.CHAT
    choice = chat.tool_choice
    if chat_form and choice.tools and (choice.kind is not ChoiceKind.AUTO or choice.strict_auto):
        try:  # the calls follow the tools' schemas (an llguidance grammar)
            constraint = choice.constraint(texts() if texts else TokenTexts.of(tok),
                                           thinking=chat.options.thinking,
                                           vocab=grammar() if grammar else GrammarVocab.of(tok))
        except ValueError as e:
            raise bad_request(str(e), "tools") from None
        params = replace(params, constraint=constraint)
    try:
        ids = chat_prompt_ids(tok, chat.messages, chat.options, image_token_id=image_token_id,
                              budget=budget)
        images = tuple(data_uri_image(url) for url in chat_images(chat.messages))
    except ValueError as e:  # RequestError too (a bad image)
        raise bad_request(str(e), "messages") from None
    if choice.kind in (ChoiceKind.REQUIRED, ChoiceKind.NAMED) and not chat_form:
        raise bad_request(f"tool_choice {choice.kind.value!r} needs the chat format; this "
                          f"tokenizer ({tok.file.source.value}) renders plain prompts.",
                          "tool_choice")
    params = _structured(body, params, grammar or (lambda: GrammarVocab.of(tok)),
                         thinking=chat_form and chat.options.thinking,
                         texts=texts or (lambda: TokenTexts.of(tok)))
    return GenerationRequest(Endpoint.CHAT, tuple(ids), params, stream, include_usage,
                             LogprobsForm.CHAT if want else LogprobsForm.NONE,
                             id=f"chatcmpl-{uuid.uuid4().hex}",
                             reads_tool_calls=chat_form and choice.reads_calls,
                             parallel_tool_calls=choice.parallel,
                             thinking=chat_form and chat.options.thinking, images=images,
                             n=n, samples=n,
                             tool_choice=choice if choice.reads_calls else None)


def parse_completion(body, tok: Tokenizer, *, model_name: str, vocab_size: int,
                     budget: TextBudget | None = None,
                     grammar: Callable[[], GrammarVocab] | None = None) -> GenerationRequest:
    """`budget`, `grammar`: as parse_chat's."""
    body = _body(body)
    _check_model(body, model_name)
    _check_unsupported(body)
    stream, include_usage = _stream_flags(body)
    n, samples = _samples(body, Endpoint.COMPLETIONS, stream)
    logprobs = _get(body, "logprobs", int, "a whole number", None)
    max_tokens = body.get("max_tokens", COMPLETIONS_DEFAULT_MAX_TOKENS)
    params = _sampling(body, max_tokens=max_tokens, logprobs=logprobs, vocab_size=vocab_size)
    if samples > n and params.logprobs is None:  # best_of ranks by the tokens' logprobs
        params = replace(params, logprobs=0)
    params = _structured(body, params, grammar or (lambda: GrammarVocab.of(tok)))
    try:
        ids = completion_prompt_ids(tok, body.get("prompt"), vocab_size=vocab_size,
                                    budget=budget)
    except ValueError as e:
        raise bad_request(str(e), "prompt") from None
    return GenerationRequest(Endpoint.COMPLETIONS, tuple(ids), params, stream, include_usage,
                             LogprobsForm.NONE if logprobs is None else LogprobsForm.COMPLETIONS,
                             n=n, samples=samples)


# ---- responses ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class TokenOut:
    """One generated token as the response shows it."""

    token_id: int
    text: str  # its share of the streamed text (may be "" while held back)
    logprob: float | None
    top: tuple[TokenLogprob, ...]


class CacheTier(Enum):
    """Where a prompt's cached tokens came from (the usage's `dsv41_prompt_cache`): each hit
    counted once, at the tier that held the state the turn resumed from."""

    # live: the session's own cache (or an EPD handoff); runtime-prefix: another request's
    # prompt blocks still in the runtime cache
    RUNTIME = "runtime_cache_tokens"
    DRAM_POOL = "dram_pool_tokens"  # snapshot: SSD blocks + the DRAM pool's encoder state
    SSD_STORE = "ssd_store_tokens"  # SSD blocks (prefix), or blocks + an SSD state record


# the engine's tiers (records.Tier's values) by the tier their hit is counted at; cold: none
TIER_OF = {"live": CacheTier.RUNTIME, "handoff": CacheTier.RUNTIME,
           "runtime-prefix": CacheTier.RUNTIME, "snapshot": CacheTier.DRAM_POOL,
           "snapshot-ssd": CacheTier.SSD_STORE, "prefix": CacheTier.SSD_STORE}


@dataclass(frozen=True)
class PromptCache:
    """How a request's prompt was served (RequestTiming's, from the engine's TurnRecord)."""

    tier: str | None = None  # the engine tier that served the prefill (None: not started)
    replayed: int = 0  # cached tokens run through the encoder again (a snapshot miss, prefix)
    decoder_replayed: int = 0  # tokens through the decoder's bounded replay


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # prompt tokens served from the tiers (not prefilled)
    cache: PromptCache = PromptCache()
    speculative: SpecCounts | None = None  # DSpark's drafts (None: no speculation)

    def body(self) -> dict:
        """OpenAI's usage, DeepSeek's spelling of the cache hit (`prompt_cache_hit_tokens`,
        `prompt_cache_miss_tokens`: the DeepSeek API's fields) and `dsv41_prompt_cache`: the
        hit by tier (they sum to `cached_tokens`), the tier and the replayed tokens; with
        speculation, `speculative` (an extension field: OpenAI's clients keep extras)."""
        hit = self.cached_tokens
        by_tier = dict.fromkeys((t.value for t in CacheTier), 0)
        if hit and self.cache.tier in TIER_OF:
            by_tier[TIER_OF[self.cache.tier].value] = hit
        out = {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
               "total_tokens": self.prompt_tokens + self.completion_tokens,
               "prompt_tokens_details": {"cached_tokens": hit},
               "prompt_cache_hit_tokens": hit,
               "prompt_cache_miss_tokens": self.prompt_tokens - hit,
               "dsv41_prompt_cache": {"tier": self.cache.tier, **by_tier,
                                      "replayed_tokens": self.cache.replayed,
                                      "decoder_replayed_tokens": self.cache.decoder_replayed}}
        if self.speculative is not None:
            s = self.speculative
            out["speculative"] = {"drafted": s.drafted, "accepted": s.accepted,
                                  "mean_accepted_length": s.mean_accepted_length}
        return out


def _token_str(tok: Tokenizer, token_id: int) -> str:
    return tok.decode([token_id], skip_special=False)


def _entry(tok: Tokenizer, token_id: int, logprob: float) -> dict:
    s = _token_str(tok, token_id)
    return {"token": s, "logprob": logprob, "bytes": list(s.encode("utf-8"))}


def logprobs_body(tok: Tokenizer, form: LogprobsForm, tokens: Sequence[TokenOut],
                  text_offset: int = 0) -> dict | None:
    """The `logprobs` object of a choice or a chunk; None when none were asked for."""
    if form is LogprobsForm.NONE:
        return None
    if form is LogprobsForm.CHAT:
        return {"content": [
            {**_entry(tok, t.token_id, t.logprob),
             "top_logprobs": [_entry(tok, x.token_id, x.logprob) for x in t.top]}
            for t in tokens]}
    offsets, at = [], text_offset
    for t in tokens:
        offsets.append(at)
        at += len(t.text)
    return {"tokens": [_token_str(tok, t.token_id) for t in tokens],
            "token_logprobs": [t.logprob for t in tokens],
            "top_logprobs": [{_token_str(tok, x.token_id): x.logprob for x in t.top}
                             for t in tokens],
            "text_offset": offsets}


def tool_calls_body(calls: Sequence[ToolCall], *, indexed: bool = False,
                    tools: ToolChoice | None = None) -> list[dict]:
    """OpenAI's `tool_calls` list (a streamed delta's entries carry their `index`). With the
    request's `tools`, a call whose arguments miss its tool's schema (an unconstrained call:
    `auto` with a tool that is not strict) carries `dsv41_argument_error`, the reason."""
    out = []
    for i, c in enumerate(calls):
        body = {**({"index": i} if indexed else {}), "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
        out.append(body | argument_error(c, tools))
    return out


def argument_error(call: ToolCall, tools: ToolChoice | None) -> dict:
    """`{"dsv41_argument_error": why}` for a call whose arguments miss its tool's schema, else
    {} (no tools to check against, or the call satisfies them)."""
    why = None if tools is None else tools.check_call(call)
    return {} if why is None else {"dsv41_argument_error": why}


def response_body(req: GenerationRequest, model: str, text: str, finish_reason: str,
                  logprobs: dict | None, usage: Usage,
                  tool_calls: Sequence[ToolCall] = (), reasoning: str | None = None) -> dict:
    """The non-streaming answer of one choice (`choice_body`)."""
    choice = choice_body(req, text, finish_reason, logprobs, tool_calls, reasoning)
    return choices_body(req, model, [choice], usage)


def choices_body(req: GenerationRequest, model: str, choices: Sequence[dict],
                 usage: Usage) -> dict:
    """The non-streaming answer of its choices (`choice_body`s, in index order)."""
    kind = "chat.completion" if req.endpoint is Endpoint.CHAT else "text_completion"
    return {"id": req.id, "object": kind, "created": req.created, "model": model,
            "choices": list(choices), "usage": usage.body()}


def choice_body(req: GenerationRequest, text: str, finish_reason: str, logprobs: dict | None,
                tool_calls: Sequence[ToolCall] = (), reasoning: str | None = None, *,
                index: int = 0) -> dict:
    """One choice of the non-streaming answer; with `tool_calls` the message carries them (its
    content None when there is no text besides) and the finish reason is `tool_calls`; in
    thinking mode the message's `reasoning_content` (its content None when the reply is only
    reasoning)."""
    if req.endpoint is Endpoint.CHAT:
        message = {"role": "assistant", "content": text}
        if reasoning is not None:
            message = {"role": "assistant", "content": text or None,
                       "reasoning_content": reasoning}
        if tool_calls:
            message = {**message, "content": text or None,
                       "tool_calls": tool_calls_body(tool_calls, tools=req.tool_choice)}
            finish_reason = "tool_calls"
        return {"index": index, "message": message, "logprobs": logprobs,
                "finish_reason": finish_reason}
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def call_deltas_body(deltas: Sequence[CallDelta], ids: dict[int, str]) -> list[dict]:
    """A chunk's `delta.tool_calls`: a call's first piece carries its `id`, `type` and name
    (`ids`: the stream's call ids by index, made here on first use)."""
    out = []
    for d in deltas:
        if d.name is not None:
            ids[d.index] = f"call_{uuid.uuid4().hex[:24]}"
            out.append({"index": d.index, "id": ids[d.index], "type": "function",
                        "function": {"name": d.name, "arguments": d.arguments}})
        else:
            out.append({"index": d.index, "function": {"arguments": d.arguments}})
    return out


def chunk_body(req: GenerationRequest, model: str, *, text: str | None,
               finish_reason: str | None = None, logprobs: dict | None = None,
               role: bool = False, tool_calls: Sequence[ToolCall] = (),
               reasoning: str | None = None, call_deltas: Sequence[dict] = (),
               index: int = 0) -> dict:
    """One streamed chunk carrying a text delta (chat: `delta`; completions: `text`), a
    reasoning delta (`delta.reasoning_content`), pieces of tool calls (`call_deltas`, from
    `call_deltas_body`), or a chat delta with whole tool calls; `index`: its choice's."""
    if req.endpoint is Endpoint.CHAT:
        delta = {"role": "assistant"} if role else {}
        if reasoning is not None:
            delta["reasoning_content"] = reasoning
        if text is not None:
            delta["content"] = text
        if tool_calls:
            delta["tool_calls"] = tool_calls_body(tool_calls, indexed=True,
                                                  tools=req.tool_choice)
        if call_deltas:
            delta["tool_calls"] = list(call_deltas)
        choice = {"index": index, "delta": delta, "logprobs": logprobs,
                  "finish_reason": finish_reason}
        kind = "chat.completion.chunk"
    else:
        choice = {"index": index, "text": text or "", "logprobs": logprobs,
                  "finish_reason": finish_reason}
        kind = "text_completion"
    return {"id": req.id, "object": kind, "created": req.created, "model": model,
            "choices": [choice]}


def usage_chunk(req: GenerationRequest, model: str, usage: Usage) -> dict:
    """The last chunk with `stream_options.include_usage`: no choices, the usage."""
    kind = "chat.completion.chunk" if req.endpoint is Endpoint.CHAT else "text_completion"
    return {"id": req.id, "object": kind, "created": req.created, "model": model,
            "choices": [], "usage": usage.body()}
