"""Render chat templates in a sandbox, byte for byte as transformers renders them.

This module mirrors ``transformers.utils.chat_template_utils`` (transformers 5.24:
``_compile_jinja_template``, ``render_jinja_template`` and the input handling of
``PreTrainedTokenizerBase.apply_chat_template``) without importing transformers:

- an ``ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)`` with the
  ``{% generation %}`` extension and ``jinja2.ext.loopcontrols``;
- the ``tojson`` filter (``json.dumps`` with ``ensure_ascii=False`` by default, plus ``indent``,
  ``separators`` and ``sort_keys``; no HTML escaping), and the ``raise_exception``,
  ``strftime_now``, ``dict`` and ``namespace`` globals;
- the same template variables: ``messages``, ``tools``, ``documents``, ``add_generation_prompt``,
  then every extra keyword (``bos_token``, ``eos_token``, ``enable_thinking``, ...);
- the same input preparation: message keys whose value is ``None`` are dropped, everything is
  rebuilt from plain JSON types, reasoning is aliased (a message's ``reasoning_content`` /
  ``thinking`` / ``reasoning`` is exposed under both ``reasoning_content`` and ``thinking``), and
  ``continue_final_message`` is handled the same way.

Special tokens are NOT looked up anywhere: ``apply_chat_template`` passes the tokenizer's
``special_tokens_map`` (``bos_token``, ``eos_token``, ``unk_token``, ``pad_token``, ...) as template
variables, so a caller who wants identical output passes the same strings as keywords.

``{% generation %}`` blocks render their body unchanged; like transformers' ``AssistantTracker``
they also record ``(start, end)`` character spans, computed the same way (the length of the text
emitted so far when the block closes), so :func:`render_chat_with_spans` returns exactly the
spans ``apply_chat_template(..., return_assistant_tokens_mask=True)`` starts from. That includes
transformers' quirk: a generation block nested inside a macro, a ``{% set %}`` block or a
``{% filter %}`` gets offsets relative to the wrong buffer.

Time limit (chat templates are untrusted code; nested ``range`` loops can run for hours):

1. In the main thread, on platforms with ``signal.setitimer`` and when no ``ITIMER_REAL`` timer
   is already armed, the render runs under ``SIGALRM``; the handler raises only when it
   interrupts template (or Jinja) code, so never inside chatgrammar's own bookkeeping or other
   code. The timer re-fires every 50 ms after the deadline until it lands; afterwards it is
   disarmed and the previous handler restored. Cost: two ``setitimer`` calls per render.
2. Otherwise (another thread, a caller's own timer, no ``setitimer``) the render runs in a daemon
   worker thread; at the deadline the caller stops waiting and raises, and the worker is stopped
   with ``PyThreadState_SetAsyncExc`` (CPython), injected repeatedly for up to a second.
   Cost: one thread start per render (tens of microseconds).
3. In both cases the sandbox's ``call`` / ``getattr`` / ``getitem`` hooks and every emitted
   output block check the deadline as well (cheap, and the only stop that works where 1 and 2
   cannot).

Limits: none of these interrupts a single long C-level operation (a huge string repetition or
``tojson`` of a huge value) before it returns, and memory is not limited. In case 2 a worker stuck
in such an operation keeps running in the background until it returns.
"""
from __future__ import annotations

import contextvars
import dataclasses
import json
import os
import re
import signal
import threading
import time
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
import numpy as np
from jinja2.sandbox import ImmutableSandboxedEnvironment

from chatgrammar.errors import RenderTimeout, TemplateError  # (defined there, re-exported)

__all__ = [
    "special_token_vars",
    "RenderResult",
    "TemplateError",
    "RenderTimeout",
    "compile_template",
    "render_chat",
    "render_chat_with_spans",
    "has_generation_tags",
]

# Names a message's reasoning is passed under; the first is the one most templates read.
# Same tuple, same order as transformers' ``_REASONING_FIELDS``.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# transformers appends this to the continued field, then cuts the rendering at it.
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
# How often the SIGALRM timer re-fires once the deadline has passed.
_REFIRE_SECONDS = 0.05
_GENERATION_TAG_RE = re.compile(r"\{\%-?\s*generation\s*-?\%\}")
_JINJA_DIR = os.path.dirname(jinja2.__file__) + os.sep


class _RaisedByTemplate(jinja2.exceptions.TemplateError):
    """What ``raise_exception`` raises: a jinja2 TemplateError, as in transformers, but tagged."""


class _Deadline(BaseException):
    """Raised inside a render that ran out of time.

    A BaseException so that an ``except Exception`` in code the template calls cannot swallow it.
    """


# ----------------------------------------------------------------------------- render state
@dataclasses.dataclass
class _RenderState:
    """Per-render mutable state, reached by the environment through a ContextVar."""

    deadline: float | None = None  # time.monotonic() value, or None for no limit
    emitted: int = 0  # characters yielded by Template.generate so far
    spans: list[tuple[int, int]] = dataclasses.field(default_factory=list)

    def check(self) -> None:
        if self.deadline is not None and time.monotonic() > self.deadline:
            raise _Deadline()


_STATE: contextvars.ContextVar[_RenderState | None] = contextvars.ContextVar(
    "chatgrammar_render_state", default=None
)


def _check_deadline() -> None:
    state = _STATE.get()
    if state is not None:
        state.check()


# ------------------------------------------------------------------------------ environment
class _GenerationExtension(jinja2.ext.Extension):
    """``{% generation %}…{% endgeneration %}``: renders its body unchanged and records its span.

    Parsed exactly like transformers' ``AssistantTracker`` (a CallBlock around the body), and the
    span is computed the same way, so the recorded spans equal transformers' generation indices.
    """

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.CallBlock:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(
            self.call_method("_generation_support"), [], [], body
        ).set_lineno(lineno)

    @jinja2.pass_eval_context
    def _generation_support(self, context: jinja2.nodes.EvalContext, caller: Any) -> str:
        rv = caller()
        state = _STATE.get()
        if state is not None:
            # transformers: start = len("".join(blocks emitted so far)), end = start + len(rv)
            state.spans.append((state.emitted, state.emitted + len(rv)))
        return rv


class _DeadlineSandbox(ImmutableSandboxedEnvironment):
    """The transformers sandbox, plus a deadline check on every call and attribute/item access.

    The checks do not change what is rendered: each one calls the parent hook unchanged.
    """

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        _check_deadline()
        return super().call(__context, __obj, *args, **kwargs)

    def getattr(self, obj: Any, attribute: str) -> Any:
        _check_deadline()
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        _check_deadline()
        return super().getitem(obj, argument)


def _raise_exception(message: Any) -> None:
    raise _RaisedByTemplate(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # Replaces Jinja's own tojson, which HTML-escapes <, >, & and ' (transformers does the same).
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(format: str) -> str:  # noqa: A002 - the name templates call it with
    return datetime.now().strftime(format)


class _TemplateDict:
    # A stand-in for ``dict`` that exposes no attributes a template could use to reach internals.
    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    # Rejects underscore-prefixed attribute names (the way into CPython internals), as transformers.
    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - Jinja's signature trick
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                "Chat templates cannot store underscore-prefixed attributes on a namespace, but "
                f"got {name!r}. Please rename the attribute."
            )


# Keyed by the template's source (its content: the same text compiles once, whoever reads it
# from wherever); in memory only, nothing compiled is ever written or loaded from disk.
# 512 holds every template a checking run meets (a model's named set, a family's variants,
# the test suite's ~500 real templates), ~50 kB each: 128 let a sweep over many templates
# evict the ones the next check needs again.
@lru_cache(maxsize=512)
def _compile(template: str) -> jinja2.Template:
    env = _DeadlineSandbox(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationExtension, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env.from_string(template)


def compile_template(template: str) -> jinja2.Template:
    """Compile a chat template in the transformers-compatible sandbox (cached).

    Args:
        template: the Jinja source of a chat template.

    Returns:
        The compiled ``jinja2.Template``. The same object is returned for the same source (an LRU
        cache of 512 templates, keyed by the source text), so compiling is paid once.

    Raises:
        TemplateError: ``kind="syntax"`` when the template does not compile.

    Example:
        >>> compile_template("{{ messages[0]['content'] }}").render(messages=[{"content": "hi"}])
        'hi'
    """
    if not isinstance(template, str):
        raise TypeError(f"a chat template is a str, got {type(template).__name__}")
    try:
        return _compile(template)
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise TemplateError(exc.message or str(exc), kind="syntax", lineno=exc.lineno) from exc


def special_token_vars(tokenizer: Any) -> dict:
    """The template variables transformers passes for a tokenizer: the ``str`` entries of its
    ``special_tokens_map`` (``bos_token``, ``eos_token``…); ``{}`` for an object without one.

    Example:
        >>> special_token_vars(None)
        {}
    """
    m = getattr(tokenizer, "special_tokens_map", None)
    if not isinstance(m, dict):
        return {}
    return {k: v for k, v in m.items() if isinstance(v, str)}


def has_generation_tags(template: str) -> bool:
    """Whether a template contains ``{% generation %}`` (the test transformers uses).

    Args:
        template: the Jinja source.

    Returns:
        True when the source contains a ``{% generation %}`` tag (with optional ``-`` trims).

    Example:
        >>> has_generation_tags("{% generation %}{{ m }}{% endgeneration %}")
        True
    """
    return _GENERATION_TAG_RE.search(template) is not None


# --------------------------------------------------------------------------- input handling
_PRIMITIVE = frozenset((str, int, float, bool))


def _plain(value: Any) -> Any:
    """Rebuild a value from plain JSON types (transformers' ``_plain_template_data``).

    Rich objects (arrays, images...) become an inert ``"<TypeName>"`` placeholder so the sandbox
    never sees their methods.
    """
    t = type(value)
    if value is None or t in _PRIMITIVE:
        return value
    # (plain dicts and lists first: the ABC checks below are most of the cost otherwise)
    if t is dict:
        return {_plain(key): _plain(item) for key, item in value.items()}
    if t is list:
        return [_plain(item) for item in value]
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(key): _plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_plain(item) for item in value]
    if isinstance(value, tuple):
        return tuple(_plain(item) for item in value)
    if isinstance(value, np.generic):
        # numpy scalars: np.bool_(False) must not become a truthy placeholder string
        return _plain(value.item())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


def _to_dicts(value: Any) -> Any:
    """Message objects (dataclasses, pydantic models) to dicts (``_message_objects_to_dicts``)."""
    t = type(value)
    if value is None or t in _PRIMITIVE:
        return value
    if t is dict:  # (plain dicts and lists first: the ABC checks below cost more)
        return {key: _to_dicts(item) for key, item in value.items()}
    if t is list:
        return [_to_dicts(item) for item in value]
    if isinstance(value, Mapping):
        return {key: _to_dicts(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_to_dicts(item) for item in value]
    if isinstance(value, tuple):
        return tuple(_to_dicts(item) for item in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _to_dicts(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _to_dicts(value.model_dump())
    return value


def _normalize_messages(messages: Any) -> list[dict]:
    """``apply_chat_template``'s normalisation: objects to dicts, keys valued ``None`` dropped.

    Many templates crash on, or print, ``content=None``, but handle a missing key.
    """
    converted = _to_dicts(getattr(messages, "messages", messages))
    out = []
    for message in converted:
        if not isinstance(message, dict):
            raise TypeError(
                "Chat messages should be dicts, dataclasses or pydantic models, "
                f"but got {message!r}."
            )
        out.append({key: value for key, value in message.items() if value is not None})
    return out


def _alias_reasoning(chat: list[dict]) -> list[dict]:
    # transformers 5.x fills ``reasoning_content`` from older names and ``thinking`` for gpt-oss
    # templates; the dict order (thinking first, reasoning_content last) is the same.
    out = []
    for message in chat:
        reasoning = next(
            (message[key] for key in _REASONING_FIELDS if message.get(key) is not None), None
        )
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def _tool_schemas(tools: Sequence[Any] | None) -> list[dict] | None:
    if tools is None:
        return None
    schemas = []
    for tool in tools:
        if isinstance(tool, dict):
            schemas.append(tool)
        elif callable(tool):
            # Only transformers knows how to turn a typed, documented function into a schema.
            try:
                from transformers.utils import get_json_schema
            except ImportError as exc:  # pragma: no cover - depends on the environment
                raise TypeError(
                    "tools given as functions need transformers (get_json_schema); pass JSON "
                    "schemas (dicts) instead"
                ) from exc
            schemas.append(get_json_schema(tool))
        else:
            raise ValueError(
                "Tools should either be a JSON schema, or a callable function with type hints "
                "and a docstring suitable for auto-conversion to a schema."
            )
    return schemas


# -------------------------------------------------------------------------------- running
def _template_lineno(exc: BaseException) -> int | None:
    # Jinja rewrites tracebacks so that template frames carry the template's file name and line.
    lineno = None
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == "<template>":
            lineno = tb.tb_lineno
        tb = tb.tb_next
    return lineno


def _translate(exc: Exception) -> TemplateError:
    lineno = _template_lineno(exc)
    if isinstance(exc, _RaisedByTemplate):
        return TemplateError(str(exc.message if exc.message is not None else exc),
                             kind="raised", lineno=lineno)
    if isinstance(exc, jinja2.exceptions.TemplateSyntaxError):
        return TemplateError(exc.message or str(exc), kind="syntax", lineno=exc.lineno)
    if isinstance(exc, jinja2.exceptions.UndefinedError):
        return TemplateError(str(exc), kind="undefined", lineno=lineno)
    if isinstance(exc, jinja2.exceptions.SecurityError):
        return TemplateError(str(exc), kind="security", lineno=lineno)
    return TemplateError(f"{type(exc).__name__}: {exc}", kind="runtime", lineno=lineno)


def _render_once(compiled: jinja2.Template, variables: dict, deadline: float | None
                 ) -> tuple[str, list[tuple[int, int]]]:
    """Render with span tracking in the current thread; raises _Deadline when out of time."""
    state = _RenderState(deadline=deadline)
    token = _STATE.set(state)
    try:
        blocks = []
        # generate() yields the same blocks render() joins; iterating lets us count emitted
        # characters (for the spans) and check the deadline between blocks.
        for block in compiled.generate(**variables):
            blocks.append(block)
            state.emitted += len(block)
            state.check()
        return "".join(blocks), state.spans
    finally:
        _STATE.reset(token)


def _can_use_sigalrm() -> bool:
    return (
        hasattr(signal, "setitimer")
        and threading.current_thread() is threading.main_thread()
        and signal.getitimer(signal.ITIMER_REAL)[0] == 0.0
    )


def _is_template_frame(frame: Any) -> bool:
    filename = frame.f_code.co_filename
    return filename == "<template>" or filename.startswith(_JINJA_DIR)


def _render_with_sigalrm(compiled: jinja2.Template, variables: dict, timeout: float
                         ) -> tuple[str, list[tuple[int, int]]]:
    active = [True]

    def on_alarm(signum: int, frame: Any) -> None:
        # Raise only while the render is active AND inside template (or Jinja) code: never in
        # our own bookkeeping, which must run to disarm the timer, nor in unrelated code that
        # happens to run when the signal is handled. A miss is retried by the timer's re-fire
        # interval (and by the cooperative checks).
        if active[0] and frame is not None and _is_template_frame(frame):
            raise _Deadline()

    previous = signal.signal(signal.SIGALRM, on_alarm)
    try:
        signal.setitimer(signal.ITIMER_REAL, timeout, _REFIRE_SECONDS)
        return _render_once(compiled, variables, time.monotonic() + timeout)
    finally:
        active[0] = False
        signal.setitimer(signal.ITIMER_REAL, 0.0, 0.0)
        # getsignal() is None for a handler installed outside Python: restore the default then.
        signal.signal(signal.SIGALRM, previous if previous is not None else signal.SIG_DFL)


def _inject(thread: threading.Thread) -> bool:
    """Raise _Deadline asynchronously in ``thread`` (CPython only)."""
    try:
        import ctypes
    except ImportError:  # pragma: no cover
        return False
    set_async_exc = getattr(getattr(ctypes, "pythonapi", None), "PyThreadState_SetAsyncExc", None)
    if set_async_exc is None or thread.ident is None:  # pragma: no cover - not CPython
        return False
    set_async_exc(ctypes.c_ulong(thread.ident), ctypes.py_object(_Deadline))
    return True


def _render_in_worker(compiled: jinja2.Template, variables: dict, timeout: float
                      ) -> tuple[str, list[tuple[int, int]]]:
    outcome: dict[str, Any] = {}

    def work() -> None:
        try:
            outcome["value"] = _render_once(compiled, variables, time.monotonic() + timeout)
        except _Deadline:
            outcome["deadline"] = True
        except BaseException as exc:  # noqa: BLE001 - handed back to the calling thread
            outcome["error"] = exc

    worker = threading.Thread(target=work, name="chatgrammar-render", daemon=True)
    worker.start()
    worker.join(timeout)
    if worker.is_alive() and not outcome:
        # Stop the runaway worker: re-inject until it dies, in case something swallowed it.
        stop_by = time.monotonic() + 1.0
        # (``not outcome``: never inject into a worker that already caught one and is finishing.)
        while worker.is_alive() and not outcome and time.monotonic() < stop_by:
            if not _inject(worker):
                break
            worker.join(_REFIRE_SECONDS)
        raise RenderTimeout(timeout)
    if "error" in outcome:
        raise outcome["error"]
    if "deadline" in outcome:
        raise RenderTimeout(timeout)
    return outcome["value"]


def _run(compiled: jinja2.Template, variables: dict, timeout: float | None
         ) -> tuple[str, list[tuple[int, int]]]:
    try:
        if timeout is None or timeout <= 0:
            return _render_once(compiled, variables, None)
        if _can_use_sigalrm():
            return _render_with_sigalrm(compiled, variables, timeout)
        return _render_in_worker(compiled, variables, timeout)
    except _Deadline:
        raise RenderTimeout(timeout or 0.0) from None
    except TemplateError:
        raise
    except Exception as exc:  # the template crashed or rejected its input
        raise _translate(exc) from exc


# ------------------------------------------------------------------------------- public API
@dataclasses.dataclass(frozen=True)
class RenderResult:
    """A rendered conversation.

    Attributes:
        text: the rendered text, identical to ``apply_chat_template(..., tokenize=False)``.
        generation_spans: ``(start, end)`` character spans (half-open) of every
            ``{% generation %}`` block, in the order the blocks closed, exactly as transformers'
            ``AssistantTracker`` records them; empty when the template has no such tag.
    """

    text: str
    generation_spans: tuple[tuple[int, int], ...] = ()

    def generation_text(self) -> list[str]:
        """The text of each generation span (handy in assertions and error messages)."""
        return [self.text[start:end] for start, end in self.generation_spans]


def _tag_final_message(chat: list, continue_final_message: bool | str, template: str) -> Any:
    """Tag the field of ``chat``'s final message that the model continues (in place, on the
    caller's fresh copy) and return its untagged value, as transformers does.

    Raises:
        ValueError: the final message has no such field, the template never reads it, or it
            holds no text block to continue.
    """
    field = continue_final_message if isinstance(continue_final_message, str) else "content"
    final_message = chat[-1].get(field)
    if final_message is None:
        raise ValueError(
            f'continue_final_message is set but the final message has no "{field}" to continue!'
        )
    fields = [field]
    if field in _REASONING_FIELDS:
        # Reasoning is copied under several names: tag each copy the template might read.
        fields = [f for f in _REASONING_FIELDS if chat[-1].get(f) == final_message]
    if not any(f in template for f in fields):
        raise ValueError(f'continue_final_message is set to "{field}" but this is not an '
                         "accepted field in the chat_template")
    if isinstance(final_message, (list, tuple)):
        for block in reversed(final_message):
            if "text" in block:
                final_message = block["text"]
                block["text"] = block["text"] + _CONTINUE_TAG
                break
        else:
            raise ValueError("continue_final_message is set but we could not find any text "
                             "to continue in the final message!")
    else:
        for f in fields:
            chat[-1][f] = chat[-1][f] + _CONTINUE_TAG
    return final_message


def _cut_continued(text: str, final_message: str) -> str:
    """The rendering cut at the continue tag (the final message left open).

    Raises:
        TemplateError: (``kind="continue"``) the template deleted or rewrote the final message.
    """
    if final_message.strip() not in text or _CONTINUE_TAG.strip() not in text:
        raise TemplateError(
            "continue_final_message is set but the final message does not appear in the "
            "rendering: the template deletes or rewrites part of it",
            kind="continue",
        )
    tag_at = text.rindex(_CONTINUE_TAG.strip())
    if text[tag_at:tag_at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return text[:tag_at]
    # The template trimmed the tag's trailing space: cut more cautiously, as transformers.
    return text[:tag_at].rstrip()


def render_chat_with_spans(
    template: str,
    messages: Any,
    *,
    tools: Sequence[Any] | None = None,
    documents: Sequence[dict] | None = None,
    add_generation_prompt: bool = False,
    continue_final_message: bool | str = False,
    timeout: float | None = 10.0,
    **template_kwargs: Any,
) -> RenderResult:
    """Render a conversation with a chat template; also return the ``{% generation %}`` spans.

    Args:
        template: the Jinja source of the chat template.
        messages: the conversation: a list of message dicts (or dataclasses / pydantic models, or
            an object with a ``messages`` attribute). Keys whose value is ``None`` are dropped,
            like ``apply_chat_template`` does. The caller's objects are never modified.
        tools: JSON schemas of the tools (dicts); functions are converted with transformers'
            ``get_json_schema`` when transformers is installed.
        documents: RAG documents (a list of dicts), passed through as ``documents``.
        add_generation_prompt: append the assistant header that prompts a new reply.
        continue_final_message: leave the final message open so a model continues it; ``True``
            continues its ``content``, a string names the field to continue (e.g.
            ``"reasoning_content"``). Incompatible with ``add_generation_prompt``.
        timeout: the render's time limit in seconds; ``None`` or ``<= 0`` for none. See the
            module docstring for how it is enforced and its limits.
        **template_kwargs: extra template variables: special tokens (``bos_token="<s>"``,
            ``eos_token=...``; transformers passes the tokenizer's ``special_tokens_map``) and
            template switches (``enable_thinking=False``, ``thinking=True``, ...).

    Returns:
        A :class:`RenderResult` with the text (byte-identical to transformers' rendering given the
        same inputs) and the generation spans.

    Raises:
        TemplateError: the template does not compile (``kind="syntax"``), rejects the
            conversation (``kind="raised"``, with the template's message), crashes
            (``"runtime"``, ``"undefined"``, ``"security"``), or the final message cannot be
            continued (``"continue"``).
        RenderTimeout: the render did not finish within ``timeout`` seconds.
        ValueError: empty conversation, or ``continue_final_message`` together with
            ``add_generation_prompt``, or the continued field is missing.
        TypeError: a message is not a dict (or convertible to one).

    Example:
        >>> tpl = ("{% for m in messages %}<|{{ m.role }}|>{% if m.role == 'assistant' %}"
        ...        "{% generation %}{{ m.content }}<|end|>{% endgeneration %}"
        ...        "{% else %}{{ m.content }}<|end|>{% endif %}{% endfor %}")
        >>> r = render_chat_with_spans(tpl, [{"role": "user", "content": "hi"},
        ...                                  {"role": "assistant", "content": "yo"}])
        >>> r.text, r.generation_text()
        ('<|user|>hi<|end|><|assistant|>yo<|end|>', ['yo<|end|>'])
    """
    compiled = compile_template(template)
    chat = _normalize_messages(messages)
    if not chat:
        raise ValueError("Cannot apply chat template to an empty conversation. "
                         "Provide at least one message.")
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message and add_generation_prompt are not compatible.")

    tool_schemas = _plain(_tool_schemas(tools))
    if documents is not None:
        for document in documents:
            if not isinstance(document, dict):
                raise TypeError("Documents should be a list of dicts with 'title' and 'text' keys!")
    docs = _plain(documents)
    extra = _plain(template_kwargs)
    chat = _alias_reasoning(_plain(chat))  # a fresh copy: the edits below never leak out

    final_message = _tag_final_message(chat, continue_final_message, template) \
        if continue_final_message else None

    variables = {
        "messages": chat,
        "tools": tool_schemas,
        "documents": docs,
        "add_generation_prompt": add_generation_prompt,
        **extra,
    }
    text, spans = _run(compiled, variables, timeout)

    if continue_final_message:
        text = _cut_continued(text, final_message)
    return RenderResult(text=text, generation_spans=tuple(spans))


def render_chat(template: str, messages: Any, **options: Any) -> str:
    """Render a conversation with a chat template, exactly as transformers does.

    Equivalent to ``tokenizer.apply_chat_template(messages, tokenize=False, ...)`` for a tokenizer
    whose ``chat_template`` is ``template``, when the tokenizer's special tokens are passed as
    keywords. See :func:`render_chat_with_spans` for the arguments.

    Args:
        template: the Jinja source of the chat template.
        messages: the conversation (a list of message dicts).
        **options: the keyword arguments of :func:`render_chat_with_spans` (``tools``,
            ``documents``, ``add_generation_prompt``, ``continue_final_message``, ``timeout``),
            and the special tokens (``bos_token``, ``eos_token``...) and template switches.

    Returns:
        The rendered text.

    Raises:
        TemplateError: the template does not compile, rejects the conversation or crashes.
        RenderTimeout: the render exceeded ``timeout``.
        ValueError, TypeError: invalid arguments (see :func:`render_chat_with_spans`).

    Example:
        >>> render_chat("{{ bos_token }}{% for m in messages %}[{{ m.role }}] {{ m.content }}\\n"
        ...             "{% endfor %}", [{"role": "user", "content": "hi"}], bos_token="<s>")
        '<s>[user] hi\\n'
    """
    return render_chat_with_spans(template, messages, **options).text
