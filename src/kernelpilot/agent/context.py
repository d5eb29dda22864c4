"""Keeping a conversation sendable: long tool outputs cut to head and tail, the conversation fitted to the model's
context window (old outputs shrunk first, then whole old turns dropped, the task and the latest turns kept)."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from typing import Any

Message = dict[str, Any]

CHARS_PER_TOKEN = 3  # code tokenizes at about 3-4 characters a token: 3 overestimates, so a fit stays a fit
MESSAGE_OVERHEAD_TOKENS = 4  # role and separators of one chat message
SHRUNK_OUTPUT_CHARS = 800  # what an old tool output is cut to when the context is full
WHOLE_RECENT_TURNS = 2  # the latest turns keep their full outputs as long as anything older can give way
DROPPED_TURNS_NOTE = (
    "[Earlier turns of this conversation were removed to fit the model's context window; "
    "the workspace files still hold everything they wrote.]"
)


def truncate_output(text: str, limit_chars: int) -> str:
    """`text` if it fits in `limit_chars`, else its head and tail around a note saying how much was cut."""
    if len(text) <= limit_chars:
        return text
    budget = max(0, limit_chars - len(_cut_note(len(text))))
    head_end = _back_to_line_start(text, budget // 2)
    tail_start = _forward_to_line_start(text, len(text) - (budget - budget // 2))
    return text[:head_end] + _cut_note(tail_start - head_end) + text[tail_start:]


def _cut_note(cut_chars: int) -> str:
    return f"\n[... {cut_chars} characters cut ...]\n"


def _back_to_line_start(text: str, end: int) -> int:
    """Move a cut back to a line break when that keeps most of the head (whole lines read better)."""
    newline = text.rfind("\n", 0, end)
    return newline if newline >= 0.8 * end else end


def _forward_to_line_start(text: str, start: int) -> int:
    newline = text.find("\n", start)
    return newline + 1 if 0 <= newline and newline + 1 - start <= 0.2 * (len(text) - start) else start


def count_tokens(messages: Sequence[Message]) -> int:
    """A tokenizer-free, deliberately high estimate of the prompt tokens of `messages`."""
    return sum(MESSAGE_OVERHEAD_TOKENS + math.ceil(_message_chars(m) / CHARS_PER_TOKEN) for m in messages)


def _message_chars(message: Message) -> int:
    content = message.get("content") or ""
    chars = len(content) if isinstance(content, str) else len(json.dumps(content))
    return chars + (len(json.dumps(message["tool_calls"])) if message.get("tool_calls") else 0)


def fit_context(
    messages: Sequence[Message], *, max_tokens: int, count_tokens: Callable[[list[Message]], int]
) -> list[Message]:
    """A copy of `messages` that fits in `max_tokens` if it can be made to.

    Keeps the system and task messages and the latest turns. Gives way in this order: tool outputs of older
    turns are cut to head + tail, then the oldest turns are dropped whole (an assistant message with its tool
    results, so every tool_call_id stays answered, as the OpenAI protocol requires), then the outputs of the
    remaining turns are cut too. When even that is too big, the smallest version is returned: the caller decides.
    """
    fitter = _ContextFitter(messages, count_tokens)
    if fitter.total() > max_tokens:
        fitter.shrink_tool_outputs(fitter.turns[:-WHOLE_RECENT_TURNS], max_tokens)
        fitter.drop_oldest_turns(max_tokens)
        fitter.shrink_tool_outputs(fitter.turns, max_tokens)
    return fitter.messages()


class _ContextFitter:
    """The conversation as head (system + task) and turns (an assistant message and what answered it)."""

    def __init__(self, messages: Sequence[Message], count: Callable[[list[Message]], int]):
        self.count = count
        self.head, self.turns = _split_turns([dict(m) for m in messages])
        self.tokens = {id(m): count([m]) for m in self.messages()}
        self.dropped_any = False

    def messages(self) -> list[Message]:
        return self.head + [m for turn in self.turns for m in turn]

    def total(self) -> int:
        return sum(self.tokens[id(m)] for m in self.messages())

    def shrink_tool_outputs(self, turns: list[list[Message]], max_tokens: int) -> None:
        for message in (m for turn in turns for m in turn):
            if self.total() <= max_tokens:
                return
            content = message.get("content")
            if message.get("role") == "tool" and isinstance(content, str) and len(content) > SHRUNK_OUTPUT_CHARS:
                message["content"] = truncate_output(content, SHRUNK_OUTPUT_CHARS)
                self.tokens[id(message)] = self.count([message])

    def drop_oldest_turns(self, max_tokens: int) -> None:
        while self.total() > max_tokens and len(self.turns) > 1:
            self.turns.pop(0)
            if not self.dropped_any:
                self.dropped_any = True
                self._note_dropped_turns()

    def _note_dropped_turns(self) -> None:
        """Tell the model in the task message itself: a separate note would break strict user/assistant turns."""
        task = self.head[-1] if self.head else None
        if task is not None and task.get("role") == "user" and isinstance(task.get("content"), str):
            task["content"] = f"{task['content']}\n\n{DROPPED_TURNS_NOTE}"
            self.tokens[id(task)] = self.count([task])


def _split_turns(messages: list[Message]) -> tuple[list[Message], list[list[Message]]]:
    """Head = up to the first user message (the task); each later turn starts at an assistant message."""
    first_user = next((i for i, m in enumerate(messages) if m.get("role") == "user"), None)
    if first_user is not None:
        head_len = first_user + 1
    else:
        head_len = next((i for i, m in enumerate(messages) if m.get("role") != "system"), len(messages))
    turns: list[list[Message]] = []
    for message in messages[head_len:]:
        if message.get("role") == "assistant" or not turns:
            turns.append([message])
        else:
            turns[-1].append(message)
    return messages[:head_len], turns
