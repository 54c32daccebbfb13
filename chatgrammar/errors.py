"""The exception hierarchy: one root, structured fields, rendered at the edge.

Every error carries the fields a caller needs to act on it (file/line/col and YAML path for
specs; offset, expected markers and an excerpt for parses) and renders them in ``str()``.
"""
from __future__ import annotations

from typing import Sequence


class ChatGrammarError(Exception):
    """Root of every error chatgrammar raises on purpose."""


class SpecError(ChatGrammarError):
    """A format spec (YAML) is malformed: syntax, schema or semantic rule.

    Attributes:
        message: what is wrong.
        file: the spec file (or ``<string>``).
        line, col: 1-based position of the offending node, when known.
        path: the YAML path (``turns[2].close``), when known.
    """

    def __init__(self, message: str, *, file: str | None = None, line: int | None = None,
                 col: int | None = None, path: str | None = None):
        self.message = message
        self.file = file
        self.line = line
        self.col = col
        self.path = path
        super().__init__(self.render())

    def render(self) -> str:
        where = self.file or "<spec>"
        if self.line is not None:
            where += f":{self.line}:{self.col or 1}"
        if self.path:
            where += f": {self.path}"
        return f"{where}: {self.message}"


class CompileError(SpecError):
    """A spec is well-formed but does not compile to an unambiguous LALR grammar,
    or a content pattern can swallow a marker."""


class ParseError(ChatGrammarError):
    """Input text or ids do not fit the format's grammar.

    Attributes:
        message: what went wrong.
        offset: char offset (text mode) or token index (id mode) of the problem.
        expected: the markers / constructs that would have been accepted there, in spec terms.
        found: what was found instead.
        excerpt: a short rendering of the input around ``offset`` with a caret.
        mode: ``"text"`` or ``"ids"``.
        format: the format name.
    """

    def __init__(self, message: str, *, offset: int | None = None,
                 expected: Sequence[str] = (), found: str | None = None,
                 excerpt: str | None = None, mode: str = "text", format: str | None = None):
        self.message = message
        self.offset = offset
        self.expected = list(expected)
        self.found = found
        self.excerpt = excerpt
        self.mode = mode
        self.format = format
        super().__init__(self.render())

    def render(self) -> str:
        unit = "char" if self.mode == "text" else "token"
        head = f"{self.format + ': ' if self.format else ''}{self.message}"
        if self.offset is not None:
            head += f" at {unit} {self.offset}"
        if self.found is not None:
            head += f"; found {self.found}"
        if self.expected:
            head += "; expected one of: " + ", ".join(self.expected)
        if self.excerpt:
            head += "\n" + self.excerpt
        return head


class DetectionError(ChatGrammarError):
    """No bundled or plugin format matches a tokenizer / chat template, or the match
    is ambiguous.

    Attributes:
        message: what went wrong (its first line is a one-line summary).
        candidates: the nearest formats, best first (no match), or the formats in conflict.
        evidence: per format name, what was looked for and what was found
            (the ``evidence`` of :class:`chatgrammar.core.detect.Detection`).
    """

    def __init__(self, message: str, *, candidates: Sequence[str] = (),
                 evidence: dict | None = None):
        self.message = message
        self.candidates = list(candidates)
        self.evidence = dict(evidence or {})
        super().__init__(message)


# Errors of later stages, defined here so that every error of the package has one home; their
# modules re-export them (``chatgrammar.core.detect.PrecedenceError``, ``chatgrammar.conformance.render.
# TemplateError`` / ``RenderTimeout``, ``chatgrammar.runtime.tokenizers.TokenizerLoadError``). Not in
# ``__all__``, which lists what ``chatgrammar`` itself exports.

class PrecedenceError(SpecError, DetectionError):
    """The precedence declared across a set of formats is not a total order where detectors
    overlap: two formats can match one input without an order, a cycle, an unknown format
    name in ``precedence_over``, or two spec files claiming one format name.

    Both a :class:`SpecError` (it is a validation problem of the spec files; ``file``,
    ``line``, ``col`` and ``path`` point at the ``detect`` section of the first one) and a
    :class:`DetectionError` (``detect_format`` refuses to pick by order).

    Attributes:
        files: every spec file involved (all named in the message).
        formats: the format names involved.
    """

    def __init__(self, message: str, *, files: Sequence[str], formats: Sequence[str],
                 file: str | None = None, line: int | None = None, col: int | None = None,
                 path: str | None = None):
        self.files = list(files)
        self.formats = list(formats)
        SpecError.__init__(self, message, file=file, line=line, col=col, path=path)
        # DetectionError's fields (SpecError's __init__ reached it with the rendered text).
        self.message = message
        self.candidates = list(formats)
        self.evidence = {}



class TemplateError(ChatGrammarError):
    """A chat template failed: it does not compile, it called ``raise_exception``, or it crashed.

    Templates reject conversation shapes they do not support (no system role, string tool
    arguments, alternation rules...) by raising; this error carries the template's own message.

    Attributes:
        message: the template's message (for ``raise_exception``) or the underlying error text.
        kind: ``"raised"`` (the template called ``raise_exception``), ``"syntax"`` (the template
            does not compile), ``"undefined"`` (an undefined value was used in a way Jinja
            forbids), ``"security"`` (the sandbox refused an operation), ``"runtime"`` (any other
            exception inside the template, e.g. a ``TypeError``), ``"continue"`` (the final message
            cannot be continued) or ``"timeout"``.
        lineno: the template line where it happened, when known.
    """

    def __init__(self, message: str, *, kind: str = "runtime", lineno: int | None = None):
        self.message = message
        self.kind = kind
        self.lineno = lineno
        super().__init__(self.render())

    def render(self) -> str:
        where = f"template line {self.lineno}: " if self.lineno is not None else "template: "
        return f"{where}{self.message}"


class RenderTimeout(TemplateError):
    """The template did not finish rendering within the time limit.

    Attributes:
        timeout: the limit, in seconds.
    """

    def __init__(self, timeout: float):
        self.timeout = timeout
        super().__init__(f"rendering did not finish within {timeout:g} s", kind="timeout")


class TokenizerLoadError(ChatGrammarError):
    """A tokenizer could not be loaded (missing, needs remote code, broken, no transformers)."""


class NormError(ChatGrammarError):
    """``norms.yaml`` is invalid, or a config cannot be read."""


class InferenceError(ChatGrammarError):
    """A chat template cannot be captured by an inferred format (:func:`chatgrammar.infer_format`).

    Raised instead of returning a format that would be only partly right: the probes show a
    structure the spec language cannot say, or the inferred spec fails the template's
    conformance matrix.

    Attributes:
        message: what cannot be captured.
        where: the probe, role or matrix case it was seen in (``"case tool-call"``), or None.
        details: a longer explanation (the failing case's renderings), or ``""``.
    """

    def __init__(self, message: str, *, where: str | None = None, details: str = ""):
        self.message = message
        self.where = where
        self.details = details
        super().__init__(f"{message} ({where})" if where else message)


class VerifyError(ChatGrammarError):
    """Verify mode (``CHATGRAMMAR_VERIFY=1``): a fast answer (memoised mask or text parse)
    differs from the reference pipeline's. Always a bug of chatgrammar, never of the input."""


__all__ = ["ChatGrammarError", "SpecError", "CompileError", "ParseError", "DetectionError",
           "NormError", "InferenceError", "PrecedenceError", "TemplateError", "RenderTimeout",
           "TokenizerLoadError", "VerifyError"]


class DeviationWarning(UserWarning):
    """A format was taken that trains a documented deviation from the template's exact turns.

    Issued by :func:`chatgrammar.infer_format` when the inferred format passed its verification
    only with a deviation the checker accepts (``unclosed-whitespace``: a template that never
    closes a reply writes whitespace after it, and at the end of a sample that whitespace trains
    with the reply). The mask is not silently different from the template's turns: this
    warning says so, and ``fmt.verification.deviations`` lists what.

    Also issued at mask time (text mode, id mode, the fast path, ``loss_masks`` and the
    hf / integrations batch APIs that call it) when a policy drops tool calls or reasoning
    (``tool_calls=False``, ``thinking=False``) and the format declares that its templates
    write some of them as plain text (the spec's ``plain_text_tool_calls`` /
    ``plain_text_reasoning``): no grammar tells those from the answer, so they train as
    assistant text. Never an error, strict or lenient. The same at mask time for a format
    resolved for a template that writes a message as another role's turn (the spec's
    ``role_folds``: Unsloth's ChatML tool results as system turns) when the policy trains one
    side of it and not the other (``roles=("assistant", "system")``).
    """

