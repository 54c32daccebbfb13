"""Stage 2 — ``FormatSpec`` → one self-contained Lark grammar + terminal table.

The grammar is built by Lark as LALR(1) with ``strict=True``, so a spec whose grammar has a
shift/reduce or reduce/reduce conflict is rejected: a spec that compiles is unambiguous.
Lark never checks that a content pattern cannot swallow a marker; :func:`check_spec` does.

Terminals: one ``M_<NAME>`` per marker, ``TEXT`` (one run of text between markers) and
``HEADER`` (the head of a text run after an opener whose header ends at a literal, e.g. the
ChatML role line). Rules: one ``e_<name>`` per element.

This module is the stage's entry (:func:`compile_spec`, the LALR tables and their cache); its
parts live beside it: ``compile_regex`` (regex safety), ``compile_checks`` (the semantic
checks), ``compile_grammar`` (the Lark rules) and ``compile_conflicts`` (conflicts told in
spec terms).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from lark import Lark
from lark.exceptions import GrammarError
from lark.lexer import Lexer

# The parts of the stage, one module each; their public names are this entry's too (the rest
# of the package and the tests import the stage from here).
from .compile_checks import check_spec
from .compile_conflicts import Conflict, conflict_message, grammar_conflicts
from .compile_grammar import HEADER, TEXT, build_grammar, rule_name, term_name
from .compile_regex import (BETWEEN_MAX_CHARS, BETWEEN_MAX_TOKENS, HEADER_CHARS_PER_TOKEN,
                            regex_risk)
from ..errors import CompileError
from .spec import FormatSpec, SpecSource

__all__ = ["BETWEEN_MAX_CHARS", "BETWEEN_MAX_TOKENS", "HEADER", "HEADER_CHARS_PER_TOKEN", "TEXT",
           "Conflict", "ParseTables", "build_grammar", "check_spec", "compile_spec",
           "conflict_message", "grammar_conflicts", "regex_risk", "rule_name", "spec_digest",
           "term_name"]


class _PassThroughLexer(Lexer):
    """Lark needs a lexer class; chatgrammar lexes itself, so this one is never used to lex."""

    def __init__(self, lexer_conf):  # noqa: D401 - Lark API
        pass

    def lex(self, data):  # pragma: no cover - the driver in parse.py feeds tokens directly
        yield from data



# ----------------------------------------------------------------------------- tables

@dataclass
class ParseTables:
    """What the driver in :mod:`chatgrammar.runtime.parse` needs from Lark's LALR analysis."""

    states: dict
    start_state: int
    end_state: int
    shift: Any
    grammar: str
    starters: frozenset  # terminals that can start a top-level item
    close_terms: frozenset
    until_terms: frozenset


@lru_cache(maxsize=256)
def _lalr(grammar: str) -> tuple:
    # Lark's LALR analysis is most of a cold load: tables are also cached on disk, keyed by
    # the grammar text (see chatgrammar.core.cache; a grammar with conflicts raises, never cached).
    # Actions are kept as (is_shift, arg) pairs whether built or loaded; the driver tests
    # `is_shift is True`. The disk entry is JSON (data that cannot run code): a corrupt or
    # foreign one does not decode and is rebuilt.
    from . import cache

    key = cache.key_for("lalr", grammar)
    hit = cache.load("lalr", key)
    if hit is not None:
        try:
            return (*cache.decode_tables(hit), True)
        except Exception:  # an entry of another shape: rebuild it
            pass
    lk = Lark(grammar, parser="lalr", lexer=_PassThroughLexer, strict=True,
              maybe_placeholders=False)
    pt = lk.parser.parser.parser.parse_table
    from lark.parsers.lalr_analysis import Shift
    data = cache.dump_tables(pt.states, pt.start_states["start"], pt.end_states["start"], Shift)
    cache.store("lalr", key, cache.encode_tables(*data))
    return (*data, True)


def compile_spec(spec: FormatSpec, src: SpecSource) -> ParseTables:
    """Check a spec and build its LALR tables (cached by grammar text).

    Raises:
        CompileError: semantic problems, or a grammar conflict (reported against the spec
            elements and markers involved, with a shortest input that reaches it: see
            :func:`grammar_conflicts`).
    """
    check_spec(spec, src)
    grammar = build_grammar(spec)
    try:
        states, start, end, shift = _lalr(grammar)
    except GrammarError as exc:
        conflicts = grammar_conflicts(grammar)
        if not conflicts:  # not a conflict (should not happen for generated grammars)
            raise src.error(f"grammar does not build: {exc}", (), CompileError) from None
        msg, loc = conflict_message(conflicts, spec, grammar)
        n = len(conflicts)
        raise src.error(f"grammar is ambiguous ({n} LALR conflict{'s' if n > 1 else ''}): "
                        + msg, loc, CompileError) from None
    starters = frozenset(k for k, (a, _) in states[start].items() if k.isupper() and k != "$END")
    close_terms = frozenset(term_name(c) for el in spec.elements.values() if el.close
                            for c in el.close.markers)
    until_terms = frozenset(
        term_name(h.until) for el in spec.elements.values()
        for h in (el.header, el.close.header if el.close else None) if h is not None and h.until)
    return ParseTables(states, start, end, shift, grammar, starters, close_terms, until_terms)


def spec_digest(spec: FormatSpec) -> str:
    return hashlib.sha256(spec.model_dump_json().encode()).hexdigest()[:16]
