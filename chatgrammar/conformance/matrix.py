"""The built-in conversation matrix: the conversations every chat template is rendered with.

``chatgrammar validate --template FILE`` and the conformance runner render each case with a real
chat template (:mod:`chatgrammar.conformance.render`) and check that the format's grammar parses the result
and trains exactly the assistant output. The matrix covers the shapes real data has: with and
without a system message, single and multi-turn, tools declared, assistant tool calls (arguments
as a dict and as a JSON string, parallel calls) and tool results, reasoning
(``reasoning_content``) with thinking switched on and off, unicode (CJK, emoji, right-to-left),
empty assistant content, content as a list of text parts, markup-like characters (``"`` ``&``
``<`` ``>`` ``'``), multi-line content, and a trailing generation prompt.

Conventions every case follows, so that one matrix fits many templates:

- messages use the OpenAI / transformers layout; tool calls are
  ``{"id", "type": "function", "function": {"name", "arguments"}}``, tool results are
  ``{"role": "tool", "tool_call_id", "name", "content"}``;
- tool-call ids are exactly 9 alphanumeric characters (``call00001``): Mistral templates raise on
  anything else;
- assistant output strings have no leading or trailing whitespace (many templates ``trim`` them)
  and tool-call argument values are plain ASCII words, so they appear verbatim whether a template
  prints arguments as JSON, as XML parameters or as ``key=value``.

Each case knows its expected assistant output (:class:`AssistantOutput`: content, reasoning and
tool calls per assistant message) so a checker can compare it with the text a mask trains.
Templates drop parts of it on purpose (historical reasoning, reasoning when thinking is off), so
the expectation is what the conversation *contains*, not what every template *prints*.
"""
from __future__ import annotations

import copy
import dataclasses
import json
from collections.abc import Iterable, Iterator
from functools import lru_cache
from typing import Any, NamedTuple

from chatgrammar.conformance.render import RenderResult, TemplateError, compile_template, render_chat_with_spans

__all__ = [
    "AssistantOutput",
    "ToolCallOutput",
    "MatrixCase",
    "RenderedCase",
    "TOOLS",
    "default_matrix",
    "as_parts",
    "get_case",
    "case_names",
    "render_case",
    "iter_renderable",
    "missing_outputs",
]

# --------------------------------------------------------------------------------- tools
TOOLS: tuple[dict, ...] = (
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the current weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "The city name."},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"],
                             "description": "The temperature unit."},
                },
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search_web",
            "description": "Search the web and return the top results.",
            "parameters": {
                "type": "object",
                "properties": {
                    "query": {"type": "string", "description": "The search query."},
                    "limit": {"type": "integer", "description": "How many results."},
                },
                "required": ["query"],
            },
        },
    },
)


# ------------------------------------------------------------------------ expected output
@dataclasses.dataclass(frozen=True)
class ToolCallOutput:
    """One tool call an assistant message makes.

    Attributes:
        name: the function name.
        arguments: the arguments as given in the message (a dict, or a JSON string).
        id: the tool-call id (9 alphanumeric characters).
    """

    name: str
    arguments: Any
    id: str

    @property
    def argument_dict(self) -> dict:
        """The arguments as a dict (a JSON-string argument is decoded)."""
        if isinstance(self.arguments, str):
            return json.loads(self.arguments)
        return dict(self.arguments)

    def strings(self) -> list[str]:
        """The name and every leaf argument value, as text a rendering must contain."""
        out = [self.name]
        for value in self.argument_dict.values():
            out.append(value if isinstance(value, str) else json.dumps(value))
        return out


@dataclasses.dataclass(frozen=True)
class AssistantOutput:
    """What one assistant message says: the text a loss mask must train for it.

    Attributes:
        message_index: index of the assistant message in ``MatrixCase.messages``.
        content: its content (``""`` for empty or missing content, the concatenated text parts
            for list content; never ``None``).
        reasoning: its ``reasoning_content``, or None.
        tool_calls: its tool calls, in order.
    """

    message_index: int
    content: str
    reasoning: str | None = None
    tool_calls: tuple[ToolCallOutput, ...] = ()

    def strings(self, *, reasoning: bool = True) -> list[str]:
        """Non-empty strings the rendering of this message should contain.

        Args:
            reasoning: include the reasoning (templates drop it from history or when thinking
                is off; pass False for those).

        Returns:
            content, reasoning (optionally), then each tool call's name and argument values.
        """
        out = [self.content] if self.content else []
        if reasoning and self.reasoning:
            out.append(self.reasoning)
        for call in self.tool_calls:
            out.extend(call.strings())
        return out


def _outputs(messages: list[dict]) -> tuple[AssistantOutput, ...]:
    outputs = []
    for index, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        calls = tuple(
            ToolCallOutput(name=c["function"]["name"], arguments=c["function"]["arguments"],
                           id=c["id"])
            for c in message.get("tool_calls") or ()
        )
        content = message.get("content")
        if isinstance(content, list):
            # content parts: the text a template prints is the concatenation of the text parts
            content = "".join(part.get("text", "") for part in content if isinstance(part, dict))
        outputs.append(AssistantOutput(
            message_index=index,
            content=content if isinstance(content, str) else "",
            reasoning=message.get("reasoning_content"),
            tool_calls=calls,
        ))
    return tuple(outputs)


# --------------------------------------------------------------------------------- cases
@dataclasses.dataclass(frozen=True)
class MatrixCase:
    """One conversation of the matrix.

    Attributes:
        name: kebab-case id (``"tool-call-string-args"``).
        description: one line saying what the case exercises.
        messages: the conversation (message dicts). Treat as read-only; ``default_matrix()`` hands
            out fresh copies.
        tools: tool schemas declared to the template, or None.
        add_generation_prompt: whether to append the assistant generation prompt.
        template_kwargs: template switches (``enable_thinking``, ``thinking``...).
        tags: what the case exercises (``"system"``, ``"tools"``, ``"tool-calls"``,
            ``"reasoning"``, ``"thinking-off"``, ``"unicode"``...), for selecting subsets.
        outputs: the expected assistant output, one entry per assistant message (derived from
            ``messages``).
    """

    name: str
    description: str
    messages: list[dict]
    tools: list[dict] | None = None
    add_generation_prompt: bool = False
    template_kwargs: dict = dataclasses.field(default_factory=dict)
    tags: frozenset[str] = frozenset()
    outputs: tuple[AssistantOutput, ...] = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "outputs", _outputs(self.messages))

    def render_kwargs(self) -> dict:
        """Keyword arguments for :func:`chatgrammar.conformance.render.render_chat` (tools, flags, switches).

        Returns:
            ``{"tools": ..., "add_generation_prompt": ..., **template_kwargs}`` (deep copies).
        """
        return {
            "tools": copy.deepcopy(self.tools),
            "add_generation_prompt": self.add_generation_prompt,
            **copy.deepcopy(self.template_kwargs),
        }


def _call(call_id: str, name: str, arguments: Any) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _tool_result(call_id: str, name: str, content: str) -> dict:
    return {"role": "tool", "tool_call_id": call_id, "name": name, "content": content}


_SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
_WEATHER_RESULT = '{"temperature": 22, "condition": "sunny"}'
_THINK_ON = {"enable_thinking": True, "thinking": True}
_THINK_OFF = {"enable_thinking": False, "thinking": False}


def _u(text: str) -> dict:
    return {"role": "user", "content": text}


def _a(text: str, **kw: Any) -> dict:
    return {"role": "assistant", "content": text, **kw}


def _conversation_cases() -> list[MatrixCase]:
    """Plain conversations: with and without a system message, one or several exchanges."""
    return [
        MatrixCase(
            "basic", "system, one user message, one assistant reply",
            [_SYSTEM, _u("What is the capital of France?"), _a("The capital of France is Paris.")],
            tags=frozenset({"system", "single-turn"}),
        ),
        MatrixCase(
            "no-system", "one exchange without a system message",
            [_u("Hello, who are you?"), _a("I am an assistant.")],
            tags=frozenset({"single-turn"}),
        ),
        MatrixCase(
            "multi-turn", "system and three exchanges",
            [_SYSTEM,
             _u("Name a primary color."), _a("Red is a primary color."),
             _u("Name another one."), _a("Blue is another primary color."),
             _u("And the last one?"), _a("The last one is yellow.")],
            tags=frozenset({"system", "multi-turn"}),
        ),
        MatrixCase(
            "multi-turn-no-system", "four exchanges without a system message",
            [_u("Count to one."), _a("One."),
             _u("Now to two."), _a("One, two."),
             _u("Now to three."), _a("One, two, three."),
             _u("Now to four."), _a("One, two, three, four.")],
            tags=frozenset({"multi-turn"}),
        ),
    ]


def _tool_cases() -> list[MatrixCase]:
    """Tools declared, tool calls (dict and string arguments, with text, parallel), results."""
    weather_args = {"city": "Paris", "unit": "celsius"}
    return [
        MatrixCase(
            "tools-declared", "tools declared, plain answer without a call",
            [_SYSTEM, _u("Say hi."), _a("Hi there!")],
            tools=list(TOOLS),
            tags=frozenset({"system", "tools"}),
        ),
        MatrixCase(
            "tool-call", "a tool call with dict arguments, its result, then the final answer",
            [_SYSTEM, _u("What is the weather in Paris?"),
             _a("", tool_calls=[_call("call00001", "get_weather", weather_args)]),
             _tool_result("call00001", "get_weather", _WEATHER_RESULT),
             _a("It is sunny and 22 degrees in Paris.")],
            tools=list(TOOLS),
            tags=frozenset({"system", "tools", "tool-calls", "tool-results"}),
        ),
        MatrixCase(
            "tool-call-string-args", "as tool-call, with the arguments as a JSON string",
            [_SYSTEM, _u("What is the weather in Paris?"),
             _a("", tool_calls=[_call("call00001", "get_weather", json.dumps(weather_args))]),
             _tool_result("call00001", "get_weather", _WEATHER_RESULT),
             _a("It is sunny and 22 degrees in Paris.")],
            tools=list(TOOLS),
            tags=frozenset({"system", "tools", "tool-calls", "tool-results", "string-args"}),
        ),
        MatrixCase(
            "tool-call-with-content", "assistant text before its tool call, no system message",
            [_u("Find news about Mars."),
             _a("Let me search for that.",
               tool_calls=[_call("call00002", "search_web", {"query": "Mars news", "limit": 3})]),
             _tool_result("call00002", "search_web", "Rover finds water ice."),
             _a("A rover found water ice on Mars.")],
            tools=list(TOOLS),
            tags=frozenset({"tools", "tool-calls", "tool-results", "content-and-calls"}),
        ),
        MatrixCase(
            "parallel-tool-calls", "two tool calls in one message and two results",
            [_SYSTEM, _u("Weather in Paris and in Rome?"),
             _a("", tool_calls=[_call("call00003", "get_weather", {"city": "Paris"}),
                               _call("call00004", "get_weather", {"city": "Rome"})]),
             _tool_result("call00003", "get_weather", '{"temperature": 22}'),
             _tool_result("call00004", "get_weather", '{"temperature": 27}'),
             _a("Paris is at 22 degrees and Rome at 27.")],
            tools=list(TOOLS),
            tags=frozenset({"system", "tools", "tool-calls", "tool-results", "parallel-calls"}),
        ),
    ]


def _reasoning_cases() -> list[MatrixCase]:
    """Reasoning content and the thinking switches, alone and before a tool call."""
    return [
        MatrixCase(
            "reasoning", "reasoning_content on two assistant turns (history and last)",
            [_SYSTEM,
             _u("What is 2 + 2?"),
             _a("2 + 2 = 4.",
                reasoning_content="The user asks a simple sum. Two plus two is four."),
             _u("And 3 + 3?"),
             _a("3 + 3 = 6.", reasoning_content="Another sum. Three plus three is six.")],
            tags=frozenset({"system", "multi-turn", "reasoning"}),
        ),
        MatrixCase(
            "reasoning-thinking-on", "reasoning with enable_thinking / thinking switched on",
            [_u("Is 7 prime?"),
             _a("Yes, 7 is prime.", reasoning_content="7 has no divisors besides 1 and 7.")],
            template_kwargs=dict(_THINK_ON),
            tags=frozenset({"reasoning", "thinking-on"}),
        ),
        MatrixCase(
            "reasoning-thinking-off", "no reasoning, enable_thinking / thinking switched off",
            [_u("Is 9 prime?"), _a("No, 9 = 3 x 3.")],
            template_kwargs=dict(_THINK_OFF),
            tags=frozenset({"thinking-off"}),
        ),
        MatrixCase(
            "reasoning-tool-call", "reasoning before a tool call, then a final answer",
            [_SYSTEM, _u("Should I take an umbrella in Paris?"),
             _a("", reasoning_content="I need the weather in Paris first.",
               tool_calls=[_call("call00005", "get_weather", {"city": "Paris"})]),
             _tool_result("call00005", "get_weather", _WEATHER_RESULT),
             _a("No umbrella needed: it is sunny.",
               reasoning_content="Sunny weather means no rain.")],
            tools=list(TOOLS),
            tags=frozenset({"system", "tools", "tool-calls", "tool-results", "reasoning"}),
        ),
    ]


def _content_cases() -> list[MatrixCase]:
    """Content shapes (unicode, empty, special characters, parts) and generation prompts."""
    return [
        MatrixCase(
            "unicode", "CJK, emoji (with a ZWJ sequence) and right-to-left text",
            [{"role": "system", "content": "你是一个有帮助的助手。"},
             _u("你好！Translate: שלום, مرحبا 👋"),
             _a("你好，世界！🌍🚀 👩\u200d💻 שלום עולם — مرحبا بالعالم")],
            tags=frozenset({"system", "unicode"}),
        ),
        MatrixCase(
            "empty-assistant", "an assistant turn with empty content, then a normal one",
            [_u("Say nothing."), _a(""), _u("Now say something."), _a("Something.")],
            tags=frozenset({"multi-turn", "empty-content"}),
        ),
        MatrixCase(
            "special-chars", "quotes, ampersands and angle brackets in every role",
            [{"role": "system", "content": 'Answer with "quotes" & <tags> intact.'},
             _u('Is 1 < 2 && 3 > 2? Say "yes" or \'no\'.'),
             _a('Yes: 1 < 2 && 3 > 2 is "true" & <b>bold</b>.')],
            tags=frozenset({"system", "special-chars"}),
        ),
        MatrixCase(
            "multiline", "multi-line content with a code block and blank lines",
            [_SYSTEM,
             _u("Write a Python function.\nIt should add two numbers."),
             _a("Here it is:\n\n```python\ndef add(a, b):\n    return a + b\n```\n\nDone.")],
            tags=frozenset({"system", "multiline"}),
        ),
        MatrixCase(
            "content-parts", "content as a list of text parts (the multimodal message layout)",
            [{"role": "system",
              "content": [{"type": "text", "text": "You are a helpful assistant."}]},
             {"role": "user", "content": [{"type": "text", "text": "Describe the sky."}]},
             {"role": "assistant", "content": [{"type": "text", "text": "The sky is blue."}]}],
            tags=frozenset({"system", "content-parts"}),
        ),
        MatrixCase(
            "generation-prompt", "ends with a user message; add_generation_prompt=True",
            [_SYSTEM, _u("Hello!"), _a("Hi! How can I help?"), _u("Tell me a joke.")],
            add_generation_prompt=True,
            tags=frozenset({"system", "multi-turn", "generation-prompt"}),
        ),
        MatrixCase(
            "generation-prompt-thinking-off", "generation prompt with thinking switched off",
            [_u("Tell me a joke.")],
            add_generation_prompt=True,
            template_kwargs=dict(_THINK_OFF),
            tags=frozenset({"generation-prompt", "thinking-off"}),
        ),
    ]


def _build() -> list[MatrixCase]:
    return _conversation_cases() + _tool_cases() + _reasoning_cases() + _content_cases()


_MATRIX = _build()
_BY_NAME = {case.name: case for case in _MATRIX}


def default_matrix(tags: Iterable[str] | None = None, *,
                   content: str = "string") -> list[MatrixCase]:
    """The built-in matrix, as fresh deep copies (rendering never sees shared objects).

    Args:
        tags: keep only the cases carrying all of these tags (``None``: every case).
        content: ``"string"`` (the cases as written), ``"parts"``: every string content
            given as a list of one text part (:func:`as_parts`), for a template that prints
            content only in the multimodal layout, or ``"sharegpt"``: every message also
            with ShareGPT's ``from`` / ``value`` keys (:func:`as_sharegpt`).

    Returns:
        The cases, in a fixed order.

    Raises:
        ValueError: ``content`` is not ``"string"``, ``"parts"`` or ``"sharegpt"``.

    Example:
        >>> [c.name for c in default_matrix(tags={"parallel-calls"})]
        ['parallel-tool-calls']
        >>> default_matrix(tags={"parallel-calls"}, content="parts")[0].messages[0]["content"]
        [{'type': 'text', 'text': 'You are a helpful assistant.'}]
    """
    if content not in ("string", "parts", "sharegpt"):
        raise ValueError(f"content must be 'string', 'parts' or 'sharegpt', not {content!r}")
    wanted = frozenset(tags or ())
    cases = [copy.deepcopy(case) for case in _MATRIX if wanted <= case.tags]
    if content == "sharegpt":
        return [as_sharegpt(c) for c in cases]
    return [as_parts(c) for c in cases] if content == "parts" else cases


def as_parts(case: MatrixCase) -> MatrixCase:
    """The same case (same name, same expected outputs) with every string ``content`` given
    as a list of one text part, ``[{"type": "text", "text": content}]`` (the layout of
    multimodal datasets; ``content-parts`` is already so).

    Args:
        case: a matrix case.

    Returns:
        A new case; ``case`` is not changed.

    Example:
        >>> as_parts(get_case("basic")).messages[1]["content"]
        [{'type': 'text', 'text': 'What is the capital of France?'}]
    """
    msgs = [{**m, "content": [{"type": "text", "text": m["content"]}]}
            if isinstance(m.get("content"), str) else m for m in copy.deepcopy(case.messages)]
    return dataclasses.replace(case, messages=msgs)


#: ShareGPT's speaker names (the ``from`` key) for the matrix roles, as the ShareGPT templates
#: of axolotl / unsloth fine-tunes read them (``message['from'] == 'human'``).
SHAREGPT_FROM = {"system": "system", "user": "human", "assistant": "gpt", "tool": "tool"}


def as_sharegpt(case: MatrixCase) -> MatrixCase:
    """The same case (same name, same expected outputs) with every message also given in
    ShareGPT's keys: ``from`` (:data:`SHAREGPT_FROM`) and ``value`` (the content), beside
    ``role`` and ``content`` (for a template that reads ``message['from']`` /
    ``message['value']`` only: the layout of ShareGPT datasets).

    Args:
        case: a matrix case.

    Returns:
        A new case; ``case`` is not changed.

    Example:
        >>> m = as_sharegpt(get_case("basic")).messages[1]
        >>> m["from"], m["value"]
        ('human', 'What is the capital of France?')
    """
    msgs = [{**m, "from": SHAREGPT_FROM.get(m.get("role"), m.get("role")),
             "value": m.get("content")} for m in copy.deepcopy(case.messages)]
    return dataclasses.replace(case, messages=msgs)


def case_names() -> list[str]:
    """The names of the built-in cases, in order.

    Returns:
        A list of kebab-case names.

    Example:
        >>> case_names()[:2]
        ['basic', 'no-system']
    """
    return [case.name for case in _MATRIX]


def get_case(name: str) -> MatrixCase:
    """One built-in case by name (a fresh copy).

    Args:
        name: the case name.

    Returns:
        The case.

    Raises:
        KeyError: no such case (the message lists the known names).

    Example:
        >>> get_case("tool-call").outputs[0].tool_calls[0].name
        'get_weather'
    """
    return copy.deepcopy(shared_case(name))


def shared_case(name: str) -> MatrixCase:
    """The built-in case itself, not a copy: for code of the package that only reads it (the
    checkers look a case up by name for every case they re-check; a deep copy each time was a
    fair share of their cost). Never change what it returns.

    Args:
        name: the case name.

    Returns:
        The shared case (:func:`get_case` returns a copy of it).

    Raises:
        KeyError: no such case (the message lists the known names).

    Example:
        >>> shared_case("basic") is shared_case("basic")
        True
    """
    try:
        return _BY_NAME[name]
    except KeyError:
        raise KeyError(f"unknown matrix case {name!r}; known: {', '.join(_BY_NAME)}") from None


@lru_cache(maxsize=None)  # one entry per content shape
def shared_matrix(content: str = "string") -> tuple[MatrixCase, ...]:
    """The built-in matrix in one content shape, copied once and shared: for code of the
    package that only reads the cases (every render rebuilds the messages it is given), where
    the fresh copies :func:`default_matrix` hands out for each call are not needed. Never
    change what it returns.

    Args:
        content: ``"string"``, ``"parts"`` or ``"sharegpt"``, as for :func:`default_matrix`.

    Returns:
        A tuple of the shared cases, in order.

    Raises:
        ValueError: an unknown ``content`` shape.

    Example:
        >>> [c.name for c in shared_matrix()] == case_names()
        True
    """
    return tuple(default_matrix(content=content))


# ------------------------------------------------------------------------------- running
class RenderedCase(NamedTuple):
    """One case rendered with one template.

    Unpacks as ``case, text, reason``: ``text`` is the rendering and ``reason`` is None, or
    ``text`` is None and ``reason`` says why the template rejected the case, prefixed with the
    error kind (``"[raised] Conversation roles must alternate user/assistant/..."``, or
    ``"[timeout] ..."`` for a render that ran out of time, which is a template problem rather
    than a shape it rejects).
    """

    case: MatrixCase
    text: str | None
    reason: str | None = None

    @property
    def rejected(self) -> bool:
        """True when the template rejected (or failed on) this case."""
        return self.text is None


def render_case(template: str, case: MatrixCase, *, timeout: float | None = 10.0,
                **special_tokens: Any) -> RenderResult:
    """Render one matrix case with a template.

    Args:
        template: the Jinja source of the chat template.
        case: the case.
        timeout: render time limit in seconds.
        **special_tokens: template variables such as ``bos_token`` / ``eos_token``; a case's own
            ``template_kwargs`` win over them if both name the same variable.

    Returns:
        The :class:`~chatgrammar.conformance.render.RenderResult` (text and generation spans).

    Raises:
        TemplateError: the template rejects the case or fails (including ``RenderTimeout``).

    Example:
        >>> render_case("{{ messages|length }}", get_case("basic")).text
        '3'
    """
    # (no copies of the case's messages, tools and switches: rendering rebuilds what it is
    # given from plain values and never changes the caller's objects)
    return render_chat_with_spans(
        template, case.messages, timeout=timeout,
        **{**special_tokens, "tools": case.tools,
           "add_generation_prompt": case.add_generation_prompt, **case.template_kwargs},
    )


def iter_renderable(template: str, cases: Iterable[MatrixCase] | None = None, *,
                    timeout: float | None = 10.0, **special_tokens: Any
                    ) -> Iterator[RenderedCase]:
    """Render every case with a template, reporting the shapes the template rejects.

    Args:
        template: the Jinja source of the chat template.
        cases: the cases to render (default: :func:`default_matrix`).
        timeout: per-case render time limit in seconds.
        **special_tokens: template variables passed to every render (``bos_token="<s>"``...).

    Yields:
        A :class:`RenderedCase` per case: ``(case, text, None)`` when it renders,
        ``(case, None, reason)`` when the template raises on it (``raise_exception``, a crash on
        an unsupported shape, or a timeout).

    Raises:
        TemplateError: ``kind="syntax"``, once, when the template does not compile.

    Example:
        >>> tpl = ("{% if messages[0].role == 'system' %}{{ raise_exception('no system') }}"
        ...        "{% endif %}ok")
        >>> [(r.case.name, r.text, r.reason) for r in iter_renderable(
        ...     tpl, [get_case("basic"), get_case("no-system")])]
        [('basic', None, '[raised] no system'), ('no-system', 'ok', None)]
    """
    compile_template(template)  # a syntax error is the template's problem, not a case's
    for case in default_matrix() if cases is None else cases:
        try:
            result = render_case(template, case, timeout=timeout, **special_tokens)
        except TemplateError as exc:
            yield RenderedCase(case, None, f"[{exc.kind}] {exc.message}")
        else:
            yield RenderedCase(case, result.text, None)


def missing_outputs(case: MatrixCase, text: str, *, reasoning: bool = False) -> list[str]:
    """The expected assistant strings of a case that a rendering does not contain.

    A quick sanity check (a template that silently drops assistant content shows up here);
    reasoning is left out by default because many templates drop it from history by design.

    Args:
        case: the case.
        text: its rendering.
        reasoning: also require the reasoning strings.

    Returns:
        The missing strings, in message order (empty when everything is there).

    Example:
        >>> missing_outputs(get_case("basic"), "... The capital of France is Paris. ...")
        []
    """
    return [s for out in case.outputs for s in out.strings(reasoning=reasoning) if s not in text]

