"""Serving: the continuous batcher, the OpenAI-compatible HTTP app, the chat format, tool calls,
the tokenizer, the terminal chat and the EPD workers."""
