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
            (the ``evidence`` of :class:`chatgrammar.detect.Detection`).
    """

    def __init__(self, message: str, *, candidates: Sequence[str] = (),
                 evidence: dict | None = None):
        self.message = message
        self.candidates = list(candidates)
        self.evidence = dict(evidence or {})
        super().__init__(message)


class NormError(ChatGrammarError):
    """``norms.yaml`` is invalid, or a config cannot be read."""


class VerifyError(ChatGrammarError):
    """Verify mode (``CHATGRAMMAR_VERIFY=1``): a fast answer (memoised mask or text parse)
    differs from the reference pipeline's. Always a bug of chatgrammar, never of the input."""


__all__ = ["ChatGrammarError", "SpecError", "CompileError", "ParseError", "DetectionError",
           "NormError", "VerifyError"]
