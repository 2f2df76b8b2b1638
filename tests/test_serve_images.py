"""Images through `dsv41 serve`'s API: OpenAI chat content parts with `image_url` data URIs,
talked to with the official `openai` client, on the PyTorch graph in CED mode (the default).

The model is shared-vision-small's with `vision_min_pixels` 1 (planning only), so an 84 x 42
image takes a 5-position span; its vocabulary is the small byte-level BPE, whose id 510 is
`<｜deepseek_image｜>`, so a chat is in DeepSeek-V4.1's format with each image part as the image
id 510, which the batcher replaces by the image's span. Greedy replies must equal, token for
token, the engine's own `Session.send(ids, images=[...])` on the same ids. Every bad image is a
400 whose message names what is wrong."""

from __future__ import annotations

import base64
import io
import struct
import threading
import zlib

import numpy as np
import openai
import pytest
from conftest import CONFORMANCE
from PIL import Image

from dsv41.graph.config import load_config
from dsv41.graph.model import Model
from dsv41.runtime.engine import Engine
from dsv41.runtime.engine import images as runtime_images
from dsv41.runtime.serving.app import ServerOptions, ServerThread, create_app
from dsv41.runtime.serving.batcher import Batcher
from dsv41.runtime.serving.chat_format import messages_from_openai
from dsv41.runtime.serving.openai_api import ApiError, parse_chat
from dsv41.runtime.serving.prompts import chat_prompt_ids
from dsv41.runtime.serving.tokenizer import Tokenizer

CASE = CONFORMANCE / "shared-vision-small"
MODEL = "vision-small"
IMG = 510
PAGE = 256  # one page holds the whole max_seq_len: every request is served cold
NO_EOS = {"ignore_eos": True}


def _image(seed: int, fmt: str = "PNG") -> bytes:
    rgb = np.random.default_rng(seed).integers(0, 256, (42, 84, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(rgb, "RGB").save(buf, format=fmt)
    return buf.getvalue()


def _uri(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def _part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def _text(t: str) -> dict:
    return {"type": "text", "text": t}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    if not CASE.exists():
        pytest.skip(f"conformance pack {CASE} is not present")
    ckpt = CASE / "checkpoint"
    args = load_config(ckpt).replace(vision_min_pixels=1)
    model = Model.from_checkpoint(ckpt, args)
    tok = Tokenizer.for_model(args, ckpt)
    engine = Engine.from_model(model, weights_hash="v" * 64, page_tokens=PAGE)
    batcher = Batcher(engine, tokenizer=tok, max_running=4, max_queue=8)
    batcher.start()
    opts = ServerOptions(model_name=MODEL, vocab_size=args.vocab_size,
                         max_seq_len=args.max_seq_len, image_token_id=args.image_token_id)
    srv = ServerThread(create_app(batcher, tok, opts)).start()
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0,
                           timeout=600)
    yield {"client": client, "tok": tok, "model": model}
    srv.stop()
    batcher.stop()
    engine.close()


def _alone(served, ids: list[int], images: list[bytes], n: int) -> list[int]:
    """The engine's own greedy reply to the prompt ids (placeholders for `images`)."""
    e = Engine.from_model(served["model"], weights_hash="v" * 64, page_tokens=PAGE)
    out = list(e.session().send(ids, max_new_tokens=n, images=images))
    e.close()
    return out


def _chat(client, messages, *, stream: bool, n: int = 4):
    """(token strings, prompt tokens) of a greedy chat."""
    kw = {"model": MODEL, "messages": messages, "max_tokens": n, "temperature": 0,
          "logprobs": True, "extra_body": NO_EOS}
    if not stream:
        r = client.chat.completions.create(**kw)
        return [e.token for e in r.choices[0].logprobs.content], r.usage.prompt_tokens
    toks, usage = [], None
    for ch in client.chat.completions.create(**kw, stream=True,
                                             stream_options={"include_usage": True}):
        usage = ch.usage or usage
        for c in ch.choices:
            toks += [e.token for e in (c.logprobs.content if c.logprobs else [])]
    return toks, usage.prompt_tokens


def test_chats_with_images_equal_the_engine(served):
    """Two chats with images, sent at once (one streaming), and a text chat: each reply is the
    engine's alone, the prompt counted with the spans."""
    tok, client = served["tok"], served["client"]
    a, b = _image(1), _image(2, "JPEG")
    convos = [
        ([{"role": "user", "content": [_text("w3 W3"), _part(_uri(a)), _text("w4")]}], [a],
         False),
        ([{"role": "system", "content": "w7"},
          {"role": "user", "content": [_part(_uri(b, "image/jpeg")), _text("w5"),
                                       _part(_uri(a))]}], [b, a], True),
        ([{"role": "user", "content": "w3 W3w4"}], [], True),
    ]
    chats = [(msgs, chat_prompt_ids(tok, messages_from_openai(msgs), image_token_id=IMG), ims,
              stream) for msgs, ims, stream in convos]
    assert [ids.count(IMG) for _, ids, ims, _ in chats] == [len(ims) for _, _, ims, _ in chats]
    want = [[tok.decode([t], skip_special=False) for t in _alone(served, ids, ims, 4)]
            for _, ids, ims, _ in chats]
    got: list = [None] * len(chats)
    go = threading.Barrier(len(chats))

    def one(k):
        go.wait()
        got[k] = _chat(client, chats[k][0], stream=chats[k][3])

    threads = [threading.Thread(target=one, args=(k,)) for k in range(len(chats))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for k, (_, ids, ims, _) in enumerate(chats):
        assert got[k] is not None, f"chat {k} failed"
        assert got[k][0] == want[k], f"chat {k} differs from the engine alone"
        assert got[k][1] == len(ids) + 4 * len(ims)  # each placeholder became a 5-position span


def _png_header(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height (its data is not there)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b""))
            + chunk(b"IEND", b""))


def test_bad_images_are_400s_with_a_clear_message(served, monkeypatch):
    client = served["client"]

    def status_of(content) -> tuple[int, str]:
        with pytest.raises(openai.APIStatusError) as e:
            client.chat.completions.create(model=MODEL, max_tokens=2,
                                           messages=[{"role": "user", "content": content}])
        body = e.value.body if isinstance(e.value.body, dict) else {}
        return e.value.status_code, body.get("message", "")

    png = _image(1)
    cases = [
        ([_text("w3"), _part(_uri(b"certainly not an image"))], "could not be decoded"),
        ([_part(_uri(png, "image/gif"))], "PNG or JPEG image"),
        ([_part(_uri(png, "image/jpeg"))], "declares image/jpeg but holds PNG"),
        ([_part("data:image/png;base64,@@@@")], "not valid base64"),
        ([_part("https://example.com/cat.png")], "not fetched"),
        ([_part("cat.png")], "base64 data URI"),
        ([_part(_uri(png[: len(png) // 2]))], "could not be decoded"),  # truncated
        ([_part(_uri(_png_header(9000, 8000)))], "at most 67,108,864 pixels"),
        ([{"type": "image_url"}], "an image_url part must be"),
    ]
    for content, match in cases:
        code, msg = status_of(content)
        assert code == 400 and match in msg, (match, code, msg)
    monkeypatch.setattr(runtime_images, "MAX_IMAGE_BYTES", 1000)
    code, msg = status_of([_part(_uri(png))])
    assert code == 400 and "too large" in msg and "the limit is 1,000" in msg
    monkeypatch.undo()
    # a completion's ids may hold the placeholder only with an image (completions take none)
    with pytest.raises(openai.APIStatusError) as e:
        client.completions.create(model=MODEL, prompt=[0, 5, IMG, 7], max_tokens=2)
    assert e.value.status_code == 400 and "placeholder" in e.value.body["message"]
    # a server of a model without a tower takes text parts only
    body = {"model": MODEL, "messages": [{"role": "user", "content": [_part(_uri(png))]}]}
    with pytest.raises(ApiError, match="no vision tower") as e:
        parse_chat(body, served["tok"], model_name=MODEL, vocab_size=512)
    assert e.value.status == 400
    # the server still serves
    assert len(_chat(client, [{"role": "user", "content": [_part(_uri(png))]}],
                     stream=False)[0]) == 4

