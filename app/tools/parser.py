"""Streaming split of one choice's output into content text and tool calls, for any WireFormat.

A small state machine over the text not yet consumed:

    CONTENT --trigger--> OPEN --> HEAD --ToolCallStart--> ARGS --ArgumentsDelta...--> TAIL --> CLOSE --> CONTENT
                                   ^                                                             |
                                   +------------------ "," (the next call of a list) ------------+

OPEN takes the "[" of a call list (Mistral), HEAD '{"name": "X", "arguments": ' up to the arguments'
"{", ARGS the arguments object (string-aware brace counting), TAIL the call's "}", CLOSE what may
follow a call: "</tool_call>" (Hermes), or "," / "]" in a list.

Content is streamed as soon as it cannot be the start of a trigger (only a possible trigger prefix
is held back, as with stop strings). Whitespace is held back too, and dropped when a call follows
it (or ends the output after calls), so "Sure.\\n\\n<tool_call>" gives the content "Sure.".
Output that breaks the format before a call's name is complete is never an error: the text of the
failed call, markers included, becomes content again and scanning resumes one character later.
Once its ToolCallStart is out, a call is never taken back: cut short (max_tokens) or malformed, it
ends as far as it got, so a stream and a whole reply always carry the same calls.
"""
from __future__ import annotations

import json
from enum import Enum

from app.tools.base import ArgumentsDelta, ContentDelta, Event, ToolCall, ToolCallStart, WireFormat, new_call_id

WHITESPACE = " \t\r\n"
NAME_KEY = '"name"'
ARGUMENT_KEYS = ('"arguments"', '"parameters"')  # Llama writes "parameters"; accepted from every family


class _State(Enum):
    CONTENT = "content"
    OPEN = "open"  # after a marker: is a list of calls opening?
    HEAD = "head"  # '{"name": "X", "arguments": ' up to the arguments' "{"
    ARGS = "args"  # inside the arguments object
    TAIL = "tail"  # the call object's closing "}"
    CLOSE = "close"  # what may follow a call: a closing marker, or "," / "]" in a list


class ToolCallParser:
    """Parses one choice's output, fed delta by delta, into events (see the module docstring)."""

    def __init__(self, wire: WireFormat) -> None:
        self.wire = wire
        self._triggers = wire.markers + wire.json_starts
        self._state = _State.CONTENT
        self._buf = ""  # fed text not consumed yet
        self._held = ""  # whitespace (or separators after a call) held back from content
        self._after_call = False  # no content since the last call: separators are held too
        self._attempt = ""  # text consumed by the call being read, given back as content if it fails
        self._attempt_held = ""  # what was held when it began, restored if it fails
        self._in_list = False
        self._index = -1  # index of the call being read
        self._id = ""
        self._name = ""
        self._args = ""
        self._depth = 0
        self._in_string = False
        self._escaped = False
        self._started = 0  # ToolCallStarts emitted (the next call's index)
        self._calls: list[ToolCall] = []
        self._events: list[Event] = []

    @property
    def calls(self) -> list[ToolCall]:
        """The calls parsed so far: each whose start was emitted, one cut short with the arguments it got."""
        return list(self._calls)

    def feed(self, text: str) -> list[Event]:
        """Events for a new delta of the output."""
        self._buf += text
        while self._step(final=False):
            pass
        return self._take_events()

    def finish(self) -> list[Event]:
        """Events at the end of the output: held-back text, and incomplete calls given back as content."""
        while self._step(final=True):
            pass
        if not self._calls:  # with no calls, the content is the whole output
            self._emit_text(self._held)
        self._held = ""
        return self._take_events()

    # ---- one step: consume what the current state can; False when it needs more text

    def _step(self, final: bool) -> bool:
        if self._state is _State.CONTENT:
            return self._step_content(final)
        if not self._buf and not final:
            return False
        return {_State.OPEN: self._step_open, _State.HEAD: self._step_head, _State.ARGS: self._step_args,
                _State.TAIL: self._step_tail, _State.CLOSE: self._step_close}[self._state](final)

    def _step_content(self, final: bool) -> bool:
        buf = self._buf
        if not buf:
            return False
        at, trigger = _first_trigger(buf, self._triggers)
        if trigger:
            self._content(buf[:at])
            self._buf = buf[at:]
            self._begin_call(trigger)
            return True
        keep = 0 if final else _trigger_prefix_len(buf, self._triggers)
        if keep == len(buf):
            return False
        self._content(buf[:len(buf) - keep])
        self._buf = buf[len(buf) - keep:]
        return True

    def _step_open(self, final: bool) -> bool:
        rest = self._buf.lstrip(WHITESPACE)
        if not rest and not final:
            return False
        self._in_list = rest.startswith("[")
        self._consume(len(self._buf) - len(rest) + self._in_list)
        self._state = _State.HEAD
        return True

    def _step_head(self, final: bool) -> bool:
        end, name = _scan_head(self._buf)
        if end is None and name is None and not final:
            return False  # could still become a call head
        if end is None:
            return self._fail()
        self._consume(end)
        self._index, self._id, self._name = self._started, new_call_id(), name
        self._started += 1
        self._events.append(ToolCallStart(self._index, self._id, name))
        self._args, self._depth, self._in_string, self._escaped = "", 0, False, False
        self._state = _State.ARGS
        return True

    def _step_args(self, final: bool) -> bool:
        n, closed = self._scan_args(self._buf)
        if n:
            fragment = self._buf[:n]
            self._args += fragment
            self._consume(n)
            self._events.append(ArgumentsDelta(self._index, fragment))
        if closed:
            self._state = _State.TAIL
            return True
        return self._cut() if final else n > 0

    def _step_tail(self, final: bool) -> bool:
        rest = self._buf.lstrip(WHITESPACE)
        if not rest:
            self._consume(len(self._buf))
            return self._cut() if final else False
        if rest[0] != "}":
            return self._cut()  # what follows is read as content again
        self._consume(len(self._buf) - len(rest) + 1)
        self._calls.append(ToolCall(self._id, self._name, self._args))
        self._attempt, self._attempt_held = "", ""
        self._after_call = True
        self._state = _State.CLOSE
        return True

    def _step_close(self, final: bool) -> bool:
        rest = self._buf.lstrip(WHITESPACE)
        skipped = len(self._buf) - len(rest)
        if self._in_list:
            if not rest and not final:
                return False
            if rest[:1] == ",":  # the next call of the list
                self._consume(skipped + 1)
                self._attempt = ""
                self._state = _State.HEAD
                return True
            if rest[:1] == "]":
                self._consume(skipped + 1)
        elif self.wire.call_close:
            close = self.wire.call_close
            if rest.startswith(close):
                self._consume(skipped + len(close))
            elif close.startswith(rest):  # a closing marker may be arriving: wait, or drop it at the end
                if not final:
                    return False
                self._consume(len(self._buf))
        self._attempt = ""
        self._in_list = False
        self._state = _State.CONTENT
        return True

    # ---- helpers

    def _begin_call(self, trigger: str) -> None:
        self._attempt, self._attempt_held, self._held = "", self._held, ""  # whitespace before a call is dropped
        if trigger in self.wire.markers:
            self._consume(len(trigger))
            self._state = _State.OPEN if self.wire.list_calls else _State.HEAD
        else:
            self._state = _State.HEAD

    def _cut(self) -> bool:
        """End a call whose ToolCallStart is out as far as it got (its arguments may be partial)."""
        self._calls.append(ToolCall(self._id, self._name, self._args))
        self._attempt, self._attempt_held, self._in_list = "", "", False
        self._after_call = True
        self._state = _State.CONTENT
        return True

    def _fail(self) -> bool:
        """Give the failed call's text back as content; rescan all but its first character."""
        text = self._attempt + self._buf
        self._held = self._attempt_held + self._held
        self._attempt, self._attempt_held, self._in_list = "", "", False
        self._state = _State.CONTENT
        self._buf = text[1:]
        self._content(text[:1])
        return True

    def _consume(self, n: int) -> None:
        self._attempt += self._buf[:n]
        self._buf = self._buf[n:]

    def _content(self, text: str) -> None:
        if self._after_call:  # text between calls: separators are held like whitespace
            lead = len(text) - len(text.lstrip(WHITESPACE + self.wire.separators))
            self._held += text[:lead]
            text = text[lead:]
            if not text:
                return
            self._after_call = False
        body = text.rstrip(WHITESPACE)
        if body:
            self._emit_text(self._held + body)
            self._held = ""
        self._held += text[len(body):]

    def _emit_text(self, text: str) -> None:
        if text:
            self._events.append(ContentDelta(text))

    def _scan_args(self, text: str) -> tuple[int, bool]:
        """How much of text belongs to the arguments object, and whether it closes there."""
        for i, ch in enumerate(text):
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
            elif ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth == 0:
                    return i + 1, True
        return len(text), False

    def _take_events(self) -> list[Event]:
        """The pending events, adjacent content and same-call argument fragments merged."""
        merged: list[Event] = []
        for e in self._events:
            last = merged[-1] if merged else None
            if isinstance(e, ContentDelta) and isinstance(last, ContentDelta):
                merged[-1] = ContentDelta(last.text + e.text)
            elif isinstance(e, ArgumentsDelta) and isinstance(last, ArgumentsDelta) and last.index == e.index:
                merged[-1] = ArgumentsDelta(e.index, last.text + e.text)
            else:
                merged.append(e)
        self._events = []
        return merged


def _first_trigger(text: str, triggers: tuple[str, ...]) -> tuple[int, str]:
    """The earliest trigger in text and where it starts ("" if none)."""
    best, found = len(text), ""
    for t in triggers:
        at = text.find(t)
        if 0 <= at < best or (at == best and found and len(t) > len(found)):
            best, found = at, t
    return best, found


def _trigger_prefix_len(text: str, triggers: tuple[str, ...]) -> int:
    """The length of the longest end of text that is a proper prefix of a trigger."""
    best = 0
    for t in triggers:
        for k in range(min(len(t) - 1, len(text)), best, -1):
            if text.endswith(t[:k]):
                best = k
                break
    return best


def _string_end(text: str, start: int) -> int:
    """The index after the JSON string opening at text[start], or -1 if it is not closed yet."""
    i = start + 1
    while i < len(text):
        if text[i] == "\\":
            i += 2
        elif text[i] == '"':
            return i + 1
        else:
            i += 1
    return -1


def _scan_head(text: str) -> tuple[int | None, str | None]:
    """Match '{"name": "X", "arguments": ' (any whitespace) at the start of text, up to the "{" that
    opens the arguments. Returns (its length, X) when matched, (None, None) when text could still
    become one, (None, "") when it cannot."""
    pos, name = 0, ""
    for step in ("{", "key:name", ":", "name", ",", "key:args", ":", "{"):
        while pos < len(text) and text[pos] in WHITESPACE:
            pos += 1
        if pos == len(text):
            return None, None
        if len(step) == 1:
            if text[pos] != step:
                return None, ""
            pos += 1
            continue
        if text[pos] != '"':
            return None, ""
        end = _string_end(text, pos)
        token = text[pos:] if end < 0 else text[pos:end]
        keys = (NAME_KEY,) if step == "key:name" else ARGUMENT_KEYS if step == "key:args" else None
        if keys is not None and not any(k.startswith(token) if end < 0 else k == token for k in keys):
            return None, ""
        if end < 0:
            return None, None
        if step == "name":
            try:
                name = json.loads(token)
            except ValueError:
                return None, ""
            if not name:
                return None, ""
        pos = end
    return pos - 1, name  # the arguments' "{" is left for ARGS
