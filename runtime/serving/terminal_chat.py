"""`dsv41 chat`: a terminal chat on the embedded engine, through the same batcher the server uses.

    run_chat(batcher, tok, ChatSettings(params=SamplingParams(temperature=0.0, max_tokens=64)),
             sys.stdin, sys.stdout)

One line of input is one user message; the reply streams as the batcher detokenises it. The
history (system message, every user message and reply) is kept and rendered again for each turn
(runtime/prompts.py), so the engine's tiers serve the shared prefix. `/reset` forgets the
history, `/exit` (or the end of the input) ends the chat. Reading plain lines from any text
stream lets a pipe drive it. A message the tokenizer cannot spell, or a history past the model's
max_seq_len, prints an error and changes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TextIO

from dsv41.runtime.engine.sampling import SamplingParams
from dsv41.runtime.serving.batcher import Batcher, FinishReason
from dsv41.runtime.serving.chat_format import ChatOptions, Message, Role
from dsv41.runtime.serving.prompts import PromptFormat, chat_prompt_ids, prompt_format
from dsv41.runtime.serving.tokenizer import Tokenizer

EXIT, RESET = "/exit", "/reset"


@dataclass(frozen=True)
class ChatSettings:
    params: SamplingParams
    system: str | None = None
    thinking: bool = False


@dataclass(frozen=True)
class ChatSummary:
    turns: int  # replies generated
    completion_tokens: int
    prompt_tokens: tuple[int, ...]  # each reply's prompt length (the history grows)


def run_chat(batcher: Batcher, tok: Tokenizer, settings: ChatSettings, stdin: TextIO,
             stdout: TextIO) -> ChatSummary:
    settings.params.validate()
    base = [Message(Role.SYSTEM, settings.system)] if settings.system else []
    history = list(base)
    options = ChatOptions(thinking=settings.thinking)
    turns = tokens = 0
    prompts: list[int] = []
    if prompt_format(tok) is PromptFormat.PLAIN:
        stdout.write(f"(the tokenizer {tok.file.path.name} has no chat markers: each turn is "
                     "the messages' texts joined, see runtime/prompts.py)\n")
    while True:
        stdout.write("you> ")
        stdout.flush()
        line = stdin.readline()
        if not line:  # end of input
            stdout.write("\n")
            break
        text = line.rstrip("\n")
        if text.strip() == EXIT:
            break
        if text.strip() == RESET:
            history = list(base)
            stdout.write("(history cleared)\n")
            continue
        if not text.strip():
            continue
        turn = [*history, Message(Role.USER, text)]
        try:
            ids = chat_prompt_ids(tok, turn, options)
            stream = batcher.submit(ids, replace(settings.params))
        except ValueError as e:
            stdout.write(f"error: {e}\n")
            continue
        stdout.write("assistant> ")
        stdout.flush()
        reply, ended = [], None
        for ev in stream:
            if ev.text:
                reply.append(ev.text)
                stdout.write(ev.text)
                stdout.flush()
            tokens += ev.token_id is not None
            if ev.finish is not None:
                ended = ev.finish
                stdout.write("\n")
                if ev.finish is FinishReason.ERROR:
                    stdout.write(f"error: the engine failed: {ev.error}\n")
                elif ev.finish is FinishReason.LENGTH:
                    stdout.write("(reply cut at the token limit)\n")
        if ended in (FinishReason.STOP, FinishReason.LENGTH):
            history = [*turn, Message(Role.ASSISTANT, "".join(reply))]
            turns += 1
            prompts.append(len(ids))
    return ChatSummary(turns, tokens, tuple(prompts))
