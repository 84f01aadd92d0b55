"""Tool calling in chat completions, as vLLM serves it.

``tool_choice``:
- ``none``: the template still sees the tools; the output is text.
- ``auto`` (the default when tools are sent): the model decides; its output is parsed by the parser named with
  ``--tool-call-parser`` (``--enable-auto-tool-choice`` must be on, and the chat template must render ``tools``).
- ``required`` / a named function: enforced with structured outputs. ``required`` constrains the output to a JSON
  array of ``{"name": ..., "parameters": {...}}`` (at least one; one when ``parallel_tool_calls`` is false), a
  named function to that function's arguments object. Neither needs a parser.

Parsers (``--tool-call-parser``):
- ``llama3_json`` / ``llama4_json``: the output is JSON calls ``{"name": ..., "parameters": {...}}``, optionally
  after ``<|python_tag|>``, several separated by ``;`` (Llama 3.x / 4 JSON tool templates).
- ``hermes``: calls inside ``<tool_call>...</tool_call>``, each body an object or a list of objects with
  ``name`` and ``arguments`` (Hermes, Qwen; SmolLM2 writes a list in one block); text before them is content.

Streaming sends content as it comes and each tool call as one delta (id, name, complete arguments) as soon as its
JSON is complete; a named function's arguments stream piece by piece.

A call cut by ``max_tokens`` (finish reason ``length``) still comes back as a tool call once its name is complete,
with the arguments text written so far (vLLM streams such partial arguments too); before that it is content.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hybridkv.engine.sampling_params import StructuredOutputsParams
from hybridkv.server.protocol import (
    ChatCompletionRequest,
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCall,
    NamedToolChoice,
    ToolCall,
    ToolDefinition,
)

_PYTHON_TAG = "<|python_tag|>"
_TOOL_CALL_OPEN = "<tool_call>"
_HERMES_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
# The start of a call whose JSON was cut: its complete name, then (maybe) the start of its arguments.
_CUT_CALL_NAME = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")', re.DOTALL)
_CUT_CALL_ARGUMENTS = re.compile(r'\s*,\s*"(?:parameters|arguments)"\s*:\s*', re.DOTALL)
_DECODER = json.JSONDecoder()


@dataclass(slots=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text

    def tool_call(self) -> ToolCall:
        return ToolCall(function=FunctionCall(name=self.name, arguments=self.arguments))


# ---- parsing ------------------------------------------------------------------------------------------------
def _call_from(obj: Any) -> ParsedCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get("parameters", obj.get("arguments", {}))
    if isinstance(arguments, str):  # some models write the arguments as JSON text already
        return ParsedCall(obj["name"], arguments)
    return ParsedCall(obj["name"], json.dumps(arguments, ensure_ascii=False))


def json_calls(text: str) -> tuple[list[ParsedCall], bool]:
    """The calls in a run of JSON objects (``<|python_tag|>``, ``[``, ``]``, ``,``, ``;`` and space between them),
    as far as they are complete; and whether all of ``text`` was such a run (False: not tool calls)."""
    calls, end = _scan_calls(text)
    return calls, end == len(text)


def _scan_calls(text: str) -> tuple[list[ParsedCall], int]:
    """The complete calls at the start of ``text``, and where the first thing that is not one begins."""
    calls: list[ParsedCall] = []
    pos = text.find(_PYTHON_TAG) + len(_PYTHON_TAG) if text.lstrip().startswith(_PYTHON_TAG) else 0
    while True:
        while pos < len(text) and text[pos] in " \t\r\n[],;":
            pos += 1
        if pos == len(text):
            return calls, pos
        try:
            obj, end = _DECODER.raw_decode(text, pos)
        except ValueError:
            return calls, pos
        call = _call_from(obj)
        if call is None:
            return calls, pos
        calls.append(call)
        pos = end


def cut_json_calls(text: str) -> list[ParsedCall]:
    """The calls in output cut by ``max_tokens``: the complete ones, then the cut one if its name is complete
    (its arguments: the text written after ``"arguments":`` / ``"parameters":``, possibly none)."""
    calls, pos = _scan_calls(text)
    name = _CUT_CALL_NAME.match(text, pos)
    if name is None:
        return calls
    try:
        function = json.loads(name.group(1))
    except ValueError:  # an escape JSON does not have
        return calls
    rest = _CUT_CALL_ARGUMENTS.match(text, name.end())
    return [*calls, ParsedCall(function, text[rest.end():] if rest else "")]


class Llama3JsonParser:
    """A tool call is the whole output: JSON (after an optional ``<|python_tag|>``)."""

    def region_start(self, text: str) -> int | None:
        stripped = text.lstrip()
        if stripped.startswith("{") or stripped.startswith(_PYTHON_TAG):
            return len(text) - len(stripped)
        return None

    def content_end(self, text: str) -> int:
        """How much of ``text`` (no region found yet) can go out as content: none while it could still begin one."""
        stripped = text.lstrip()
        return 0 if _PYTHON_TAG.startswith(stripped) else len(text)

    def calls(self, region: str) -> tuple[list[ParsedCall], bool]:
        return json_calls(region)

    def cut_calls(self, region: str) -> list[ParsedCall]:
        return cut_json_calls(region)


class HermesParser:
    """Calls in ``<tool_call>`` blocks after optional content."""

    def region_start(self, text: str) -> int | None:
        index = text.find(_TOOL_CALL_OPEN)
        return None if index < 0 else index

    def content_end(self, text: str) -> int:
        for keep in range(min(len(_TOOL_CALL_OPEN) - 1, len(text)), 0, -1):
            if _TOOL_CALL_OPEN.startswith(text[-keep:]):
                return len(text) - keep
        return len(text)

    def calls(self, region: str) -> tuple[list[ParsedCall], bool]:
        """Calls of the complete blocks; False when a block does not hold calls (text after the blocks is
        dropped, as vLLM's hermes parser does)."""
        calls: list[ParsedCall] = []
        for block in _HERMES_BLOCK.finditer(region):
            found, complete = json_calls(block.group(1).strip())
            if not complete or not found:
                return calls, False
            calls.extend(found)
        return calls, True

    def cut_calls(self, region: str) -> list[ParsedCall]:
        """The complete blocks' calls, then those of the block ``max_tokens`` cut (see ``cut_json_calls``)."""
        calls, complete = self.calls(region)
        if not complete:
            return []
        last = max((m.end() for m in _HERMES_BLOCK.finditer(region)), default=0)
        opened = region.find(_TOOL_CALL_OPEN, last)
        return calls if opened < 0 else calls + cut_json_calls(region[opened + len(_TOOL_CALL_OPEN):])


TOOL_CALL_PARSERS = {"llama3_json": Llama3JsonParser, "llama4_json": Llama3JsonParser, "hermes": HermesParser}


def make_parser(name: str):
    if name not in TOOL_CALL_PARSERS:
        raise ValueError(f"unknown tool call parser {name!r}; choose one of {', '.join(TOOL_CALL_PARSERS)}")
    return TOOL_CALL_PARSERS[name]()


# ---- what a request asks for ------------------------------------------------------------------------------
@dataclass(slots=True)
class ToolConfig:
    """The server's flags: ``--enable-auto-tool-choice`` and ``--tool-call-parser``."""

    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None

    def __post_init__(self) -> None:
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser "
                             f"(one of {', '.join(TOOL_CALL_PARSERS)})")
        if self.tool_call_parser is not None:
            make_parser(self.tool_call_parser)


@dataclass(slots=True)
class ToolPlan:
    """How one chat request uses its tools: mode ``none`` (also: no tools), ``auto``, ``required`` or ``named``."""

    mode: str = "none"
    template_tools: list[dict[str, Any]] | None = None
    constraint: StructuredOutputsParams | None = None
    named: str | None = None
    parser: Any = None

    @property
    def parses(self) -> bool:
        return self.mode in ("auto", "required", "named")

    def region_calls(self, region: str, cut: bool) -> tuple[list[ParsedCall], bool]:
        """The calls in the tool-call part of the output (``required`` and ``auto``), and whether all of it was
        calls; ``cut``: the output ended at ``max_tokens``, so a call may be unfinished."""
        if cut:
            return (cut_json_calls(region) if self.mode == "required" else self.parser.cut_calls(region)), True
        return json_calls(region) if self.mode == "required" else self.parser.calls(region)


def plan_tools(body: ChatCompletionRequest, config: ToolConfig, template_renders_tools: bool) -> ToolPlan:
    """What the request's ``tools`` / ``tool_choice`` need; ValueError (a 400) naming what cannot be honoured."""
    if body.functions is not None or body.function_call is not None:
        raise ValueError("functions: OpenAI's deprecated functions/function_call are not supported; send tools "
                         "and tool_choice")
    tools = body.tools or []
    choice = body.tool_choice
    if not tools:
        if choice not in (None, "none"):
            raise ValueError(f"tool_choice: {_choice_name(choice)} needs tools, and the request has none")
        return ToolPlan()
    _check_unique_names(tools)
    template_tools = [t.model_dump(exclude_none=True) for t in tools]
    if choice is None:
        choice = "auto"
    if choice == "none":
        return ToolPlan("none", template_tools)
    if choice == "auto":
        if not config.enable_auto_tool_choice:
            raise ValueError('tool_choice: "auto" (the default when tools are sent) needs the server started with '
                             '--enable-auto-tool-choice and --tool-call-parser; send tool_choice "required", a '
                             'named function or "none" instead')
        if not template_renders_tools:
            raise ValueError('tool_choice: "auto" needs a chat template that renders tools, and this model\'s '
                             'does not, so the model would never see them; send tool_choice "required" or a '
                             'named function')
        return ToolPlan("auto", template_tools, parser=make_parser(config.tool_call_parser))
    if choice == "required":
        schema = required_schema(tools, body.parallel_tool_calls)
        return ToolPlan("required", template_tools, StructuredOutputsParams(json=schema))
    return _named_plan(tools, choice, template_tools)


def _named_plan(tools: Sequence[ToolDefinition], choice: NamedToolChoice, template_tools) -> ToolPlan:
    by_name = {t.function.name: t for t in tools}
    name = choice.function.name
    if name not in by_name:
        raise ValueError(f"tool_choice: function {name!r} is not among the tools ({', '.join(by_name)})")
    schema = by_name[name].function.parameters or {"type": "object"}
    return ToolPlan("named", template_tools, StructuredOutputsParams(json=schema), named=name)


def required_schema(tools: Sequence[ToolDefinition], parallel: bool) -> dict[str, Any]:
    """A JSON array of calls, each ``{"name": one of the tools, "parameters": that tool's schema}``."""
    items = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [t.function.name]},
                "parameters": t.function.parameters or {"type": "object"},
            },
            "required": ["name", "parameters"],
        }
        for t in tools
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def _check_unique_names(tools: Sequence[ToolDefinition]) -> None:
    seen: set[str] = set()
    for t in tools:
        if t.function.name in seen:
            raise ValueError(f"tools: function name {t.function.name!r} appears twice")
        seen.add(t.function.name)


def _choice_name(choice: Any) -> str:
    return f'"{choice}"' if isinstance(choice, str) else f"function {choice.function.name!r}"


# ---- turning output into tool calls -----------------------------------------------------------------------
def extract(plan: ToolPlan, text: str, cut: bool = False) -> tuple[str | None, list[ToolCall]]:
    """The final message's content and tool calls (text that does not parse stays content); ``cut``: the output
    ended at ``max_tokens``."""
    if plan.mode == "named":
        return None, [ParsedCall(plan.named, text).tool_call()]
    start = 0 if plan.mode == "required" else plan.parser.region_start(text) if plan.mode == "auto" else None
    if start is not None:
        calls, complete = plan.region_calls(text[start:], cut)
        if complete and calls:
            return text[:start] or None, [c.tool_call() for c in calls]
    return text, []


@dataclass(slots=True)
class ToolCallStream:
    """One choice's streamed text turned into content deltas and tool-call deltas."""

    plan: ToolPlan
    text: str = ""
    content_sent: int = 0
    region: int | None = None  # where the tool-call part of the text starts, once known
    calls_sent: int = 0
    ids: list[str] = field(default_factory=list)

    def feed(self, delta: str, finished: bool, cut: bool = False) -> tuple[str | None, list[DeltaToolCall]]:
        """Content to send now (None: nothing) and tool-call deltas, after ``delta`` was appended; ``cut``: the
        output ended at ``max_tokens`` (an unfinished call goes out with the arguments written so far)."""
        self.text += delta
        if self.plan.mode == "named":
            return None, self._named_delta(delta)
        if self.plan.mode == "required":
            self.region = 0
        elif self.region is None:
            self.region = self.plan.parser.region_start(self.text)
        if self.region is None:
            end = len(self.text) if finished else self.plan.parser.content_end(self.text)
            return self._content(end), []
        calls, complete = self.plan.region_calls(self.text[self.region:], finished and cut)
        if finished and self.calls_sent == 0 and not (complete and calls):
            return self._content(len(self.text)), []  # not tool calls after all: the rest is content
        return self._content(self.region), [self._call_delta(call) for call in calls[self.calls_sent:]]

    @property
    def called(self) -> bool:
        return self.calls_sent > 0

    def _content(self, end: int) -> str | None:
        if end <= self.content_sent:
            return None
        piece = self.text[self.content_sent:end]
        self.content_sent = end
        return piece

    def _call_delta(self, call: ParsedCall) -> DeltaToolCall:
        tool_call = call.tool_call()
        index = self.calls_sent
        self.calls_sent += 1
        return DeltaToolCall(index=index, id=tool_call.id, type="function",
                             function=DeltaFunctionCall(name=call.name, arguments=call.arguments))

    def _named_delta(self, delta: str) -> list[DeltaToolCall]:
        if self.calls_sent == 0:
            self.calls_sent = 1
            call = ParsedCall(self.plan.named, delta).tool_call()
            return [DeltaToolCall(index=0, id=call.id, type="function",
                                  function=DeltaFunctionCall(name=self.plan.named, arguments=delta))]
        if not delta:
            return []
        return [DeltaToolCall(index=0, function=DeltaFunctionCall(arguments=delta))]


def finish_reason(plan: ToolPlan, reason: str | None, called: bool) -> str | None:
    """OpenAI's: ``tool_calls`` when the model chose to call (auto) or had to call any tool (required); a named
    function keeps ``stop``, and ``length`` stays ``length``."""
    if reason == "stop" and called and plan.mode in ("auto", "required"):
        return "tool_calls"
    return reason


TEMPLATES_DIR = Path(__file__).parent / "templates"


def load_chat_template(value: str) -> str:
    """``--chat-template``: a file, a template shipped in ``hybridkv/server/templates`` (by file name), or the
    template text itself (anything with ``{``), as vLLM takes it."""
    for path in (Path(value).expanduser(), TEMPLATES_DIR / value):
        if path.is_file():
            return path.read_text(encoding="utf-8")
    if "{" in value:
        return value
    shipped = ", ".join(sorted(p.name for p in TEMPLATES_DIR.glob("*.jinja")))
    raise ValueError(f"--chat-template {value!r}: no such file, nor a template (shipped: {shipped})")


def template_renders_tools(source: str | None) -> bool:
    """Whether a chat template reads the ``tools`` variable at all."""
    if not source:
        return False
    import jinja2
    import jinja2.ext
    import jinja2.meta

    try:
        ast = jinja2.Environment(extensions=[jinja2.ext.loopcontrols]).parse(source)
    except jinja2.TemplateSyntaxError:
        return False
    return "tools" in jinja2.meta.find_undeclared_variables(ast)
