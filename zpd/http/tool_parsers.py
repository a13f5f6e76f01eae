"""Tool calls read out of a model's text, named as SGLang's --tool-call-parser:

- `hermes` / `qwen25`: `<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>`,
  any number of them, text around them (Qwen 2.5 and 3, Hermes, and the templates that
  copy them);
- `llama3`: `{"name": "f", "parameters": {...}}` as the whole answer, after an optional
  `<|python_tag|>` (Llama 3.1-3.3's JSON tool calls), several joined by ";".

One reader serves both answers: a streamed choice feeds it each new piece of text and
sends what it returns (text, and calls as OpenAI's `delta.tool_calls`: the id, type
and name first, then the arguments in fragments as the model writes them); a whole
answer feeds it all the text at once. So the pieces of a stream always add up to the
whole answer. A call's `arguments` are the model's own JSON text. A block that is not
a call to one of the request's tools (a name it lacks, text that is not an object
with a name) stays in the text, as the model wrote it. Whitespace between the text
and a call is dropped.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

PARSERS = ("hermes", "qwen25", "llama3")
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
# The start of a call object: its name, then its arguments' key (parsed as they come).
HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\S)')


class Scan:
    """Finds where a JSON value in a growing text ends, going on where it stopped (a
    stream's call is scanned once, not once per piece). `value`: the value at `start`
    ends before the first `,`, `}` or `]` outside it; else the object there (after
    whitespace) ends after its closing brace, or, where no object starts, at once."""

    def __init__(self, start: int = 0, value: bool = False) -> None:
        self.at, self.value = start, value
        self.depth, self.in_string, self.escaped = 0, False, False
        self.end: int | None = None

    def run(self, text: str) -> int | None:
        """The value's end in `text` (None while it goes on)."""
        if self.end is not None:
            return self.end
        for i in range(self.at, len(text)):
            c = text[i]
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif c == "\\":
                    self.escaped = True
                elif c == '"':
                    self.in_string = False
            elif c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            elif self.value and c in ",}]" and self.depth == 0:
                self.end = i
            elif c in "}]":
                self.depth -= 1
                if self.depth == 0 and not self.value:
                    self.end = i + 1
            elif self.depth == 0 and not self.value and not c.isspace():
                self.end = i          # not an object: the block ends where its text does
            if self.end is not None:
                return self.end
        self.at = len(text)
        return None


@dataclass
class Call:
    """One call being read: `start` is where its object starts in the reader's buffer."""
    index: int
    name: str = ""
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])
    args_from: int = -1          # where the arguments start in the buffer (-1: not yet)
    sent: int = 0                # characters of the arguments handed out so far
    arguments: str = ""          # all of them, once the call has ended
    block: Scan = field(default_factory=Scan)           # the call object's end
    args: Scan | None = None                            # its arguments' end


class ToolCallReader:
    """Splits a choice's text into content and tool calls as it arrives (module doc)."""

    def __init__(self, parser: str, names: set[str]) -> None:
        if parser not in PARSERS:
            raise ValueError(f"unknown tool-call parser {parser!r}; zpd has {', '.join(PARSERS)}")
        self.llama = parser == "llama3"
        self.names = names
        self.buf = ""                # text not yet handed out
        self.in_call = False         # the buffer is a call block (after its opening tag)
        self.opened = ""             # the block's opening tag ("" for a bare llama3 object)
        self.space = ""              # the whitespace before it
        self.any_text = False        # content was handed out (llama3: calls only lead)
        self.call: Call | None = None
        self.calls: list[dict] = []  # the calls read so far, whole
        self.skip_space = False      # after a call: whitespace is dropped

    # --- the two answers ---------------------------------------------------------------

    def feed(self, text: str) -> tuple[str, list[dict]]:
        """The content and the `delta.tool_calls` entries that `text` adds."""
        self.buf += text
        out: list[str] = []
        deltas: list[dict] = []
        while True:
            if not self.in_call:
                if not self._text(out, final=False):
                    break
            elif not self._block(out, deltas, final=False):
                break
        return "".join(out), deltas

    def finish(self) -> tuple[str, list[dict]]:
        """What is left once the choice has ended (a call cut short ends where it stops)."""
        out: list[str] = []
        deltas: list[dict] = []
        while self.buf or self.in_call:
            if not self.in_call:
                self._text(out, final=True)
            else:
                self._block(out, deltas, final=True)
        return "".join(out), deltas

    def whole(self, text: str) -> tuple[str | None, list[dict]]:
        """(content, tool_calls) of a whole answer; content None when it is only calls."""
        content, _ = self.feed(text)
        rest, _ = self.finish()
        content += rest
        return (None if self.calls and not content.strip() else content), self.calls

    # --- text between calls ------------------------------------------------------------

    def _text(self, out: list[str], final: bool) -> bool:
        """Hand out text up to the next call; True when a call block starts."""
        if self.skip_space:
            stripped = self.buf.lstrip()
            if not stripped and not final:
                self.buf = ""
                return False
            self.buf, self.skip_space = stripped, False
        at, tag = self._opening()
        if at < 0:
            keep = 0 if final else self._maybe_opening()
            # whitespace before a call is dropped: it waits to see what follows
            end = len(self.buf) - keep
            send = self.buf[:end] if final else self.buf[:end].rstrip()
            if final and self.calls:
                send = send.rstrip()
            out.append(send)
            self.any_text = self.any_text or bool(send.strip())
            self.buf = self.buf[len(send):] if not final else ""
            return False
        before = self.buf[:at].rstrip()
        out.append(before)
        self.space = self.buf[len(before):at]     # back in the text if no call follows
        self.any_text = self.any_text or bool(before.strip())
        self.buf, self.in_call, self.opened = self.buf[at + len(tag):], True, tag
        return True

    def _opening(self) -> tuple[int, str]:
        """Where the next call opens in the buffer, and its tag (-1 where none does)."""
        if not self.llama:
            return self.buf.find(HERMES_OPEN), HERMES_OPEN
        lead = self.buf.lstrip()
        if not self.any_text and lead.startswith("{"):      # a bare JSON call leads the answer
            return len(self.buf) - len(lead), ""
        return self.buf.find(PYTHON_TAG), PYTHON_TAG

    def _maybe_opening(self) -> int:
        """How many of the buffer's last characters may begin an opening tag."""
        if self.llama and not self.any_text and not self.buf.strip():
            return len(self.buf)
        tag = PYTHON_TAG if self.llama else HERMES_OPEN
        return max((n for n in range(1, len(tag)) if self.buf.endswith(tag[:n])), default=0)

    # --- a call block ------------------------------------------------------------------

    def _block(self, out: list[str], deltas: list[dict], final: bool) -> bool:
        """Read the open block; True once it has ended (the buffer holds what follows)."""
        if self.call is None:
            self.call = Call(len(self.calls))
        call = self.call
        if call.args_from < 0:
            head = HEAD.match(self.buf)
            name = _name(head.group(1)) if head else None
            if head and name in self.names:
                call.name, call.args_from = name, head.end()
                deltas.append({"index": call.index, "id": call.id, "type": "function",
                               "function": {"name": name, "arguments": ""}})
        if call.args_from >= 0:
            call.args = call.args or Scan(call.args_from, value=True)
            ends = call.args.run(self.buf)
            self._send_arguments(deltas, len(self.buf) if ends is None else ends)
        end = call.block.run(self.buf)
        if end is None and not final:
            return False
        obj, rest = (self.buf, "") if end is None else (self.buf[:end], self.buf[end:])
        closed = self._close_tag(rest, final)
        if closed is None:
            return False        # the object is complete: its closing tag may still come
        if call.args_from >= 0 or self._whole_call(obj, deltas):
            if call.args_from >= 0:
                call.arguments = self.buf[call.args_from:call.args_from + call.sent]
            self._keep(call)
            if self.llama and rest[:closed].rstrip().endswith(";"):
                self.opened, self.any_text = "", False      # the next call follows, bare
        else:                   # no call: the block's text is content, as written
            closed = 0 if self.llama else closed
            out.append(self.space + self.opened + obj + rest[:closed])
            self.any_text = True
            self.buf, self.call, self.in_call = rest[closed:], None, False
            return True
        self.buf, self.call, self.in_call = rest[closed:], None, False
        self.skip_space = True
        return True

    def _close_tag(self, rest: str, final: bool) -> int | None:
        """How much of `rest` (after a call object) closes the block, or None until that
        is known."""
        stripped = rest.lstrip()
        if self.llama:
            if stripped.startswith(";"):
                return len(rest) - len(stripped) + 1
            return 0 if stripped or final else None
        if stripped.startswith(HERMES_CLOSE):
            return len(rest) - len(stripped) + len(HERMES_CLOSE)
        if final or (stripped and not HERMES_CLOSE.startswith(stripped)):
            return 0                        # no closing tag: the call ends with its object
        return None

    def _send_arguments(self, deltas: list[dict], end: int) -> None:
        """Hand out the arguments' text up to `end` in the buffer (less the whitespace it
        ends with: it may be the last) that was not handed out yet."""
        call = self.call
        start = call.args_from + call.sent
        while end > start and self.buf[end - 1].isspace():
            end -= 1
        if end > start:
            deltas.append({"index": call.index, "function": {"arguments": self.buf[start:end]}})
            call.sent = end - call.args_from

    def _whole_call(self, obj: str, deltas: list[dict]) -> bool:
        """A call object whose head came in another order: read whole, sent whole."""
        try:
            value = json.loads(obj)
        except ValueError:
            return False
        if not isinstance(value, dict) or value.get("name") not in self.names:
            return False
        args = value.get("arguments", value.get("parameters", {}))
        call = self.call
        call.name, call.arguments = value["name"], json.dumps(args, ensure_ascii=False)
        deltas.append({"index": call.index, "id": call.id, "type": "function",
                       "function": {"name": call.name, "arguments": call.arguments}})
        return True

    def _keep(self, call: Call) -> None:
        self.calls.append({"id": call.id, "type": "function",
                           "function": {"name": call.name, "arguments": call.arguments}})


def _name(literal: str) -> str | None:
    try:
        name = json.loads(literal)
    except ValueError:
        return None
    return name if isinstance(name, str) else None
