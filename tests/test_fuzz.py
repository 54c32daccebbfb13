"""Fuzzing every bundled format, in text mode and id mode, within a fixed time budget.

Seeds are real renderings: the built-in conversation matrix rendered by each format's main
templates (:func:`tests.fuzz_tokenizers.format_templates`) and the spec's embedded examples.
Each case mutates a seed (markers deleted, duplicated, inserted, swapped; slices duplicated;
random and out-of-vocabulary ids; cuts at both ends; marker fragments and random characters in
text) or is a random stream of markers and text, and runs :func:`check_contract` on it:

- strict parsing returns or raises ``ParseError`` (offset in range, excerpt) — never another
  exception type, never ``RecursionError``;
- lenient parsing never raises; every mask has exactly one 0/1 value per input position; spans
  are sorted and inside the input under several policies; a valid input parses the same in
  both modes.

The loop is seeded (reproducible; ``CHATGRAMMAR_FUZZ_SEED`` picks another campaign) and bounded
by time: ``CHATGRAMMAR_FUZZ_SECONDS`` (default 4; 20 with ``CHATGRAMMAR_LONG=1``, the tests
marked ``long``; 60 with ``--runslow``) split evenly over
the formats, each format getting at least ``MIN_CASES`` cases per mode
(``CHATGRAMMAR_FUZZ_MIN_CASES``: 20 by default, 30 with ``CHATGRAMMAR_LONG=1``, 300 with
``--runslow``, which is the
campaign that sizes the guarantee; the default run keeps every check at the smaller size). A failure
prints a ready-made regression file (``tests/data/regressions/<format>/<name>.json``).

Truncation is checked exhaustively: every prefix of a few renderings per format, in both
modes, parses strictly (a cut is not an error) and trains exactly what the whole rendering
trains on the part that is there (text mode: except a trailing fragment that could be the
start of a marker, which is not content yet).
"""
from __future__ import annotations

import copy
import os
import random
import re
import time
import zlib
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest
import yaml

import chatgrammar as cg
from chatgrammar.conformance.matrix import get_case, iter_renderable
from tests.fuzz_tokenizers import (QWEN_BASE_VOCAB, REAL_TOKENIZERS, check_contract,
                                   encode_rendered, format_encoding, format_templates,
                                   named_tokenizer, sized)

FORMATS = cg.list_formats()
# 4 s in the default run (8 until the second round of issue 14's sizing), 20 s with
# CHATGRAMMAR_LONG=1 (the default before issue 14's sizing), 60 s with --runslow
# (tests/conftest.py sets the variable); split over the formats, so the clock matters less
# than MIN_CASES, which holds in every run
FUZZ_SECONDS = float(os.environ.get("CHATGRAMMAR_FUZZ_SECONDS", sized("4", "20")))
FUZZ_SEED = int(os.environ.get("CHATGRAMMAR_FUZZ_SEED", "0"))  # another seed: another campaign
# per format and mode, whatever the clock says: 20 in the default run (each format still
# reaches valid and invalid inputs in both modes: asserted), 30 with CHATGRAMMAR_LONG=1 (the
# default before issue 14's sizing), 300 with --runslow (tests/conftest.py). The minimum, not
# the seconds, bounds the file's cost on a loaded machine; the larger sizes are the longer
# runs' job.
MIN_CASES = int(os.environ.get("CHATGRAMMAR_FUZZ_MIN_CASES", sized("20", "30")))
POLICIES = (cg.MaskPolicy(end_marker=True), cg.MaskPolicy(thinking=False, tool_calls=False),
            cg.MaskPolicy(last_turn_only=True, truncated=False),
            cg.MaskPolicy(roles=("assistant", "user", "system", "tool")))
PREFIX_CASES = ("tool-call", "reasoning", "multi-turn")


def _seeds(fmt) -> list[str]:
    """Real renderings of the matrix by the format's templates, plus its embedded examples."""
    out = list(_seeds_of(fmt.name, str(fmt.path)))
    assert out, f"{fmt.name}: no seed rendering"
    return out


@lru_cache(maxsize=2)  # the module runs format by format: each format's three fuzz tests
def _seeds_of(name: str, path: str) -> tuple[str, ...]:
    # (rendering the whole matrix with every main template is most of a small fuzz test's
    # cost: rendered once per format, shared by its text, soft-marker and real-tokenizer loops)
    fmt = cg.load_format(name)
    assert str(fmt.path) == path, (name, fmt.path, path)
    out: list[str] = []
    for _name, template, special in format_templates(fmt):
        out.extend(text for _case, text, _reason in iter_renderable(template, **special)
                   if text is not None)
    for ex in fmt.spec.examples:
        out.append(ex.text.replace("⟦", "").replace("⟧", ""))
    return tuple(out)


# ------------------------------------------------------------------------------ mutations

def _segments(text: str, rx: re.Pattern) -> list[str]:
    """Text split into marker strings and the runs between them."""
    out, pos = [], 0
    for m in rx.finditer(text):
        if m.start() > pos:
            out.append(text[pos:m.start()])
        out.append(m.group())
        pos = m.end()
    if pos < len(text):
        out.append(text[pos:])
    return out


_NOISE = ["x", " ", "\n", "user", "assistant", "system", "tool", 'message role="assistant"',
          "think", "response", "analysis", "final", "=", '"', "&amp;", "é", "中", "🌍", "\x00",
          "{", "}", "functions.f:0", "<", "|", ">", "[", "]", "/"]


def _mutate(units: list, rng: random.Random, markers: list, noise: list, seeds: list,
            deep_opener) -> list:
    """1-4 random edits of a unit list (ids, or text segments)."""
    units = list(units)
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(11)
        n = len(units)
        if op == 0 and n:                                   # delete one unit
            del units[rng.randrange(n)]
        elif op == 1 and n:                                 # delete a marker
            idx = [i for i, u in enumerate(units) if u in markers]
            if idx:
                del units[rng.choice(idx)]
        elif op == 2 and n:                                 # duplicate a slice
            a = rng.randrange(n)
            b = min(n, a + rng.randint(1, 12))
            units[b:b] = units[a:b]
        elif op == 3:                                       # insert a marker
            units.insert(rng.randint(0, n), rng.choice(markers))
        elif op == 4:                                       # insert noise
            for _k in range(rng.randint(1, 3)):
                units.insert(rng.randint(0, len(units)), rng.choice(noise))
        elif op == 5 and n >= 2:                            # swap two markers
            idx = [i for i, u in enumerate(units) if u in markers]
            if len(idx) >= 2:
                i, j = rng.sample(idx, 2)
                units[i], units[j] = units[j], units[i]
        elif op == 6 and n:                                 # replace a marker
            idx = [i for i, u in enumerate(units) if u in markers]
            if idx:
                units[rng.choice(idx)] = rng.choice(markers)
        elif op == 7 and n:                                 # cut both ends
            a = rng.randint(0, n // 3)
            b = rng.randint(max(a, n - n // 3), n)
            units = units[a:b]
        elif op == 8:                                       # splice another seed in
            other = rng.choice(seeds)
            if other:
                a = rng.randrange(len(other))
                piece = other[a:a + rng.randint(1, 40)]
                at = rng.randint(0, len(units))
                units[at:at] = piece
        elif op == 9 and deep_opener is not None:           # deep nesting
            at = rng.randint(0, len(units))
            units[at:at] = deep_opener * rng.randint(2, 300)
        elif op == 10 and n:                                # truncate
            units = units[:rng.randint(0, n)]
    return units


def _random_stream(rng: random.Random, markers: list, noise: list) -> list:
    return [rng.choice(markers) if rng.random() < 0.45 else rng.choice(noise)
            for _ in range(rng.randint(0, 60))]


def _deep_opener(fmt, seed_units: list, markers: set):
    """The first two units of a nested element, when some element nests in itself (XTML):
    repeating them builds deep nesting."""
    nesting = any(n in el.children for n, el in fmt.spec.elements.items())
    if not nesting:
        return None
    for i in range(1, len(seed_units) - 2):
        # an opener marker followed by a header run: repeated, it opens elements inside
        # elements
        if seed_units[i] in markers and seed_units[i + 1] not in markers and i > 2:
            return seed_units[i:i + 3]
    return None


# ------------------------------------------------------------------------------ the loops

@pytest.mark.long
@pytest.mark.parametrize("name", FORMATS)
def test_fuzz_format(name):
    fmt = cg.load_format(name)
    enc = format_encoding(fmt)
    rng = random.Random(zlib.crc32(name.encode()) ^ FUZZ_SEED)
    seeds = _seeds(fmt)
    marker_texts = [m.text for m in fmt.spec.markers.values()]
    rx = re.compile("|".join(re.escape(t) for t in sorted(marker_texts, key=len, reverse=True)))
    # a marker's own special id (a marker's text may hold another's: chatglm2)
    marker_ids = [enc._special_tokens[t] if t in enc._special_tokens
                  else enc.encode_single_token(t) for t in marker_texts]
    marker_id_set = set(marker_ids)

    text_seeds = [_segments(s, rx) for s in seeds]
    id_seeds = [encode_rendered(enc, s) for s in seeds]
    text_markers = marker_texts
    text_noise = _NOISE + [t[:k] for t in marker_texts for k in (1, 2, len(t) - 1) if k > 0]
    id_noise = (enc.encode_ordinary(" ".join(_NOISE)) + [-1, -(2 ** 31), QWEN_BASE_VOCAB - 1,
                enc.n_vocab, enc.n_vocab + 7, 10 ** 9, 2 ** 62])
    deep_text = _deep_opener(fmt, max(text_seeds, key=len), set(text_markers))
    deep_ids = _deep_opener(fmt, max(id_seeds, key=len), marker_id_set)

    budget = FUZZ_SECONDS / max(1, len(FORMATS))
    stop = time.monotonic() + budget
    cases = {"text": 0, "ids": 0}
    outcomes = {"ok": 0, "error": 0}
    while min(cases.values()) < MIN_CASES or time.monotonic() < stop:
        mode = "text" if cases["text"] <= cases["ids"] else "ids"
        if mode == "text":
            units = (_random_stream(rng, text_markers, text_noise) if rng.random() < 0.15 else
                     _mutate(rng.choice(text_seeds), rng, text_markers, text_noise,
                             text_seeds, deep_text))
            data = "".join(units)
            if rng.random() < 0.2 and data:  # a few raw character edits too
                k = rng.randrange(len(data))
                data = data[:k] + rng.choice(["", "\ufffd", "|", "<", ">"]) + data[k + 1:]
        else:
            units = (_random_stream(rng, marker_ids, id_noise) if rng.random() < 0.15 else
                     _mutate(rng.choice(id_seeds), rng, marker_ids, id_noise, id_seeds, deep_ids))
            data = units if rng.random() < 0.5 else np.asarray(units, dtype=np.int64)
        strict, _ = check_contract(fmt, data, mode, enc if mode == "ids" else None,
                                   policies=POLICIES)
        outcomes["error" if isinstance(strict, cg.ParseError) else "ok"] += 1
        cases[mode] += 1
    # both outcomes happen: the mutations reach valid and invalid inputs alike
    assert outcomes["ok"] > 0 and outcomes["error"] > 0, outcomes


def _fuzz_ids_only(fmt, tok, tokenizer: str, encode, ordinary_noise: list[int], vocab: int,
                   budget: float, min_cases: int) -> None:
    """The id-mode loop with another tokenizer (a real one, or soft markers left as text)."""
    rng = random.Random(zlib.crc32(f"{fmt.name}/{tokenizer}".encode()) ^ FUZZ_SEED)
    marker_ids = sorted(fmt.id_lexer(tok).marker_ids.values())
    id_seeds = [encode(s) for s in _seeds(fmt)]
    noise = ordinary_noise + [-1, vocab - 1, vocab, vocab + 7, 10 ** 9, 2 ** 62]
    stop = time.monotonic() + budget
    n = 0
    while n < min_cases or time.monotonic() < stop:
        units = (_random_stream(rng, marker_ids, noise) if rng.random() < 0.15 else
                 _mutate(rng.choice(id_seeds), rng, marker_ids, noise, id_seeds, None))
        check_contract(fmt, units, "ids", tok, policies=POLICIES, tokenizer=tokenizer)
        n += 1


SOFT_FORMATS = [n for n in FORMATS
                if any(not m.special for m in cg.load_format(n).spec.markers.values())]


@pytest.mark.long
@pytest.mark.parametrize("name", SOFT_FORMATS)
def test_fuzz_soft_markers_as_text(name):
    """A tokenizer without single ids for the soft markers (``<think>`` as ordinary BPE text):
    id mode finds them in decoded runs, straddling merged tokens."""
    fmt = cg.load_format(name)
    enc = format_encoding(fmt, soft_as_specials=False)
    _fuzz_ids_only(fmt, enc, "fuzz-hard", lambda s: enc.encode(s, allowed_special="all"),
                   enc.encode_ordinary(" ".join(_NOISE)), enc.n_vocab,
                   FUZZ_SECONDS / max(1, len(FORMATS)) / 5, MIN_CASES // 5)


@pytest.mark.long
@pytest.mark.parametrize("tokenizer", sorted(REAL_TOKENIZERS))
def test_fuzz_real_tokenizers(tokenizer):
    """Real tokenizers (transformers' fast and slow, BPE and SentencePiece; tiktoken's Qwen2.5)
    decode hostile ids through their own code paths: the contract holds there too."""
    pytest.importorskip("transformers")
    name, _build = REAL_TOKENIZERS[tokenizer]
    if name not in FORMATS:
        pytest.fail(f"{tokenizer}: format {name!r} is not bundled")
    fmt = cg.load_format(name)
    tok = named_tokenizer(fmt, tokenizer)
    from tests.format_kit import encode_ids, is_tiktoken

    _fuzz_ids_only(fmt, tok, tokenizer, lambda s: encode_ids(tok, s),
                   encode_ids(tok, " ".join(_NOISE)),
                   tok.n_vocab if is_tiktoken(tok) else len(tok),
                   FUZZ_SECONDS / max(1, len(FORMATS)) / 5, MIN_CASES // 5)


# ------------------------------------------------------------------------------ specs

_SPEC_VALUES = [None, "", "x", 0, -1, 10 ** 9, True, [], {}, ["x"], {"a": 1}, "(a+)+", "\n",
                [None], 3.5, "assistant", "think", "turn", "message", "<|im_end|>", "open",
                "close", "sep", "im_end", "until", "text"]
_SPEC_KEYS = ["x", "open", "close", "children", "header", "follow", "lead", "until",
              "until_text", "pattern", "markers", "role", "kind", "tag", "after", "max_tokens",
              "required", "attributes", "inner_markers", "text", "special", "trained_after"]


def _spec_paths(d, p=()):
    out = [p]
    if isinstance(d, dict):
        for k, v in d.items():
            out += _spec_paths(v, p + (k,))
    elif isinstance(d, list):
        for i, v in enumerate(d):
            out += _spec_paths(v, p + (i,))
    return out


def _mutate_spec(d, rng: random.Random):
    d = copy.deepcopy(d)
    for _ in range(rng.randint(1, 3)):
        paths = _spec_paths(d)[1:]
        if not paths:
            break
        p = rng.choice(paths)
        parent = d
        for k in p[:-1]:
            parent = parent[k]
        k = p[-1]
        op = rng.random()
        if op < 0.3:
            del parent[k]
        elif op < 0.6:  # (copies: the table's lists and dicts must never be shared)
            parent[k] = copy.deepcopy(rng.choice(_SPEC_VALUES))
        elif op < 0.8:  # another value of the same spec
            other = d
            for kk in rng.choice(paths):
                other = other[kk]
            parent[k] = copy.deepcopy(other)
        elif isinstance(parent, dict):
            parent[rng.choice(_SPEC_KEYS)] = copy.deepcopy(rng.choice(_SPEC_VALUES))
        else:
            parent.insert(k, copy.deepcopy(rng.choice(_SPEC_VALUES)))
    return d


@pytest.mark.long
def test_fuzz_specs():
    """Mutated bundled specs (keys deleted, values replaced or swapped, keys added): loading
    raises SpecError / CompileError or builds a Format — never another exception — and a
    Format that builds keeps the parse contract on marker soup, in both modes."""
    from chatgrammar.runtime.format import Format
    from chatgrammar.core.spec import parse_spec

    rng = random.Random(zlib.crc32(b"specs") ^ FUZZ_SEED)
    sources = {n: yaml.safe_load(Path(cg.load_format(n).path).read_text(encoding="utf-8"))
               for n in FORMATS}
    stop = time.monotonic() + FUZZ_SECONDS / 6
    n = built = 0
    while n < MIN_CASES or time.monotonic() < stop:
        name = rng.choice(FORMATS)
        text = yaml.safe_dump(_mutate_spec(sources[name], rng), allow_unicode=True)
        n += 1
        try:
            fmt = Format(*parse_spec(text, f"<mutated {name}>"))
        except cg.ChatGrammarError:
            continue
        except Exception as exc:  # noqa: BLE001 - the violation
            raise AssertionError(f"loading a mutated {name} spec raised "
                                 f"{type(exc).__name__}: {exc}\n{text}") from exc
        built += 1
        markers = [m.text for m in fmt.spec.markers.values()]
        if not markers:
            continue
        enc = format_encoding(fmt)
        words = markers + ["user", "assistant", "\n", " ", "x", 'message role="assistant"']
        for _ in range(4):
            soup = "".join(rng.choice(words) for _ in range(rng.randint(0, 20)))
            try:
                check_contract(fmt, soup, "text")
                check_contract(fmt, encode_rendered(enc, soup), "ids", enc)
            except AssertionError as exc:
                raise AssertionError(f"{exc}\nspec:\n{text}") from None
    assert built > 0


def _prefix_renders(fmt) -> list[str]:
    import dataclasses

    from tests.fuzz_tokenizers import rejected_by_design, messages_for

    cases = [dataclasses.replace(c, messages=messages_for(fmt, c.messages))
             for c in (get_case(n) for n in PREFIX_CASES)]
    cases = [c for c in cases if not rejected_by_design(fmt, c.messages)]
    out = []
    for _name, template, special in format_templates(fmt)[:1]:
        out.extend(text for _c, text, _r in iter_renderable(template, cases, **special)
                   if text is not None)
    return out


def _cut_expectation(fmt, conv, full_prefix: np.ndarray, end: int | None = None,
                     whole=None) -> np.ndarray:
    """What a prefix must train: what the whole rendering trains there — except in a last turn
    the cut leaves looking exactly like a generation prompt (``<|im_start|>assistant\n``
    followed by an empty think block, say), which trains nothing by the generation-prompt
    rule (the two cannot be told apart), or cut inside its header, which trains nothing of
    that turn (Harmony trains the header text after the role when the header is whole).
    ``whole``: the whole rendering's parse; a cut inside the header of one of its turns trains
    nothing of that turn either, even where the prefix holds too little of it to be a turn
    (GigaChat's ``…<|message_sep|>\n\n`` before ``function call<|role_sep|>``: between-turn
    text at the end of the prefix, the start of a trained header in the whole)."""
    want = full_prefix.copy()
    end = len(full_prefix) if end is None else end
    for t in whole.turns if whole is not None else ():
        if t.start < end <= t.block.header_end and not _header_whole(fmt, conv, t.start, end):
            want[t.start:] = 0
    if conv.turns:
        last = conv.turns[-1]
        el = fmt.spec.elements.get(last.block.name)
        in_header = (not last.complete and el is not None and el.header is not None
                     and last.block.header_end >= end
                     and not _header_whole(fmt, conv, last.start, end))
        if last.generation_prompt or in_header:
            want[last.start:] = 0
    return want


def _trim_tail(want: np.ndarray, n: int, is_space) -> None:
    """A cut inside a body whose element has ``trim_end`` (Falcon's reply with no terminator):
    the unclosed body drops the whitespace it ends with, so the prefix does not train the
    whitespace units just before the cut that the whole rendering, where text follows, trains
    (``is_space(j)``: unit ``j`` is only whitespace; a token of text and whitespace stays)."""
    j = n
    while j > 0 and want[j - 1] and is_space(j - 1):
        j -= 1
    want[j:n] = 0


def _header_whole(fmt, conv, start: int, end: int) -> bool:
    """The prefix ``conv`` ends right after the whole header of its turn at ``start``: the
    header's ``until_text`` literal is its last text (docs/engine.md, "Whole headers": a header
    is whole when its terminator follows; HyperCLOVA X SEED's ``assistant -> tool/function_call\n``
    then trains its ``trained_after`` tail). A header ended by an ``until`` marker that the cut
    leaves out, or one without the literal yet, is still cut."""
    for t in conv.turns:
        if t.start == start:
            el = fmt.spec.elements.get(t.block.name)
            lit = el.header.until_text if el is not None and el.header is not None else None
            return (bool(lit) and t.block.header_end == end
                    and (t.block.header or "").endswith(lit))
    return False


def _lstrip_tail(want: np.ndarray, units, n: int, is_space, lstrip_at) -> None:
    """A cut inside the whitespace an ``lstrip`` marker absorbs (Nemotron's ``\n`` before
    ``<SPECIAL_12>``): the prefix cannot know a marker follows, so that whitespace is the end
    of whatever run it ends — it trains as the unit before it does. ``units``: the whole
    rendering's ids or text; ``lstrip_at(j)``: an lstrip marker starts at unit ``j``."""
    j = n
    while j < len(units) and j - n < 16 and is_space(units[j]):
        j += 1
    if j == len(units) or not lstrip_at(j):
        return
    s = n
    while s > 0 and n - s < 16 and is_space(units[s - 1]):
        s -= 1
    if 0 < s < n:
        want[s:n] = want[s - 1]


#: formats whose main templates the fuzz suites render (``main: true`` in their tests.yaml; the
#: others are checked on their templates by the conformance and format suites)
MAIN_FORMATS = [n for n in FORMATS if format_templates(cg.load_format(n))]


@pytest.mark.parametrize("name", MAIN_FORMATS)
def test_every_prefix_trains_what_is_there(name):
    """A sample cut anywhere (max_length) parses strictly and trains exactly the part of the
    full rendering's trained tokens / chars that it still holds."""
    fmt = cg.load_format(name)
    enc = format_encoding(fmt)
    renders = _prefix_renders(fmt)
    assert renders, f"{name}: none of {PREFIX_CASES} renders"
    longest = max(len(m.text) for m in fmt.spec.markers.values())
    prefixes_of = fmt._lexcfg.marker_prefixes
    lstrip_texts = [m.text for m in fmt.spec.markers.values() if m.lstrip]
    lstrip_ids = {i for t in lstrip_texts for i in encode_rendered(enc, t)[:1]}
    marker_ids = {u[0] for m in fmt.spec.markers.values()
                  if len(u := encode_rendered(enc, m.text)) == 1}
    trims = any(el.trim_end for el in fmt.spec.elements.values())
    # (masks compared as arrays: mask_array() is what mask() lists, without a list per prefix)
    for k, text in enumerate(renders):
        ids = encode_rendered(enc, text)
        whole = fmt.parse_ids(ids, enc)
        full = whole.mask_array()
        for n in range(len(ids) + 1):
            conv = fmt.parse_ids(ids[:n], enc)
            got, want = conv.mask_array(), _cut_expectation(fmt, conv, full[:n],
                                                                  whole=whole)
            if lstrip_ids:
                # a marker of whitespace (Granite Code's blank-line close "\n\n") is no text
                # run: lstrip never absorbs it
                _lstrip_tail(want, ids, n,
                             lambda i: i not in marker_ids and enc.decode([i]).isspace(),
                             lambda j: ids[j] in lstrip_ids)
            if trims:
                _trim_tail(want, n, lambda j: enc.decode([ids[j]]).isspace())
            if not np.array_equal(got, want):
                bad = int(np.flatnonzero(got != want)[0])
                raise AssertionError(f"{name}: ids[:{n}] trains token {bad} differently from "
                                     f"the whole rendering\n{enc.decode(ids[:n])!r}")
        whole_t = fmt.parse(text)
        full_t = whole_t.mask_array()
        # every prefix for the first rendering; around each marker for the others
        if k == 0:
            cuts = range(len(text) + 1)
        else:
            cuts = sorted({c for m in re.finditer("|".join(
                re.escape(t) for t in (x.text for x in fmt.spec.markers.values())), text)
                for p in (m.start(), m.end()) for c in range(p - 3, p + 4)
                if 0 <= c <= len(text)})
        for n in cuts:
            conv = fmt.parse(text[:n])
            # a trailing fragment that may start a marker is not content yet: the input
            # effectively ends before it
            end = n
            for j in range(min(n, longest - 1), 0, -1):
                if text[n - j:n] in prefixes_of:
                    end = n - j
                    break
            got, want = conv.mask_array(), _cut_expectation(fmt, conv, full_t[:n], end,
                                                                  whole_t)
            want[end:] = 0
            if lstrip_texts:
                # chars of a whitespace marker (Granite Code's "\n\n") are no text run
                ws_marks = {c for t in fmt.spec.markers.values() if t.text.isspace()
                            for m in re.finditer(re.escape(t.text), text)
                            for c in range(*m.span())}
                _lstrip_tail(want, range(len(text)), end,
                             lambda c: c not in ws_marks and text[c].isspace(),
                             lambda j: any(text.startswith(t, j) for t in lstrip_texts))
            if trims:
                _trim_tail(want, end, lambda j: text[j].isspace())
            if not np.array_equal(got, want):
                bad = int(np.flatnonzero(got != want)[0])
                raise AssertionError(f"{name}: text[:{n}] trains char {bad} differently from "
                                     f"the whole rendering\n{text[max(0, bad - 60):n]!r}")
