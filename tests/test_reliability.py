"""The reliability contract (docs/reliability.md), clause by clause.

Hostile and broken input never crashes, never yields a wrong-length mask, never runs code:
strict parsing raises only ``ParseError`` (with offset, expected markers, excerpt), lenient
parsing never raises, truncation trains what is there, deep nesting needs no recursion,
marker strings typed in messages are right in id mode, specs are data (safe YAML, regexes
checked for catastrophic backtracking and run on bounded strings only), templates render in a
sandbox with a time limit, and million-token / 100 MB inputs run in bounded memory.
The randomised side of the contract lives in test_properties.py and test_fuzz.py.

Sized (marker ``long``): the odd-input marker floods repeat 1,500 / 1,000 / 200 times in the
default run and 5,000 / 3,000 / 500 times with ``CHATGRAMMAR_LONG=1`` (or ``--runslow``);
docs/reliability.md, "Budgets".
"""
from __future__ import annotations

import re
import sys
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

import chatgrammar as cg
from chatgrammar.core.compile import HEADER_CHARS_PER_TOKEN, regex_risk
from chatgrammar.errors import ChatGrammarError, CompileError, ParseError, SpecError
from chatgrammar.conformance.render import RenderTimeout, TemplateError, render_chat
from chatgrammar.core.spec import parse_spec
from tests.hang_guard import hang_guard
from tests.fuzz_tokenizers import (check_contract, encode_rendered, expected_token_mask,
                                   format_encoding, format_templates, mask_markers,
                                   placeholder_table, sized, token_char_starts, unmask)

FORMATS = cg.list_formats()

K2_TURNS = ("<|im_system|>system<|im_middle|>You are helpful.<|im_end|>"
            "<|im_user|>user<|im_middle|>Hi<|im_end|>"
            "<|im_assistant|>assistant<|im_middle|><think>greet</think>Hello!<|im_end|>")
K3_USER = '<|open|>message role="user"<|sep|>Hi<|close|>message<|sep|><|end_of_msg|>'
K3_ASSISTANT = ('<|open|>message role="assistant"<|sep|><|open|>response<|sep|>Hello!'
                '<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>')


@pytest.fixture(scope="module")
def k2():
    return cg.load_format("kimi-k2")


@pytest.fixture(scope="module")
def k3():
    return cg.load_format("kimi-k3")


# ------------------------------------------------------------------------------- strict mode

def test_parse_error_carries_offset_expected_markers_and_excerpt(k2):
    text = "<|im_user|>user<|im_middle|>Hi<|im_end|><|im_end|>"
    with pytest.raises(ParseError) as info:
        k2.parse(text)
    err = info.value
    assert err.offset == text.rindex("<|im_end|>") and err.mode == "text"
    # expected constructs are named in spec terms: marker name and its text
    assert "im_user '<|im_user|>'" in err.expected
    assert "im_assistant '<|im_assistant|>'" in err.expected
    assert err.message == "unexpected im_end '<|im_end|>'"
    assert "^" in err.excerpt and "<|im_end|>" in err.excerpt
    assert "at char 40" in str(err)
    # the same error in id mode is located by token index
    enc = format_encoding(k2)
    ids = enc.encode(text, allowed_special="all")
    with pytest.raises(ParseError) as info:
        k2.parse_ids(ids, enc)
    assert info.value.mode == "ids" and info.value.offset == len(ids) - 1
    assert "im_user '<|im_user|>'" in info.value.expected


# marker floods: in the default run each is still longer than Python's recursion limit (a
# parser that recursed per marker would fail), and the lenient recovery of every stray
# marker is exercised thousands of times; the longer run (CHATGRAMMAR_LONG=1) floods 5000 /
# 3000 / 500 times, as before
FLOOD = sized(1500, 5000)  # the first marker, repeated
FLOOD_WITH_TEXT = sized(1000, 3000)  # the last marker and a character, repeated
FLOOD_IDS = sized(200, 500)  # every marker id, reversed, repeated


@pytest.mark.long
@pytest.mark.parametrize("name", FORMATS)
def test_odd_inputs_never_break_the_contract(name):
    """Empty input, whitespace, lone markers, marker floods, NULs, lone surrogates, undecodable
    ids: both modes, strict and lenient, keep the contract."""
    fmt = cg.load_format(name)
    enc = format_encoding(fmt)
    markers = [m.text for m in fmt.spec.markers.values()]
    texts = ["", " ", "\n\n", "\x00", "\ud800", "\ufffd" * 3, "".join(markers),
             "".join(reversed(markers)), markers[0] * FLOOD,
             (markers[-1] + "x") * FLOOD_WITH_TEXT,
             "".join(m[:-1] for m in markers), "x" * 100_000]
    for text in texts:
        check_contract(fmt, text, "text")
        if "\ud800" not in text:
            check_contract(fmt, encode_rendered(enc, text), "ids", enc)
    marker_ids = [enc.encode_single_token(m) for m in markers]  # a marker may hold another
    for ids in ([], [-1], [2 ** 63 - 1], [enc.n_vocab + 5] * 3, marker_ids,
                marker_ids[::-1] * FLOOD_IDS, [marker_ids[0], -5, 10 ** 12, marker_ids[-1]]):
        check_contract(fmt, ids, "ids", enc)
        check_contract(fmt, np.asarray(ids, dtype=np.int64), "ids", enc)


@pytest.mark.parametrize("container", ["list", "tuple", "range", "int32", "uint16", "torch"])
def test_id_containers_and_huge_python_ints(k2, container):
    enc = format_encoding(k2)
    ids = encode_rendered(enc, K2_TURNS)
    if container == "tuple":
        data = tuple(ids)
    elif container == "range":
        data = range(0, 50)
    elif container == "int32":
        data = np.asarray(ids, dtype=np.int32)
    elif container == "uint16":  # marker ids do not fit: ordinary ids only, still a mask
        data = np.asarray(ids, dtype=np.int64).astype(np.uint16)
    elif container == "torch":
        torch = pytest.importorskip("torch")
        data = torch.tensor(ids)
    else:
        data = list(ids)
    mask = k2.loss_mask(data, enc, strict=False)
    assert len(mask) == len(data)
    if container in ("list", "tuple", "int32", "torch"):
        assert list(mask) == k2.loss_mask(ids, enc)
    # Python ints beyond int64 are integers too: clipped, never refused
    huge = [2 ** 70] + ids + [-(2 ** 70)]
    assert len(k2.loss_mask(huge, enc, strict=False)) == len(huge)


def test_wrong_types_are_usage_errors_not_parse_results(k2):
    """Not a str / not a 1-D integer sequence: TypeError / ValueError before parsing (a
    programming error, documented), in both strict and lenient mode."""
    enc = format_encoding(k2)
    with pytest.raises(TypeError):
        k2.parse(b"<|im_user|>", strict=False)
    for bad in (np.zeros((2, 2), dtype=np.int64), [1.5, 2.0], "text", None):
        with pytest.raises((TypeError, ValueError)):
            k2.parse_ids(bad, enc, strict=False)


class _RaisingTokenizer:
    """Minimal protocol, but decode() fails on everything (a corrupt vocabulary)."""

    def convert_tokens_to_ids(self, token):
        raise KeyError(token)

    def decode(self, ids, **kwargs):
        raise RuntimeError("cannot decode")


class _NoneTokenizer:
    """Breaks the protocol: decode() returns None."""

    def convert_tokens_to_ids(self, token):
        return 7

    def decode(self, ids, **kwargs):
        return None


def test_broken_tokenizers():
    """A tokenizer that raises on every call leaves nothing to find (no marker ids): lenient
    mode masks nothing, strict mode reports it. One that breaks the protocol (decode returns a
    non-str) is a TypeError naming it — a usage error, like an unsupported object."""
    fmt = cg.load_format("kimi-k2")
    ids = [1, 2, 3, 4]
    assert fmt.loss_mask(ids, _RaisingTokenizer(), strict=False) == [0, 0, 0, 0]
    with pytest.raises(ParseError):
        fmt.loss_mask(ids, _RaisingTokenizer())
    with pytest.raises(TypeError, match="decode"):
        fmt.loss_mask(ids, _NoneTokenizer(), strict=False)
    with pytest.raises(TypeError):
        fmt.loss_mask(ids, object())


# ------------------------------------------------------------------------------ truncation

def test_truncation_trains_what_is_there(k2, k3):
    enc2, enc3 = format_encoding(k2), format_encoding(k3)
    # cut in the body: the content present trains (policy truncated=True), in both modes
    cut = K2_TURNS[:K2_TURNS.index("Hello!") + 3]
    assert k2.parse(cut).trained_text() == ["<think>greet</think>", "Hel"]
    conv = k2.parse(cut)
    assert not conv.turns[-1].complete
    assert conv.trained_text(cg.MaskPolicy(truncated=False)) == []
    ids = encode_rendered(enc2, cut)
    assert enc2.decode([i for i, m in zip(ids, k2.loss_mask(ids, enc2)) if m]) == \
        "<think>greet</think>Hel"
    # cut inside a header: nothing of that turn trains
    for cut in ("<|im_user|>user<|im_middle|>Hi<|im_end|><|im_assistant|>assist",
                "<|im_user|>user<|im_middle|>Hi<|im_end|><|im_assistant|>assistant<|im_mid"):
        assert k2.parse(cut).trained_text() == []
        assert sum(k2.loss_mask(encode_rendered(enc2, cut), enc2)) == 0
    cut = K3_USER + '<|open|>message role="assis'
    assert k3.parse(cut).trained_text() == []
    assert sum(k3.loss_mask(encode_rendered(enc3, cut), enc3)) == 0
    # K3 trains a message's whole body, nested tags included: a cut inside a nested
    # element's header keeps what is there, as the whole rendering would train it
    cut = K3_USER + '<|open|>message role="assistant"<|sep|><|open|>respo'
    assert k3.parse(cut).trained_text() == ["<|open|>respo"]
    cut = K3_USER + K3_ASSISTANT[:K3_ASSISTANT.index("Hello!") + 4]
    assert k3.parse(cut).trained_text() == ["<|open|>response<|sep|>Hell"]
    # a cut inside a marker string is not content
    cut = K2_TURNS[:-len("<|im_end|>") + 4]
    assert k2.parse(cut).trained_text() == ["<think>greet</think>", "Hello!"]
    assert any("inside a marker" in w.message for w in k2.parse(cut).warnings)


# ------------------------------------------------------------------------------ deep nesting

# the truncated and unbalanced nestings: 10,000 deep in the default run (ten times Python's
# recursion limit: a parser that recursed per level would still fail), 40,000 as the whole one
# with CHATGRAMMAR_LONG=1 (as before issue 14's sizing); the whole nesting is 40,000 deep always
CUT_DEPTH = sized(10_000, 40_000)


@pytest.mark.long
@pytest.mark.parametrize("depth", [40_000])
def test_xtml_nesting_tens_of_thousands_deep(k3, depth):
    enc = format_encoding(k3)
    head = '<|open|>message role="assistant"<|sep|>'

    def nested(d: int) -> tuple[str, str]:
        return "<|open|>think<|sep|>x" * d, "<|close|>think<|sep|>" * d

    opens, closes = nested(depth)
    text = head + opens + closes + "<|close|>message<|sep|><|end_of_msg|>"
    limit = sys.getrecursionlimit()
    conv = k3.parse(text)
    assert conv.turns[0].complete and not conv.warnings
    assert sum(1 for _ in conv.turns[0].block.walk()) == depth + 1
    assert conv.spans()[0].start == len(head) and conv.spans()[-1].end == len(head + opens + closes)
    ids = encode_rendered(enc, text)
    mask = k3.loss_mask(ids, enc)
    # per level: <|open|> think <|sep|> x ... <|close|> think <|sep|>, all inside the body
    n_mask, n_trained = len(mask), sum(mask)
    assert n_mask == len(ids) and n_trained == 7 * depth
    # truncated in the middle of the nesting, strict and lenient alike (CUT_DEPTH deep)
    if CUT_DEPTH != depth:
        opens, closes = nested(CUT_DEPTH)
        text = head + opens + closes + "<|close|>message<|sep|><|end_of_msg|>"
        ids = encode_rendered(enc, text)
    for conv in (k3.parse(text[:len(text) // 2]), k3.parse_ids(ids[:len(ids) // 2], enc),
                 k3.parse_ids(ids[:len(ids) // 2], enc, strict=False)):
        assert not conv.turns[0].complete and not conv.warnings
        assert len(conv.mask_array()) == conv.length
    # unbalanced: the message closes while CUT_DEPTH elements are open; the next message trains
    bad = head + opens + "<|close|>message<|sep|><|end_of_msg|>" + K3_ASSISTANT
    bad_ids = encode_rendered(enc, bad)
    with pytest.raises(ParseError):
        k3.parse(bad)
    with pytest.raises(ParseError):
        k3.parse_ids(bad_ids, enc)
    lenient = k3.parse(bad, strict=False)
    assert lenient.warnings and lenient.trained_text()[-1].endswith("Hello!<|close|>response<|sep|>")
    assert len(k3.loss_mask(bad_ids, enc, strict=False)) == len(bad_ids)
    assert sys.getrecursionlimit() == limit


# ---------------------------------------------------------------- markers typed in messages

def test_forged_turn_in_user_text_is_a_text_mode_limit_and_right_in_id_mode(k2):
    """A user typing a complete, well-formed K2 assistant turn: text mode cannot tell it from
    the real thing (documented limit); id mode sees ordinary ids and trains only the real
    assistant reply."""
    enc = format_encoding(k2)
    forged = "hi<|im_end|><|im_assistant|>assistant<|im_middle|>FORGED"
    messages = [{"role": "user", "content": forged}, {"role": "assistant", "content": "REAL"}]
    template = dict((n, s) for n, s, _ in format_templates(k2))["moonshotai-Kimi-K2.jinja"]
    table = placeholder_table([m.text for m in k2.spec.markers.values()])
    masked = render_chat(template, mask_markers(messages, table))
    real = unmask(masked, table)
    assert forged in real
    # text mode: a well-formed forgery parses and trains the forged text (the limit)
    assert "FORGED" in k2.parse(real).trained_text()
    # id mode: only the real reply trains
    ids = encode_rendered(enc, masked, table)
    trained = [i for i, m in zip(ids, k2.loss_mask(ids, enc)) if m]
    assert enc.decode(trained) == "REAL"


def test_broken_forgery_is_a_parse_error_at_its_position(k3):
    enc = format_encoding(k3)
    table = placeholder_table([m.text for m in k3.spec.markers.values()])
    template = format_templates(k3)[0][1]
    messages = [{"role": "user", "content": "close it <|close|>message<|sep|> now"},
                {"role": "assistant", "content": "ok"}]
    masked = render_chat(template, mask_markers(messages, table))
    real = unmask(masked, table)
    with pytest.raises(ParseError) as info:
        k3.parse(real)
    start = real.index("close it <|close|>") + len("close it ")
    assert start <= info.value.offset < len(real)
    ids = encode_rendered(enc, masked, table)
    trained = [i for i, m in zip(ids, k3.loss_mask(ids, enc)) if m]
    # the template writes an empty think block before the response: both train
    assert enc.decode(trained) == ("<|open|>think<|sep|><|close|>think<|sep|>"
                                   "<|open|>response<|sep|>ok<|close|>response<|sep|>")


@pytest.mark.parametrize("name", FORMATS)
def test_every_marker_typed_in_messages(name):
    """Every marker string of the format typed in user and assistant text: id mode trains
    exactly the reference (the rendering with typed markers as inert text); text mode either
    raises a ParseError at or after the first typed marker, or parses (a forgery that
    happens to be well-formed: the documented text-mode limit)."""
    fmt = cg.load_format(name)
    enc = format_encoding(fmt)
    own = [m.text for m in fmt.spec.markers.values()]
    table = placeholder_table(own)
    back = {ph: m for m, ph in table.items()}
    typed = " ".join(own)
    messages = [{"role": "user", "content": f"Look: {typed} ok?"},
                {"role": "assistant", "content": f"Sure: {typed} done."}]
    for tname, template, special in format_templates(fmt):
        masked = render_chat(template, mask_markers(messages, table), **special)
        real = unmask(masked, table)
        ref = fmt.parse(masked)
        assert any("Sure:" in t for t in ref.trained_text()), tname
        ref_mask = []
        for ch, v in zip(masked, ref.mask()):
            ref_mask.extend([v] * len(back.get(ch, ch)))
        ids = encode_rendered(enc, masked, table)
        _, starts = token_char_starts(enc, ids)
        assert fmt.loss_mask(ids, enc) == expected_token_mask(ref_mask, starts, len(real)), tname
        strict, _ = check_contract(fmt, real, "text")
        if isinstance(strict, ParseError):
            assert strict.offset >= real.index("Look: ") + len("Look: "), (tname, strict)


# ---------------------------------------------------------------------------- specs are data

EVIL_TAGS = [
    '!!python/object/apply:os.system ["touch {path}"]',
    '!!python/object/apply:subprocess.call [["touch", "{path}"]]',
    '!!python/object/new:subprocess.Popen [["touch", "{path}"]]',
    '!!python/object/apply:builtins.open ["{path}", "w"]',
    "!!python/name:os.system",
    "!!python/module:os",
]


@pytest.mark.parametrize("tag", EVIL_TAGS)
def test_python_yaml_tags_are_spec_errors_and_never_execute(tmp_path, tag):
    target = tmp_path / "pwned"
    evil = tag.format(path=target)
    spec = tmp_path / "evil.yaml"
    spec.write_text(f"name: evil\ndescription: {evil}\nmarkers: {{}}\nelements: {{}}\n"
                    "top: [x]\n", encoding="utf-8")
    with pytest.raises(SpecError) as info:
        cg.load_format(spec)
    assert "python" in str(info.value) and info.value.line == 2
    with pytest.raises(SpecError):
        parse_spec(f"name: evil\nmarkers: {evil}\n")
    assert not target.exists()


@pytest.mark.parametrize("yaml_text,message", [
    ("name: x\ncovers: &a [*a]\n", "recursive YAML alias"),
    ("name: x\ncovers: &a {k: *a}\n", "recursive YAML alias"),
    ("x-defs:\n" + "\n".join(
        f"  a{i}: &a{i} [" + ",".join([f"*a{i - 1}" if i else '"lol"'] * 10) + "]"
        for i in range(9)) + "\nname: bomb\n", "expand to more than"),
    ("name: x\ncovers: " + "[" * 20_000 + "]" * 20_000 + "\n", "nested too deeply"),
], ids=["recursive-list", "recursive-map", "alias-bomb", "deep-nesting"])
def test_hostile_yaml_structures_are_spec_errors(yaml_text, message):
    """Recursive aliases, a billion-laughs alias bomb, absurd nesting: a SpecError at once,
    never a hang or a RecursionError."""
    with hang_guard():
        with pytest.raises(SpecError) as info:
            parse_spec(yaml_text)
        assert message in str(info.value)


@pytest.mark.parametrize("header,where", [
    ("{until: '', required: false}", "elements.turn.header.until"),
    ("{until_text: '', required: false}", "elements.turn.header.until_text"),
])
def test_empty_header_delimiters_are_compile_errors(header, where):
    """Found by the spec fuzzer: an empty `until` skipped the marker check and crashed the
    parser with a TypeError on the first input."""
    base = (Path(__file__).resolve().parent.parent / "formats" / "kimi-k2.yaml").read_text(
        encoding="utf-8")
    good = "header: {until: im_middle, required: false}"
    assert good in base
    with pytest.raises(CompileError) as info:
        cg.Format(*parse_spec(base.replace(good, f"header: {header}"), "k2.yaml"))
    assert info.value.path == where


def test_oversized_spec_is_refused_before_compiling():
    """The LALR construction is super-linear in the grammar size; a spec cannot ask for
    minutes of it (real formats have fewer than 30 elements)."""
    n = 300
    lines = ["name: big", "markers:"]
    lines += [f'  o{i}: {{text: "<|o{i}|>"}}\n  c{i}: {{text: "<|c{i}|>"}}' for i in range(n)]
    lines += ["elements:"] + [f"  e{i}: {{open: o{i}, close: {{markers: [c{i}]}}}}"
                              for i in range(n)]
    lines += ["top: [" + ", ".join(f"e{i}" for i in range(n)) + "]"]
    with hang_guard():
        with pytest.raises(SpecError) as info:
            parse_spec("\n".join(lines))
        assert info.value.path == "elements" and "256" in info.value.message


# exponential shapes, and polynomial ones that blow up on a header-length string
CATASTROPHIC = [r"(a|a)*", r"(a|a)*b", r"(a+)+b", r"(\w+\s?)*$", r"(aa|a)*b", r"(.*a){20}",
                r"(a?){25}a{25}", r"(x+x+)+y", r"(?:a|b|ab)*c", r"(a{1,3})*b", r"(?:a*)*b",
                r"^(([a-z])+.)+[A-Z]([a-z])+$", r"(\d+|\w+)*x", r"(?:x|xy|xyz)*!",
                r"\w*\w*\w*\w*\w*!", r".*.*.*.*="]
# deterministic shapes: every character has one way to be matched (Python also turns
# single-character alternatives such as (a|b|c|a) into a character set)
SAFE = [r'(?:\\.|[^"\\])*', r'\s*(?P<tag>\w+)((?:\s+[\w.:-]+="[^"]*")*)\s*',
        r"(?P<role>\w+)(?: name=(?P<name>[^\n]*))?\n", r"\s*", r"(?:[^<]|<(?!/))*",
        r"(?:ab)*", r"(a|ab)*c", r"(ab|a)*c", r"(?>a+)+b", r"[a-z]+(?:-[a-z]+)*",
        r"(a|b|c|a)*d", r"(?:\s*,\s*\w+)*;", r"(?i)(a|A|b)+c"]


def _adversarial(pattern: str, n: int) -> list[str]:
    chars = set(re.sub(r"\\.", "", pattern)) | {"a", " ", "0"}
    return [c * n + "\x00" for c in chars if c.isprintable()]


@pytest.mark.parametrize("pattern", CATASTROPHIC)
def test_catastrophic_patterns_are_rejected(pattern):
    """The classic catastrophic-backtracking shapes are rejected before any input is run."""
    with hang_guard():
        assert regex_risk(pattern), pattern


@pytest.mark.parametrize("pattern", SAFE)
def test_deterministic_patterns_are_accepted_and_fast(pattern):
    max_len = 64 * HEADER_CHARS_PER_TOKEN
    assert regex_risk(pattern, max_len) is None, pattern
    rx = re.compile(pattern, re.S)
    for s in _adversarial(pattern, max_len):
        with hang_guard():
            rx.fullmatch(s)


def test_bundled_patterns_pass_the_check():
    for name in FORMATS:
        spec = cg.load_format(name).spec
        pats = [spec.between] + [h.pattern for el in spec.elements.values()
                                 for h in (el.header, el.close.header if el.close else None)
                                 if h is not None]
        for p in filter(None, pats):
            assert regex_risk(p) is None, (name, p)


def _spec(pattern: str, max_tokens: int = 8, between: str | None = None) -> str:
    pat = pattern.replace("\\", "\\\\").replace('"', '\\"')
    btw = "" if between is None else f'between: "{between}"\n'
    return (
        "name: hostile\n"
        "markers:\n"
        '  start: {text: "<|s|>"}\n'
        '  end: {text: "<|e|>"}\n'
        "elements:\n"
        "  turn:\n"
        "    open: start\n"
        f'    header: {{until_text: "\\n", pattern: "{pat}", max_tokens: {max_tokens}}}\n'
        "    close: {markers: [end]}\n"
        "    role: assistant\n"
        "top: [turn]\n" + btw)


def test_catastrophic_pattern_in_a_spec_is_a_located_compile_error(tmp_path):
    path = tmp_path / "hostile.yaml"
    path.write_text(_spec(r"(?P<role>(a+)+)\n"), encoding="utf-8")
    with pytest.raises(CompileError) as info:
        cg.load_format(path)
    assert info.value.path == "elements.turn.header.pattern" and info.value.line == 8
    assert "catastrophic" in info.value.message


def test_patterns_only_ever_see_bounded_strings(tmp_path):
    """A polynomial pattern that is fast on header-length strings is accepted; fed a 2 MB
    header it still runs on at most the header budget: the header is over-long and fails its
    checks, at once, in both modes. 2 MB between turns are not matched either."""
    path = tmp_path / "poly.yaml"
    # cubic on a long run of 'a' — harmless at 8 tokens * 16 chars, hours on 2 MB
    path.write_text(_spec(r"(?P<role>a*a*a*)x?\n", max_tokens=8, between=r"\\s*"),
                    encoding="utf-8")
    fmt = cg.load_format(path)
    assert fmt.parse("<|s|>aaaa\nhi<|e|>").trained_text() == ["hi"]
    enc = format_encoding(fmt)
    for text in ("<|s|>" + "a" * 2_000_000 + "\nhi<|e|>",
                 "<|s|>a\nhi<|e|>" + "a" * 2_000_000 + "!" + "<|s|>a\nhi<|e|>"):
        with hang_guard():
            strict, lenient = check_contract(fmt, text, "text")
            assert isinstance(strict, ParseError)
            strict, lenient = check_contract(fmt, encode_rendered(enc, text), "ids", enc)
            assert isinstance(strict, ParseError)


# ------------------------------------------------------------------------- template sandbox

USER = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("template", [
    "{{ ().__class__.__base__.__subclasses__() }}",
    "{% for c in ().__class__.__mro__[1].__subclasses__() %}{{ c }}{% endfor %}",
    "{{ cycler.__init__.__globals__.os.popen('touch {path}').read() }}",
    "{{ lipsum.__globals__['os'].system('touch {path}') }}",
    "{{ self.__init__.__globals__ }}",
    "{{ messages.append(1) }}",
])
def test_template_escapes_fail_with_a_chatgrammar_error(tmp_path, template):
    target = tmp_path / "pwned"
    with pytest.raises(ChatGrammarError) as info:
        render_chat(template.replace("{path}", str(target)), USER, timeout=5)
    assert isinstance(info.value, TemplateError) and info.value.kind == "security"
    assert not target.exists()


def test_endless_template_is_stopped_by_the_time_limit():
    endless = ("{% for i in range(100000) %}{% for j in range(100000) %}"
               "{% for k in range(100000) %}{% endfor %}{% endfor %}{% endfor %}")
    with hang_guard():
        with pytest.raises(RenderTimeout) as info:
            render_chat(endless, USER, timeout=0.5)
        assert isinstance(info.value, ChatGrammarError)


# ------------------------------------------------------------------------ size and memory

def _long_ids(fmt, turn: str, n: int) -> np.ndarray:
    enc = format_encoding(fmt)
    one = encode_rendered(enc, turn)
    return np.asarray(one * (n // len(one) + 1), dtype=np.int64)


K2_LONG_TURN = ("<|im_user|>user<|im_middle|>Hello there, how are you today?<|im_end|>"
                "<|im_assistant|>assistant<|im_middle|><think>Answer politely. " + "word " * 200
                + "</think>Fine, thanks. " + "lorem ipsum " * 300 + "<|im_end|>")
K3_LONG_TURN = (K3_USER + '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>'
                + "word " * 200 + "<|close|>think<|sep|><|open|>response<|sep|>"
                + "lorem ipsum " * 300 + "<|close|>response<|sep|><|close|>message<|sep|>"
                "<|end_of_msg|>")


@pytest.mark.parametrize("name,turn", [("kimi-k2", K2_LONG_TURN), ("kimi-k3", K3_LONG_TURN)],
                         ids=["kimi-k2", "kimi-k3"])
def test_million_token_id_mode_in_bounded_memory(name, turn):
    """1M tokens in id mode: peak traced memory beyond the input well under 40 bytes/token
    (the lexers keep one tuple per marker, never one object per token)."""
    fmt = cg.load_format(name)
    enc = format_encoding(fmt)
    arr = _long_ids(fmt, turn, 1_000_000)
    as_list = arr.tolist()
    fmt.loss_mask(arr[:4096], enc)  # bind the tokenizer outside the measurement
    for data in (arr, as_list):
        tracemalloc.start()
        try:
            mask = fmt.loss_mask(data, enc)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert len(mask) == len(arr)
        assert peak / len(arr) < 40, f"{name}: {peak / len(arr):.1f} bytes/token"
    assert int(np.asarray(mask).sum()) > 0.9 * len(arr)


def _retained_after(run, n: int) -> int:
    """Bytes still allocated after ``run(k)`` for k < n (what caches kept)."""
    run(0)
    tracemalloc.start()
    try:
        base, _ = tracemalloc.get_traced_memory()
        for k in range(1, n):
            run(k)
        cur, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return cur - base


def test_memo_memory_stays_bounded_over_long_runs(monkeypatch):
    """A long data run must not leak through the parse memos: a sample whose between-text
    differs every time, and samples whose free-text headers never repeat (K2's message
    names), keep memory bounded in both modes."""
    from chatgrammar.runtime import fastpath
    from chatgrammar.runtime.format import Format

    chatml = cg.load_format("chatml")
    fmt = Format(chatml.spec, chatml.source)  # a fresh memo
    enc = format_encoding(fmt)

    def varying_between(k):
        return ("<|im_start|>user\nhi<|im_end|>" + " " * (k % 1000) + "\n" * (k // 1000)
                + "<|im_start|>assistant\nyo<|im_end|>")

    assert _retained_after(lambda k: fmt.parse(varying_between(k)), 2000) < 1_000_000
    assert _retained_after(lambda k: fmt.loss_mask(
        enc.encode(varying_between(k), allowed_special="all"), enc), 800) < 300_000
    monkeypatch.setattr(fastpath, "_MAX_ITEMS", 200)
    k2 = Format(cg.load_format("kimi-k2").spec, cg.load_format("kimi-k2").source)
    enc2 = format_encoding(k2)

    def unique_names(k):
        return (f"<|im_user|>user{k}<|im_middle|>hi<|im_end|>"
                f"<|im_assistant|>name{k}<|im_middle|>yo<|im_end|>")

    assert _retained_after(lambda k: k2.parse(unique_names(k)), 1000) < 3_000_000
    assert _retained_after(lambda k: k2.loss_mask(
        enc2.encode(unique_names(k), allowed_special="all"), enc2), 600) < 1_600_000


@pytest.mark.parametrize("megabytes", [10, pytest.param(100, marks=pytest.mark.slow)])
def test_hundred_megabyte_text(k2, megabytes):
    """~100 MB (10 MB in the default run, 100 MB with --runslow) of rendered K2 text parses in
    one pass; spans and mask are computed from the typed result without per-character Python
    objects (memory measured on a tenth of it: under a byte per char beyond input and mask)."""
    n_turns = megabytes * 1_000_000 // len(K2_LONG_TURN) + 1
    text = K2_LONG_TURN * n_turns
    conv = k2.parse(text)
    assert len(conv.turns) == 2 * n_turns
    spans = conv.spans()
    assert len(spans) == 2 * n_turns
    mask = conv.mask_array()
    assert mask.dtype == np.int8 and mask.shape == (len(text),)
    del mask, conv, spans
    # memory, measured on a tenth of it: beyond the input, the int8 mask plus under a byte
    # per char for everything else (turn objects: a few hundred bytes per turn)
    text = K2_LONG_TURN * (n_turns // 10)
    tracemalloc.start()
    try:
        conv = k2.parse(text)
        mask = conv.mask_array()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert (peak - mask.nbytes) / len(text) < 1.0
