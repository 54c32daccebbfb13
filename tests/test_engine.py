"""The spec language, construct by construct, on tiny inline specs — no bundled format involved.

Each spec is a YAML string written to a temporary file and loaded with ``cg.load_format(path)``.
Every parse runs in text mode AND in id mode, through :class:`MiniTokenizer` — the minimal
tokenizer protocol (``convert_tokens_to_ids`` + ``decode``): every marker is one id, ordinary
text is one id per character (plus optional merged tokens, to put a boundary inside a token),
``decode`` joins. A variant leaves the soft markers out of the vocabulary, so the id lexer's
decoded-text fallback finds them. With one id per character, token offsets map back to exact
char offsets, so the two modes are compared span for span (:func:`run`).
"""
from __future__ import annotations

import itertools
import pickle
import re
import textwrap

import numpy as np
import pytest

import chatgrammar as cg
from chatgrammar.errors import CompileError, ParseError, SpecError

# --------------------------------------------------------------------------- the tokenizer


class MiniTokenizer:
    """The minimal tokenizer protocol, nothing else.

    Ids: markers ``1..k`` (declaration order), merged tokens ``500+``, any other BMP character
    ``CHAR0 + ord(c)``. Ids outside that decode with a KeyError (a real tokenizer raises too);
    the adapter turns them into U+FFFD.

    Args:
        markers: strings that are single ids (marker texts).
        merges: multi-character ordinary tokens, applied greedily (longest first) to text.
    """

    CHAR0 = 1000

    def __init__(self, markers, merges=()):
        self.vocab = {m: 1 + i for i, m in enumerate(markers)}
        self.vocab.update({m: 500 + i for i, m in enumerate(merges)})
        self.inv = {v: k for k, v in self.vocab.items()}
        self._markers = sorted(markers, key=len, reverse=True)
        self._merges = sorted(merges, key=len, reverse=True)

    def convert_tokens_to_ids(self, token):
        if token in self.vocab:
            return self.vocab[token]
        return self.CHAR0 + ord(token) if len(token) == 1 else None

    def decode(self, ids):
        out = []
        for i in ids:
            i = int(i)
            if i in self.inv:
                out.append(self.inv[i])
            elif self.CHAR0 <= i < self.CHAR0 + 0x10000:
                out.append(chr(i - self.CHAR0))
            else:
                raise KeyError(i)
        return "".join(out)

    def encode(self, text, *, plain=""):
        """Ids of ``text``: marker strings become their id; ``plain`` (appended) stays
        ordinary characters even where it spells a marker (text typed by a user)."""
        ids, i = [], 0
        while i < len(text):
            for piece in self._markers + self._merges:
                if text.startswith(piece, i):
                    ids.append(self.vocab[piece])
                    i += len(piece)
                    break
            else:
                ids.append(self.CHAR0 + ord(text[i]))
                i += 1
        return ids + [self.CHAR0 + ord(c) for c in plain]

    def starts(self, ids):
        """Char offset of each id (and the total length last)."""
        out, pos = [], 0
        for i in ids:
            out.append(pos)
            pos += len(self.decode([i]))
        return out + [pos]


def tokenizer(fmt, *, soft_ids=True, merges=()):
    """A MiniTokenizer for ``fmt``: every marker one id (soft ones only with ``soft_ids``)."""
    marks = [m.text for m in fmt.spec.markers.values() if soft_ids or m.special]
    return MiniTokenizer(marks, merges)


# --------------------------------------------------------------------------- loading specs

_counter = itertools.count()


@pytest.fixture
def make(tmp_path):
    """``make(yaml) -> Format``: write a spec to a fresh file and load it by path."""
    def _make(yaml_text: str):
        p = tmp_path / f"spec{next(_counter)}.yaml"
        p.write_text(textwrap.dedent(yaml_text), encoding="utf-8")
        return cg.load_format(p)
    return _make


@pytest.fixture(scope="module")
def fmts(tmp_path_factory):
    """The shared specs below, compiled once per module."""
    d = tmp_path_factory.mktemp("specs")
    out = {}
    for name, text in SPECS.items():
        p = d / f"{name}.yaml"
        p.write_text(textwrap.dedent(text), encoding="utf-8")
        out[name] = cg.load_format(p)
    return out


# --------------------------------------------------------------------------- running a case

MODES = ["text", "ids", "ids-soft-decoded"]


class Run:
    """One input parsed in one mode, with spans and turns in CHAR offsets whatever the mode."""

    def __init__(self, fmt, text, mode, *, strict=True, merges=(), plain=""):
        self.fmt, self.mode, self.text = fmt, mode, text + plain
        if mode == "text":
            self.conv = fmt.parse(text + plain, strict=strict)
            self.starts = list(range(len(self.text) + 1))
            self.ids = None
        else:
            self.tok = tokenizer(fmt, soft_ids=mode == "ids", merges=merges)
            self.ids = self.tok.encode(text, plain=plain)
            self.conv = fmt.parse_ids(self.ids, self.tok, strict=strict)
            self.starts = self.tok.starts(self.ids)
            assert self.tok.decode(self.ids) == self.text

    def c(self, k):
        """Char offset of unit ``k`` (char or token)."""
        return self.starts[k]

    def spans(self, policy=None):
        return [(self.c(s.start), self.c(s.end), s.kind, s.role)
                for s in self.conv.spans(policy)]

    def trained(self, policy=None):
        return [self.text[a:b] for a, b, _, _ in self.spans(policy)]

    def kinds(self, policy=None):
        return [(self.text[a:b], kind) for a, b, kind, _ in self.spans(policy)]

    def turns(self):
        return [(t.role, self.c(t.start), self.c(t.end), t.complete) for t in self.conv.turns]

    def roles(self):
        return [t.role for t in self.conv.turns]

    def facts(self):
        """Everything but offsets' units: headers, attributes, kinds, flags, warnings."""
        return ([(t.header, t.attrs, t.block.tag, t.block.kind, t.block.close, t.valid,
                  t.generation_prompt,
                  None if t.body_start is None else (self.c(t.body_start), self.c(t.body_end)))
                 for t in self.conv.turns],
                [(self.c(w.offset), w.message) for w in self.conv.warnings])

    def mask(self, policy=None):
        m = self.conv.mask(policy)
        assert len(m) == (len(self.text) if self.mode == "text" else len(self.ids))
        return m


def run(fmt, text, mode, **kw) -> Run:
    return Run(fmt, text, mode, **kw)


def run_all(fmt, text, policy=None, **kw) -> Run:
    """Parse in every mode; the modes must agree on turns and trained spans. Returns the
    text-mode run."""
    runs = [Run(fmt, text, m, **kw) for m in MODES]
    for r in runs[1:]:
        assert r.turns() == runs[0].turns(), r.mode
        assert r.spans(policy) == runs[0].spans(policy), r.mode
        assert r.facts() == runs[0].facts(), r.mode
    for r in runs:
        check_spans(r.conv)
        if r.mode != "text":  # loss_mask (which may take a memoised path) == parse_ids' mask
            strict = kw.get("strict", True)
            assert r.fmt.loss_mask(r.ids, r.tok, policy=policy, strict=strict) == r.mask(policy)
            assert r.fmt.loss_mask(r.ids, r.tok, strict=strict) == r.mask()
    return runs[0]


def check_spans(conv):
    """The Span contract: sorted, non-overlapping, non-empty, inside the input."""
    prev = 0
    for s in conv.spans():
        assert prev <= s.start < s.end <= conv.length, conv.spans()
        prev = s.end


# --------------------------------------------------------------------------- the specs

SPECS = {
    # until_text header read by a pattern with named groups; soft think / tool-call children;
    # a preamble marker; whitespace and a pad marker between turns; generation prompts
    "chatml": r'''
        name: eng-chatml
        markers:
          bos: {text: "<bos>"}
          start: {text: "<|im_start|>"}
          end: {text: "<|im_end|>"}
          pad: {text: "<pad>"}
          think: {text: "<think>", special: false}
          think_end: {text: "</think>", special: false}
          call: {text: "<tool_call>", special: false}
          call_end: {text: "</tool_call>", special: false}
        elements:
          turn:
            open: start
            header: {until_text: "\n", pattern: "(?P<role>\\w+)(?: name=(?P<name>\\w+))?\n"}
            close: {markers: [end]}
            children: [think, call]
          think: {open: think, close: {markers: [think_end]}, kind: think}
          call: {open: call, close: {markers: [call_end]}, kind: tool_call}
        top: [turn]
        preamble: [bos]
        between: "\\s*"
        between_markers: [pad]
        role_aliases: {model: assistant}
        generation_prompt: ["<|im_start|>assistant\n", "<|im_start|>assistant\n<think>\n"]
    ''',
    # header ended by a marker, optional (required: false); close alternatives
    "llama": r'''
        name: eng-llama
        markers:
          sh: {text: "<|sh|>"}
          eh: {text: "<|eh|>"}
          eot: {text: "<|eot|>"}
          eom: {text: "<|eom|>"}
        elements:
          turn:
            open: sh
            header: {until: eh, pattern: "(?P<role>\\w+)", required: false}
            close: {markers: [eot, eom]}
        top: [turn]
        role_aliases: {model: assistant, ipython: tool}
    ''',
    # markers inside a header (Harmony's <|channel|>); kind from a header attribute
    "harmony": r'''
        name: eng-harmony
        markers:
          start: {text: "<|start|>"}
          channel: {text: "<|channel|>"}
          message: {text: "<|message|>"}
          end: {text: "<|end|>"}
          return: {text: "<|return|>"}
          call: {text: "<|call|>"}
        elements:
          msg:
            open: start
            header:
              until: message
              markers: [channel]
              pattern: "(?P<role>[\\w.]+)(?:<\\|channel\\|>(?P<channel>\\w+))?(?: to=(?P<to>\\S+))?"
            close: {markers: [end, return, call]}
            kind_by_attr: {channel: {analysis: think, commentary: tool_call}}
        top: [msg]
        role_aliases: {functions.f: tool}
    ''',
    # XTML: tag + attributes, close header, a marker after the close, nesting
    "xtml": r'''
        name: eng-xtml
        markers:
          open: {text: "<|open|>"}
          close: {text: "<|close|>"}
          sep: {text: "<|sep|>"}
          eom: {text: "<|eom|>"}
        elements:
          message:
            tag: message
            open: open
            header: {until: sep, attributes: xtml}
            close: {markers: [close], header: {until: sep}, after: [eom]}
            children: [element]
          element:
            open: open
            header: {until: sep, attributes: xtml}
            close: {markers: [close], header: {until: sep}}
            children: [element]
            kind_by_tag: {think: think, tools: tool_call, response: content}
            kind_by_attr: {type: {image: media}}
        top: [message]
    ''',
    # an implicit element after a close (Mistral's reply after [/INST])
    "mistral": r'''
        name: eng-mistral
        markers:
          bos: {text: "<s>"}
          eos: {text: "</s>"}
          inst: {text: "[INST]"}
          inst_end: {text: "[/INST]"}
        elements:
          inst: {open: inst, close: {markers: [inst_end]}, role: user, follow: reply}
          reply: {close: {markers: [eos]}, role: assistant}
        top: [inst]
        preamble: [bos]
    ''',
    # elements without a close marker: they end at the next opener or at the end of input;
    # role by opener; an inner marker; a preamble element with a child
    "noclose": r'''
        name: eng-noclose
        markers:
          sys: {text: "<|system|>"}
          user: {text: "<|user|>"}
          bot: {text: "<|bot|>"}
          image: {text: "<|image|>"}
          tools: {text: "<tools>"}
          tools_end: {text: "</tools>"}
        elements:
          system:
            open: sys
            role: system
            children: [tools]
          turn:
            open: [user, bot]
            role_by_marker: {user: user, bot: assistant}
            inner_markers: [image]
          tools: {open: tools, close: {markers: [tools_end]}, kind: tools}
        top: [turn]
        preamble: [system]
    ''',
}


# =========================================================================== headers

def test_header_until_a_marker(fmts):
    text = "<|sh|>user<|eh|>hi<|eot|><|sh|>assistant<|eh|>yo<|eom|><|sh|>model<|eh|>m<|eot|>"
    r = run_all(fmts["llama"], text)
    assert r.turns() == [("user", 0, 25, True), ("assistant", 25, 55, True),
                         ("assistant", 55, 80, True)]  # role_aliases: model -> assistant
    t = r.conv.turns[1]
    assert (t.header, t.attrs, t.block.close) == ("assistant", {"role": "assistant"}, "eom")
    assert (t.block.header_start, t.block.header_end, t.body_start, t.body_end) == \
        (31, 40, 46, 48)
    assert (t.block.close_start, t.block.close_end) == (48, 55)
    assert r.trained() == ["yo", "m"]
    assert r.conv.turns[2].header == "model"  # the header as written; the role is aliased


def test_header_until_not_required(fmts):
    """`required: false`: an element whose header terminator is missing has no body (trains
    nothing) and is no error; the turns after it train."""
    text = "<|sh|>assistant<|eot|><|sh|>assistant<|eh|>yo<|eot|>"
    r = run_all(fmts["llama"], text)
    assert r.turns() == [("assistant", 0, 22, True), ("assistant", 22, 52, True)]
    assert r.conv.turns[0].body_start is None and r.conv.turns[0].header == "assistant"
    assert r.trained() == ["yo"] and r.conv.warnings == []


@pytest.mark.parametrize("mode", MODES)
def test_header_until_required(fmts, make, mode):
    fmt = make(SPECS["llama"].replace("name: eng-llama", "name: eng-llama-req")
               .replace(", required: false", ""))
    with pytest.raises(ParseError) as info:
        run(fmt, "<|sh|>assistant<|eot|><|sh|>assistant<|eh|>yo<|eot|>", mode)
    e = info.value
    r = run(fmt, "<|sh|>assistant<|eot|>", mode, strict=False)
    assert r.c(e.offset) == 15 and e.expected == ["eh '<|eh|>'"]
    assert e.message == "unexpected eot '<|eot|>'"


def test_header_until_text_with_a_pattern(fmts):
    """The header is the text run after the opener up to and including `until_text`; the
    pattern's named groups become Turn.attrs and the `role` group the role."""
    text = "<|im_start|>user name=bob\nhi<|im_end|>\n<|im_start|>model\nyo<|im_end|>"
    r = run_all(fmts["chatml"], text)
    assert r.roles() == ["user", "assistant"]
    assert [(t.header, t.attrs) for t in r.conv.turns] == [
        ("user name=bob\n", {"role": "user", "name": "bob"}), ("model\n", {"role": "model"})]
    t = r.conv.turns[1]
    assert (t.block.header_start, t.block.header_end, t.body_start, t.body_end) == \
        (51, 57, 57, 59)
    assert r.trained() == ["yo"]


def test_until_text_straddling_a_merged_token(fmts):
    """Id mode: when `until_text` ends inside a merged token, that token belongs to the body
    (it trains: no trained character is left out) and the boundary is reported."""
    fmt = fmts["chatml"]
    text = "<|im_start|>user\nhi<|im_end|><|im_start|>assistant\nHello<|im_end|>"
    assert run(fmt, text, "text").trained() == ["Hello"]
    for mode in ("ids", "ids-soft-decoded"):
        r = run(fmt, text, mode, merges=["t\nHe"])
        k = r.ids.index(r.tok.vocab["t\nHe"])
        assert r.trained() == ["t\nHello"]
        assert [(b.offset, b.message) for b in r.conv.boundaries] == \
            [(k, "header end '\\n' falls inside a merged token")]
        t = r.conv.turns[1]
        assert t.header == "assistant\n" and t.role == "assistant" and t.body_start == k
    # a merged token that ends exactly at the delimiter is no boundary
    r = run(fmt, text, "ids", merges=["t\n"])
    assert r.trained() == ["Hello"] and r.conv.boundaries == []


def test_markers_inside_a_header(fmts):
    """`header.markers`: markers that may appear inside a header (Harmony's <|channel|>); the
    header text spells them, so the pattern reads them."""
    text = ("<|start|>user<|message|>hi<|end|>"
            "<|start|>assistant<|channel|>analysis<|message|>think<|end|>"
            "<|start|>assistant<|channel|>commentary to=functions.f<|message|>{}<|call|>"
            "<|start|>functions.f to=assistant<|message|>42<|end|>"
            "<|start|>assistant<|channel|>final<|message|>yo<|return|>")
    r = run_all(fmts["harmony"], text)
    assert [(t.header, t.attrs, t.block.kind, t.block.close) for t in r.conv.turns] == [
        ("user", {"role": "user"}, None, "end"),
        ("assistant<|channel|>analysis", {"role": "assistant", "channel": "analysis"},
         "think", "end"),
        ("assistant<|channel|>commentary to=functions.f",
         {"role": "assistant", "channel": "commentary", "to": "functions.f"}, "tool_call",
         "call"),
        ("functions.f to=assistant", {"role": "functions.f", "to": "assistant"}, None, "end"),
        ("assistant<|channel|>final", {"role": "assistant", "channel": "final"}, None,
         "return")]
    assert r.roles() == ["user", "assistant", "assistant", "tool", "assistant"]
    assert r.kinds() == [("think", "think"), ("{}", "tool_call"), ("yo", "content")]
    assert r.trained(cg.MaskPolicy(thinking=False, tool_calls=False)) == ["yo"]
    # the header pattern is matched whole: a header it does not fit is an error
    with pytest.raises(ParseError, match="does not match"):
        fmts["harmony"].parse("<|start|>assistant<|channel|><|channel|>x<|message|>y<|end|>")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name, text, offset", [
    ("llama", "<|sh|>user name<|eh|>hi", 6),
    ("chatml", "<|im_start|>user hi\nfoo", 12),
    ("xtml", '<|open|>message role="a" role="b"<|sep|>hi', 8),
    ("xtml", '<|open|>msg role="user"<|sep|>hi', 8),
])
def test_a_whole_malformed_header_is_an_error_even_in_a_cut_turn(fmts, name, text, offset, mode):
    """Whether a header is malformed depends on the header, not on whether the turn's close
    made it into the sample: a header followed by its terminator is checked (strict: error,
    lenient: warning + the turn trains nothing) even when the input ends later in the turn."""
    fmt = fmts[name]
    with pytest.raises(ParseError) as info:
        run(fmt, text, mode)
    r = run(fmt, text, mode, strict=False)
    assert r.c(info.value.offset) == offset
    assert [w.offset for w in r.conv.warnings] == [info.value.offset]
    assert r.spans(cg.MaskPolicy(roles=("user", "assistant", "a", "unknown"))) == []
    assert not r.conv.turns[0].valid


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name, text", [
    ("llama", "<|sh|>user na"),
    ("chatml", "<|im_start|>user h"),
    ("xtml", '<|open|>message role="a" ro'),
])
def test_a_header_cut_by_the_end_of_input_is_not_an_error(fmts, name, text, mode):
    r = run(fmts[name], text, mode)
    assert r.conv.warnings == [] and r.spans() == []
    assert not r.conv.turns[0].complete


UNTERMINATED_HEADER = r'''
    name: eng-unterminated-header
    markers:
      a: {text: "<A>"}
      e: {text: "<E>"}
      th: {text: "<think>"}
      the: {text: "</think>"}
    elements:
      turn:
        open: a
        role: assistant
        header: {until_text: "\n", required: false}
        close: {markers: [e]}
        children: [think]
      think: {open: th, close: {markers: [the]}, kind: think}
    top: [turn]
'''


@pytest.mark.parametrize("mode", MODES)
def test_a_header_without_its_terminator_trains_nothing_of_the_body(make, mode):
    """`required: false` + a header that never reaches its `until_text`: the whole run is
    header, the element has no body, and its blocks do not train either."""
    fmt = make(UNTERMINATED_HEADER)
    for text in ["<A>hdr<think>x</think>y<E>", "<A>hdr<think>x</think>y"]:
        r = run(fmt, text, mode)
        assert r.conv.turns[0].header == "hdr"
        assert r.spans() == [] and r.conv.warnings == []
    r = run(fmt, "<A>hdr\n<think>x</think>y<E>", mode)
    assert r.kinds() == [("<think>x</think>", "think"), ("y", "content")]


# =========================================================================== XTML

def test_xtml_tag_and_attributes(fmts):
    """`attributes: xtml`: the header is `tag key="value" …`; values unescape &amp; and
    &quot;; the role comes from the parsed `role` attribute, never from a substring."""
    text = ('<|open|>message role="user" name="assistant"<|sep|>hi<|close|>message<|sep|><|eom|>'
            '<|open|>message role="assistant" note="a &amp; b &quot;c&quot; &lt;"<|sep|>'
            'yo<|close|>message<|sep|><|eom|>')
    r = run_all(fmts["xtml"], text)
    assert r.roles() == ["user", "assistant"]
    assert [(t.block.tag, t.attrs) for t in r.conv.turns] == [
        ("message", {"role": "user", "name": "assistant"}),
        ("message", {"role": "assistant", "note": 'a & b "c" &lt;'})]
    assert r.trained() == ["yo"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("text, message", [
    ('<|open|>message role="user" role="x"<|sep|>hi<|close|>message<|sep|>',
     "malformed XTML header 'message role=\"user\" role=\"x\"'"),
    ('<|open|>message role=user<|sep|>hi<|close|>message<|sep|>',
     "malformed XTML header 'message role=user'"),
    ('<|open|>message role="user"<|sep|>hi<|close|>mesage<|sep|>',
     "close tag 'mesage' does not match open tag 'message'"),
    ('<|open|>msg role="user"<|sep|>hi<|close|>msg<|sep|>',
     "expected a <message> element, found <msg>"),
    ('<|open|>message<|sep|>hi<|close|>message<|sep|>', "cannot tell the role of this turn"),
])
def test_xtml_errors(fmts, text, message, mode):
    """Malformed XTML is an error (strict) or a warning + a turn that trains nothing
    (lenient); the next turn still trains."""
    ok = '<|open|>message role="assistant"<|sep|>yo<|close|>message<|sep|>'
    with pytest.raises(ParseError) as info:
        run(fmts["xtml"], text + ok, mode)
    assert info.value.message == message
    r = run(fmts["xtml"], text + ok, mode, strict=False)
    assert [w.message for w in r.conv.warnings] == [message]
    assert [t.valid for t in r.conv.turns] == [False, True]
    assert r.trained(cg.MaskPolicy(roles=("user", "assistant", "unknown"))) == ["yo"]


def test_close_header_and_after_markers(fmts):
    """`close.header`: text after the close marker up to `until` (XTML's `message<|sep|>`);
    `close.after`: optional markers that still belong to the end. Both are the terminator
    region (kind `end`, trained with end_marker)."""
    text = ('<|open|>message role="assistant"<|sep|>a<|close|>message<|sep|><|eom|>'
            '<|open|>message role="assistant"<|sep|>b<|close|>message<|sep|>')
    r = run_all(fmts["xtml"], text)
    assert [(t.block.close, t.start, t.end) for t in r.conv.turns] == [
        ("close", 0, 70), ("close", 70, 133)]
    policy = cg.MaskPolicy(end_marker=True)
    assert r.kinds(policy) == [("a", "content"), ("<|close|>message<|sep|><|eom|>", "end"),
                               ("b", "content"), ("<|close|>message<|sep|>", "end")]


def test_xtml_nesting_is_not_recursive(fmts):
    """Thousands of nested elements: no recursion limit in parsing, spans or masks."""
    depth = 3000
    text = ('<|open|>message role="assistant"<|sep|>' + "<|open|>a<|sep|>x" * depth
            + "<|close|>a<|sep|>" * depth + "<|close|>message<|sep|><|eom|>")
    for mode in ("text", "ids"):
        r = run(fmts["xtml"], text, mode)
        assert len(r.trained()) == 1 and sum(r.mask()) > 0
        assert len(list(r.conv.turns[0].block.walk())) == depth + 1
        r = run(fmts["xtml"], text[:len(text) // 2], mode)  # cut in the middle: truncation
        assert not r.conv.turns[0].complete and len(r.trained()) == 1


# =========================================================================== closes and follows

def test_elements_without_a_close_end_at_the_next_opener(fmts):
    """`close: null`: the element runs to the next opener, or to the end of input (where it
    is complete: nothing says it was cut). The role comes from the opener (role_by_marker);
    an inner marker is part of the body."""
    text = "<|system|>be nice<tools>[]</tools>!<|user|>hi<|image|>x<|bot|>yo<|user|>q<|bot|>a"
    r = run_all(fmts["noclose"], text)
    assert r.turns() == [("system", 0, 35, True), ("user", 35, 55, True),
                         ("assistant", 55, 64, True), ("user", 64, 73, True),
                         ("assistant", 73, 81, True)]
    assert [c.kind for c in r.conv.turns[0].block.children] == ["tools"]
    assert r.trained() == ["yo", "a"]
    assert r.trained(cg.MaskPolicy(roles=("user",))) == ["hi<|image|>x", "q"]
    assert r.trained(cg.MaskPolicy(roles=("system",))) == ["be nice", "<tools>[]</tools>", "!"]
    assert r.trained(cg.MaskPolicy(roles=("system",), exclude_kinds=("tools",))) == \
        ["be nice", "!"]
    assert all(t.block.close is None for t in r.conv.turns)
    r = run_all(fmts["noclose"], "<|bot|>")  # an empty last element
    assert r.turns() == [("assistant", 0, 7, True)] and r.trained() == []


def test_follow_element(fmts):
    """`follow`: an element without an opener that starts where another closes (Mistral's
    reply after `[/INST]`, up to `</s>`); it may be empty, and may be missing at the end."""
    text = "<s>[INST]q[/INST]a</s>[INST]q2[/INST]</s>[INST]q3[/INST]"
    r = run_all(fmts["mistral"], text)
    assert r.turns() == [("user", 3, 17, True), ("assistant", 17, 22, True),
                         ("user", 22, 37, True), ("assistant", 37, 41, True),
                         ("user", 41, 56, True)]
    assert r.conv.turns[0].block.follow is r.conv.turns[1].block
    assert r.trained() == ["a"]
    assert r.kinds(cg.MaskPolicy(end_marker=True)) == [("a", "content"), ("</s>", "end"),
                                                       ("</s>", "end")]
    r = run_all(fmts["mistral"], "<s>[INST]q[/INST]the ans")  # a reply cut short
    assert r.turns() == [("user", 3, 17, True), ("assistant", 17, 24, False)]
    assert r.trained() == ["the ans"]
    assert r.trained(cg.MaskPolicy(truncated=False)) == []


CHAIN = """
    name: chain
    markers: {t: {text: "<t>"}, e: {text: "<e>"}, s: {text: ">>"}}
    elements:
      turn: {open: t, header: {until_text: "\\n", pattern: "(?P<role>\\\\w+)\\n"},
             close: {markers: [e]}, children: [seg]}
      seg:
        open: s
        header: {until_text: "\\n", pattern: "(?P<to>\\\\w*)\\n", required: false}
        ends_with_parent: true
        children: [seg]
        kind_by_attr: {to: {all: content, "*": tool_call}}
    top: [turn]
"""


def test_a_chain_of_ends_with_parent_elements(make):
    """An `ends_with_parent` element may be the child of another one: each runs to where its
    parent ends, the chain to the first ancestor's close (Functionary's `>>>` segments, one
    after the other with no terminator). Each is a span of its own kind."""
    fmt = make(CHAIN)
    assert "e_seg: M_S HEADER? (TEXT)* (e_seg)?" in fmt.grammar
    text = "<t>user\nq >> x<e><t>bot\n>>all\nhi>>f\n{1}>>g\n{2}<e>"
    r = run_all(fmt, text)
    assert r.roles() == ["user", "bot"]
    pol = cg.MaskPolicy(roles=("bot",))
    # neighbouring spans of one kind merge; the call segments are two nested blocks
    assert r.kinds(pol) == [(">>all\nhi", "content"), (">>f\n{1}>>g\n{2}", "tool_call")]
    assert r.trained(pol.replace(tool_calls=False)) == [">>all\nhi"]
    segs = r.conv.turns[1].block.children
    assert [b.kind for b in (segs[0], segs[0].children[0], segs[0].children[0].children[0])] \
        == ["content", "tool_call", "tool_call"]
    assert len(segs) == 1 and not segs[0].children[0].children[0].children
    # the parent of an ends_with_parent child needs a close, or to be ends_with_parent itself
    with pytest.raises(CompileError, match="'tail' is a child of 'seg', which has no close"):
        make("""
            name: chain-bad
            markers: {t: {text: "<t>"}, e: {text: "<e>"}, s: {text: ">>"}, x: {text: "<x>"}}
            elements:
              turn: {open: t, close: {markers: [e]}, children: [seg]}
              seg: {open: s, children: [tail]}
              tail: {open: x, ends_with_parent: true}
            top: [turn]
        """)


def test_close_alternatives_record_which_one_closed(fmts):
    r = run_all(fmts["llama"], "<|sh|>assistant<|eh|>a<|eot|><|sh|>assistant<|eh|>b<|eom|>")
    assert [t.block.close for t in r.conv.turns] == ["eot", "eom"]
    assert r.kinds(cg.MaskPolicy(end_marker=True)) == [
        ("a", "content"), ("<|eot|>", "end"), ("b", "content"), ("<|eom|>", "end")]


TRAINED_AFTER = r'''
    name: eng-trained-after
    markers:
      start: {text: "<|start|>"}
      channel: {text: "<|channel|>"}
      message: {text: "<|message|>"}
      end: {text: "<|end|>"}
      call: {text: "<|call|>"}
    elements:
      msg:
        open: start
        header:
          until: message
          markers: [channel]
          pattern: "(?P<role>[\\w.]+)(?: to=(?P<to>[\\w.]+))?(?:<\\|channel\\|>(?P<channel>\\w+))?"
          trained_after: role
        close: {markers: [end, call]}
        kind_by_attr: {to: {"*": tool_call}, channel: {analysis: think}}
    top: [msg]
    role_aliases: {functions.f: tool}
    generation_prompt: ["<|start|>assistant"]
'''
HARMONYISH = ("<|start|>user<|message|>hi<|end|>"
              "<|start|>assistant<|channel|>analysis<|message|>T<|end|>"
              "<|start|>assistant to=functions.f<|channel|>commentary<|message|>{}<|call|>"
              "<|start|>functions.f<|message|>42<|end|>"
              "<|start|>assistant<|channel|>final<|message|>yo<|end|>")


def test_header_trained_after_a_group(make):
    """`header.trained_after`: the header text after the end of the named group is model
    output (Harmony's channel and recipient after `<|start|>assistant`): it trains with the
    body, as the turn's kind, its `until` marker included; the opener and the role do not."""
    fmt = make(TRAINED_AFTER)
    r = run_all(fmt, HARMONYISH)
    assert r.kinds() == [("<|channel|>analysis<|message|>T", "think"),
                         (" to=functions.f<|channel|>commentary<|message|>{}", "tool_call"),
                         ("<|channel|>final<|message|>yo", "content")]
    b = r.conv.turns[2].block
    at = HARMONYISH.index(" to=")
    assert (b.train_start, b.header_end, b.body_start) == \
        (at, HARMONYISH.index("<|message|>{}"), HARMONYISH.index("{}"))
    # a kind the policy drops goes whole, header included; so does its terminator
    assert r.trained(cg.MaskPolicy(thinking=False, tool_calls=False, end_marker=True)) == \
        ["<|channel|>final<|message|>yo", "<|end|>"]
    assert r.kinds(cg.MaskPolicy(end_marker=True))[:2] == [
        ("<|channel|>analysis<|message|>T", "think"), ("<|end|>", "end")]
    # every role's header trains after the role; here a user header is only its terminator
    assert r.trained(cg.MaskPolicy(roles=("user",))) == ["<|message|>hi"]
    # an empty body still trains the header's tail
    assert run_all(fmt, "<|start|>assistant<|channel|>final<|message|><|end|>").trained() == \
        ["<|channel|>final<|message|>"]


@pytest.mark.parametrize("mode", MODES)
def test_trained_after_generation_prompt_and_cuts(make, mode):
    """The generation prompt trains nothing; a turn cut inside its header trains nothing of
    the header (even where the group already ended); once the header's terminator is in, the
    header's tail and the content present train."""
    fmt = make(TRAINED_AFTER)
    head = "<|start|>user<|message|>hi<|end|>"
    turn = "<|start|>assistant to=functions.f<|channel|>commentary<|message|>{\"a\": 1}<|call|>"
    body_at = turn.index("{")
    inside = {k for m in re.finditer(r"<\|\w+\|>", turn) for k in range(m.start() + 1, m.end())}
    for k in range(len(turn) + 1):
        if k in inside:
            continue  # text cut inside a marker string: another test's subject
        r = run(fmt, head + turn[:k], mode)
        got = r.trained()
        if k <= len("<|start|>assistant"):
            assert got == [], k
        elif k < body_at:
            assert got == [], (k, turn[:k])
        else:
            want = turn[len("<|start|>assistant"):min(k, len(turn) - len("<|call|>"))]
            assert got == [want], k
    r = run(fmt, head + "<|start|>assistant", mode)
    assert r.conv.turns[-1].generation_prompt and r.trained() == []


def test_trained_after_straddling_a_merged_token(make):
    """Id mode: a token that holds the end of the group and text after it trains (no trained
    character is left out) and the boundary is reported."""
    fmt = make(TRAINED_AFTER)
    text = "<|start|>assistant to=functions.f<|channel|>commentary<|message|>{}<|call|>"
    assert run(fmt, text, "text").trained() == \
        [" to=functions.f<|channel|>commentary<|message|>{}"]
    for mode in ("ids", "ids-soft-decoded"):
        r = run(fmt, text, mode, merges=["nt to"])
        k = r.ids.index(r.tok.vocab["nt to"])
        assert r.trained() == ["nt to=functions.f<|channel|>commentary<|message|>{}"]
        assert [(b.offset, b.message) for b in r.conv.boundaries] == \
            [(k, "header `trained_after` boundary falls inside a merged token (trained)")]
        assert r.conv.turns[0].block.train_start == k
        assert fmt.loss_mask(r.ids, r.tok) == r.mask()
    # a merged token that ends exactly at the group's end is no boundary
    r = run(fmt, text, "ids", merges=["assistant"])
    assert r.conv.boundaries == [] and r.trained() == run(fmt, text, "text").trained()


def test_trained_after_a_group_that_did_not_match(make):
    """A group that takes no part in the match: the header does not train, the body does."""
    fmt = make(TRAINED_AFTER.replace("trained_after: role", "trained_after: to"))
    r = run_all(fmt, HARMONYISH)
    assert r.trained() == ["T", "<|channel|>commentary<|message|>{}", "yo"]


OPENS_FOLLOW = r'''
    name: eng-opens-follow
    markers:
      u: {text: "<U>"}
      a: {text: "<A>"}
      e: {text: "<E>"}
      th: {text: "<think>", special: false}
      the: {text: "</think>", special: false}
    elements:
      user: {open: u, role: user}
      asst:
        open: a
        close: {markers: [e]}
        role: assistant
        inner_markers: [the]
        follow: results
      results:
        close: {markers: [the, th], opens_follow: true}
        role: tool
        follow: reply
      reply:
        close: {markers: [e]}
        role: assistant
        inner_markers: [the]
        follow: results
    top: [user, asst]
'''


def test_close_opens_follow(make):
    """`close.opens_follow`: the marker that ends an element is the first thing of its follow
    element (DeepSeek-V3.2's reply starts with the `</think>` that ends the function results):
    the follow starts at it and it trains with the follow's body."""
    fmt = make(OPENS_FOLLOW)
    text = "<U>q<A>call<E>\n\nRESULTS\n\n</think>answer<E>"
    r = run_all(fmt, text)
    assert r.turns() == [("user", 0, 4, True), ("assistant", 4, 14, True),
                         ("tool", 14, 25, True), ("assistant", 25, 42, True)]
    assert r.trained() == ["call", "</think>answer"]
    tool = r.conv.turns[2].block
    assert (tool.close, tool.close_start, tool.close_end) == ("the", 25, 25)
    assert r.conv.turns[3].body_start == 25
    # the tool turn has no terminator of its own left: nothing of it trains as `end`
    assert r.kinds(cg.MaskPolicy(roles=("tool",), end_marker=True)) == \
        [("\n\nRESULTS\n\n", "content")]
    r = run_all(fmt, text.replace("</think>answer", "<think>r</think>answer"))
    assert r.trained() == ["call", "<think>r</think>answer"]
    # no follow element (the input ends at the marker): the marker stays the element's end
    r = run_all(fmt, "<U>q<A>call<E>\n\nRESULTS\n\n</think>")
    assert r.turns()[-1] == ("tool", 14, 33, True) and r.trained() == ["call"]
    assert r.conv.turns[-1].block.close_end == 33


FOLLOW_AFTER = r'''
    name: eng-follow-after
    markers:
      t: {text: "<T>"}
      e: {text: "<E>"}
      w: {text: "<W>"}
      r: {text: "<R>"}
    elements:
      turn:
        open: t
        header: {until_text: "\n", pattern: "(?P<role>\\w+)\n"}
        close: {markers: [e, w], follow_after: [w]}
        follow: result
      result:
        role: tool
        close: {markers: [r], follow_after: [r]}
        follow: reply
      reply:
        role: assistant
        close: {markers: [e, w], follow_after: [w]}
        follow: result
    top: [turn]
    between: "\\s*"
    role_aliases: {model: assistant}
'''


def test_close_follow_after(make):
    """`close.follow_after`: the follow comes after those close markers only, and always there
    (Gemma 4: a model turn stopped by `<|tool_response>` goes on with the tool's response, then
    the model again; one closed by `<turn|>` is followed only by the newline between turns,
    which an optional follow starting with text could not tell from `between` text)."""
    fmt = make(FOLLOW_AFTER)
    assert "(M_E | M_W e_result)" in fmt.grammar and "e_result?" not in fmt.grammar
    text = "<T>user\nq<E>\n<T>model\ncall<W>res<R>ans<E>\n"
    r = run_all(fmt, text)
    assert r.roles() == ["user", "assistant", "tool", "assistant"]
    assert r.turns()[1:] == [("assistant", 13, 29, True), ("tool", 29, 35, True),
                             ("assistant", 35, 41, True)]
    assert r.trained() == ["call", "ans"]
    assert r.kinds(cg.MaskPolicy(end_marker=True)) == [
        ("call", "content"), ("<W>", "end"), ("ans", "content"), ("<E>", "end")]
    # two rounds, and an empty reply between two results
    r = run_all(fmt, "<T>model\nc1<W>r1<R>c2<W>r2<R><W>r3<R>done<E>")
    assert r.roles() == ["assistant", "tool", "assistant", "tool", "assistant", "tool",
                         "assistant"]
    assert r.trained() == ["c1", "c2", "done"]
    # the input ends where the follow must come: a follow of which nothing was written is no
    # turn; one cut inside is a turn (incomplete)
    for cut, roles, last_complete in (("<T>model\ncall<W>", ["assistant"], True),
                                      ("<T>model\ncall<W>re", ["assistant", "tool"], False),
                                      ("<T>model\ncall<W>res<R>", ["assistant", "tool"], True),
                                      ("<T>model\ncall<W>res<R>an", ["assistant", "tool",
                                                                    "assistant"], False)):
        r = run_all(fmt, cut)
        assert (r.roles(), r.conv.turns[-1].complete) == (roles, last_complete), cut
        assert r.trained() == ["call"] + (["an"] if cut.endswith("an") else []), cut
    # after the other close marker nothing follows: text there is `between` text
    with pytest.raises(ParseError, match="does not match `between`"):
        fmt.parse("<T>model\nx<E>stray")
    turn_close = "close: {markers: [e, w], follow_after: [w]}\n        follow: result\n"
    for bad, path, message in (
            ("close: {markers: [e, w], follow_after: [r]}\n        follow: result\n",
             "elements.turn.close.follow_after[0]",
             "`follow_after` marker 'r' is not one of this element's close markers"),
            ("close: {markers: [e, w], follow_after: [w]}\n",
             "elements.turn.close.follow_after",
             "`close.follow_after` needs a `follow` element, and a close marker without a "
             "close header")):
        with pytest.raises(CompileError) as info:
            make(FOLLOW_AFTER.replace(turn_close, bad, 1))
        assert (info.value.path, info.value.message) == (path, message)


OPENER_LESS = r'''
    name: eng-opener-less
    markers:
      b: {text: "<B>"}
      r: {text: "<R>"}
      e: {text: "<E>"}
      q: {text: "<Q>"}
      a: {text: "<A>"}
    elements:
      turn:
        header: {until: r, pattern: "(?:\n\n)?(?P<role>\\w+)"}
        close: {markers: [e]}
      ask:
        open: q
        close: {markers: [a], follow_after: [a]}
        role: user
        follow: answer
      answer:
        header: {until: r, pattern: "(?P<role>\\w+)"}
        close: {markers: [e]}
    top: [turn, ask]
    preamble: [b]
    between: "\\s*"
    role_aliases: {model: assistant}
'''


def test_opener_less_headed_turns(make):
    """An element without an opener whose header ends at a marker (GigaChat: the role text
    before `<|role_sep|>`): the header is read where the element starts (input start, after a
    preamble marker, after the close of what it follows); between-text can only end the
    input (elsewhere it is the next header's start); a run at the end that `between` rejects
    is a turn cut inside its header."""
    fmt = make(OPENER_LESS)
    assert "e_turn: TEXT M_R (TEXT)* M_E" in fmt.grammar
    text = "<B>system<R>S<E>\n\nuser<R>Q<E>\n\nmodel<R>A<E>\n\n"
    r = run_all(fmt, text)
    assert r.roles() == ["system", "user", "assistant"]
    assert [t.header for t in r.conv.turns] == ["system", "\n\nuser", "\n\nmodel"]
    assert r.trained() == ["A"] and all(t.complete for t in r.conv.turns)
    # at the start of the input (no BOS), and as a follow element
    r = run_all(fmt, "model<R>A<E><Q>q<A>model<R>B<E>")
    assert r.roles() == ["assistant", "user", "assistant"] and r.trained() == ["A", "B"]
    # cut inside the next header: a turn (incomplete) that trains nothing, not between text
    for cut, header in (("\n\nmod", "\n\nmod"), ("\n\nmodel", "\n\nmodel")):
        r = run_all(fmt, text[:-2] + cut)
        last = r.conv.turns[-1]
        assert (len(r.conv.turns), last.header, last.complete) == (4, header, False)
        assert r.trained() == ["A"]
    r = run_all(fmt, text[:-2] + "\n\nmodel<R>Par")
    assert r.trained() == ["A", "Par"] and not r.conv.turns[-1].complete


# =========================================================================== bodies

CONV = ("<bos><|im_start|>system\nS<|im_end|>\n<|im_start|>user\nQ<|im_end|>\n"
        "<|im_start|>assistant\n<think>T</think>A<tool_call>C</tool_call><|im_end|>\n"
        "<|im_start|>tool\nR<|im_end|>\n<|im_start|>assistant\nB<|im_end|>\n<pad><pad>")


def test_children_and_kinds(fmts):
    r = run_all(fmts["chatml"], CONV)
    assert r.roles() == ["system", "user", "assistant", "tool", "assistant"]
    assert r.kinds() == [("<think>T</think>", "think"), ("A", "content"),
                         ("<tool_call>C</tool_call>", "tool_call"), ("B", "content")]
    kids = r.conv.turns[2].block.children
    assert [(c.name, c.kind, c.open, c.close) for c in kids] == [
        ("think", "think", "think", "think_end"), ("call", "tool_call", "call", "call_end")]


@pytest.mark.parametrize("policy, expected", [
    (None, ["<think>T</think>", "A", "<tool_call>C</tool_call>", "B"]),
    (cg.MaskPolicy(thinking=False), ["A", "<tool_call>C</tool_call>", "B"]),
    (cg.MaskPolicy(tool_calls=False), ["<think>T</think>", "A", "B"]),
    (cg.MaskPolicy(exclude_kinds=("think", "content")), ["<tool_call>C</tool_call>"]),
    (cg.MaskPolicy(end_marker=True),
     ["<think>T</think>", "A", "<tool_call>C</tool_call>", "<|im_end|>", "B", "<|im_end|>"]),
    (cg.MaskPolicy(last_turn_only=True), ["B"]),
    (cg.MaskPolicy(roles=("user", "tool")), ["Q", "R"]),
    (cg.MaskPolicy(roles="system"), ["S"]),
    (cg.MaskPolicy(roles=()), []),
])
def test_policies(fmts, policy, expected):
    r = run_all(fmts["chatml"], CONV, policy)
    assert r.trained(policy) == expected
    # the format's declared default is used for policy=None
    assert r.conv.default_policy == cg.MaskPolicy()


def test_truncated_policy_and_last_turn_only(fmts):
    text = CONV[:CONV.index("B<|im_end|>") + 1]  # the last assistant turn is cut after "B"
    r = run_all(fmts["chatml"], text)
    assert r.conv.turns[-1].complete is False and r.trained()[-1] == "B"
    assert r.trained(cg.MaskPolicy(truncated=False)) == \
        ["<think>T</think>", "A", "<tool_call>C</tool_call>"]
    # last_turn_only picks among the turns that train at all
    assert r.trained(cg.MaskPolicy(truncated=False, last_turn_only=True)) == \
        ["<think>T</think>", "A", "<tool_call>C</tool_call>"]
    # the terminator of a cut turn never trains (there is none)
    assert r.trained(cg.MaskPolicy(end_marker=True))[-1] == "B"


def test_role_sources(fmts):
    """role: declared on the element, else by opener (role_by_marker), else the header's
    `role` (pattern group or XTML attribute); role_aliases map it to the canonical role."""
    assert run_all(fmts["mistral"], "[INST]q[/INST]a</s>").roles() == ["user", "assistant"]
    assert run_all(fmts["noclose"], "<|user|>q<|bot|>a").roles() == ["user", "assistant"]
    assert run_all(fmts["chatml"], "<|im_start|>model\na<|im_end|>").roles() == ["assistant"]
    assert run_all(fmts["llama"], "<|sh|>ipython<|eh|>42<|eot|>").roles() == ["tool"]


@pytest.mark.parametrize("mode", MODES)
def test_nested_blocks_keep_their_own_kind_at_any_depth(fmts, mode):
    """A block's kind holds at any depth: a think element inside a response element is think
    (dropped whole by thinking=False), an image inside a tool call is media (dropped by
    exclude_kinds); a block with no kind of its own takes its parent's."""
    text = ('<|open|>message role="assistant"<|sep|>'
            '<|open|>response<|sep|>A<|open|>think<|sep|>T<|close|>think<|sep|>B'
            '<|close|>response<|sep|>'
            '<|open|>tools<|sep|>C<|open|>x type="image"<|sep|>I<|close|>x<|sep|>'
            '<|open|>arg<|sep|>D<|close|>arg<|sep|><|close|>tools<|sep|>'
            '<|close|>message<|sep|><|eom|>')
    r = run(fmts["xtml"], text, mode)
    think = "<|open|>think<|sep|>T<|close|>think<|sep|>"
    image = '<|open|>x type="image"<|sep|>I<|close|>x<|sep|>'
    assert r.kinds() == [
        ("<|open|>response<|sep|>A", "content"), (think, "think"),
        ("B<|close|>response<|sep|>", "content"),
        ("<|open|>tools<|sep|>C", "tool_call"), (image, "media"),
        ("<|open|>arg<|sep|>D<|close|>arg<|sep|><|close|>tools<|sep|>", "tool_call")]
    assert r.kinds(cg.MaskPolicy(thinking=False, exclude_kinds=("media",))) == [
        ("<|open|>response<|sep|>A", "content"), ("B<|close|>response<|sep|>", "content"),
        ("<|open|>tools<|sep|>C", "tool_call"),
        ("<|open|>arg<|sep|>D<|close|>arg<|sep|><|close|>tools<|sep|>", "tool_call")]
    # a dropped block is dropped whole, whatever it holds
    assert r.trained(cg.MaskPolicy(tool_calls=False)) == [
        "<|open|>response<|sep|>A", think, "B<|close|>response<|sep|>"]
    check_spans(r.conv)


@pytest.mark.parametrize("merge", ["<think></think>", "k></think>"])
def test_two_soft_markers_in_one_token_are_both_seen(fmts, merge):
    """Soft markers found in decoded text (no single id): when one ordinary token holds the
    end of one marker and all of the next, the second is still a marker (zero-width at the
    token boundary) instead of silently becoming text."""
    fmt = fmts["chatml"]
    text = "<|im_start|>assistant\n<think></think>yo<|im_end|>"
    r = run(fmt, text, "ids-soft-decoded", merges=[merge])
    assert r.kinds() == [("<think></think>", "think"), ("yo", "content")]
    assert r.conv.boundaries  # the marker edges inside a token are reported
    assert r.trained(cg.MaskPolicy(thinking=False)) == ["yo"]


TEXTLESS = r'''
    name: eng-textless
    markers:
      s: {text: "<s>"}
      e: {text: "</s>"}
      ms: {text: "<|ms|>"}
      pad: {text: "<|pad|>"}
      me: {text: "<|me|>"}
    elements:
      turn:
        open: s
        role: assistant
        close: {markers: [e]}
        children: [media]
      media:
        open: ms
        inner_markers: [pad]
        close: {markers: [me]}
        text: false
        kind: media
    top: [turn]
'''


@pytest.mark.parametrize("mode", MODES)
def test_text_false_body_holds_only_markers_and_children(make, mode):
    fmt = make(TEXTLESS)
    r = run(fmt, "<s>a<|ms|><|pad|><|pad|><|me|>b</s>", mode)
    assert r.kinds() == [("a", "content"), ("<|ms|><|pad|><|pad|><|me|>", "media"),
                         ("b", "content")]
    with pytest.raises(ParseError) as info:
        run(fmt, "<s>a<|ms|><|pad|>x<|me|>b</s>", mode)
    assert info.value.message == "unexpected text"
    assert info.value.expected == ["me '<|me|>'", "pad '<|pad|>'"]


# =========================================================================== around the turns

def test_preamble_marker_and_between(fmts):
    """`preamble`: optional items before the first turn, once; `between`: text between turns
    that must match the regex; `between_markers`: markers allowed between turns (padding)."""
    r = run_all(fmts["chatml"], "<bos>\n<|im_start|>assistant\na<|im_end|>\n\n<pad>\n<pad>")
    assert r.turns() == [("assistant", 6, 39, True)] and r.trained() == ["a"]
    r = run_all(fmts["chatml"], "")
    assert r.turns() == [] and r.mask() == []
    fmt = fmts["chatml"]
    for mode in MODES:  # the preamble marker is allowed only at the start
        with pytest.raises(ParseError) as info:
            run(fmt, "<|im_start|>user\nq<|im_end|><bos>", mode)
        assert info.value.message == "unexpected bos '<bos>'"
        assert info.value.expected == ["pad '<pad>'", "start '<|im_start|>'", "text",
                                       "end of input"]


def test_preamble_element(fmts):
    r = run_all(fmts["noclose"], "<|system|>S<|user|>q")
    assert r.roles() == ["system", "user"]
    with pytest.raises(ParseError, match="unexpected sys"):
        fmts["noclose"].parse("<|user|>q<|system|>S")


@pytest.mark.parametrize("mode", MODES)
def test_text_between_turns_that_does_not_match(fmts, mode):
    fmt = fmts["chatml"]
    text = "<|im_start|>user\nq<|im_end|>oops<|im_start|>assistant\na<|im_end|>"
    with pytest.raises(ParseError) as info:
        run(fmt, text, mode)
    e = info.value
    r = run(fmt, text, mode, strict=False)
    assert r.c(e.offset) == 28
    assert e.message == "text between turns does not match `between` ('\\\\s*')"
    assert [(r.c(w.offset), w.message) for w in r.conv.warnings] == [(28, e.message)]
    assert r.trained() == ["a"]


def test_generation_prompt(fmts):
    """A last turn that is exactly a declared generation prompt trains nothing (and says so);
    anything else — more text, or the same text not at the end — is an ordinary turn."""
    fmt = fmts["chatml"]
    head = "<|im_start|>user\nq<|im_end|>\n"
    for tail in ["<|im_start|>assistant\n", "<|im_start|>assistant\n<think>\n"]:
        r = run_all(fmt, head + tail)
        assert r.conv.turns[-1].generation_prompt and r.trained() == []
    for tail, trained in [("<|im_start|>assistant\nA", ["A"]),
                          ("<|im_start|>assistant\n<think>\nx", ["<think>\nx"]),
                          ("<|im_start|>assistant\n<think>", ["<think>"])]:
        r = run_all(fmt, head + tail)
        assert not r.conv.turns[-1].generation_prompt and r.trained() == trained
    r = run_all(fmt, "<|im_start|>assistant\n<|im_end|>\n")
    assert not r.conv.turns[-1].generation_prompt and r.conv.turns[-1].complete


PREAMBLE_CHILD = r'''
    name: eng-preamble-child
    markers:
      s: {text: "<s>"}
      e: {text: "</s>"}
      tools: {text: "<tools>"}
      tools_end: {text: "</tools>"}
    elements:
      turn:
        open: s
        header: {until_text: "\n", pattern: "(?P<role>\\w+)\n"}
        close: {markers: [e]}
        children: [decl]
      decl: {open: tools, close: {markers: [tools_end]}, kind: tools, role: system}
    top: [turn]
    preamble: [decl]
'''


@pytest.mark.parametrize("mode", MODES)
def test_a_preamble_element_nested_in_a_turn_is_not_a_turn(make, mode):
    """An element listed in the preamble and also used as a child: only the occurrence at the
    top of the input is a (preamble) turn; nested occurrences stay blocks of their turn."""
    fmt = make(PREAMBLE_CHILD)
    text = "<tools>T</tools><s>system\nx<tools>U</tools></s><s>assistant\nyo</s>"
    r = run(fmt, text, mode)
    assert r.turns() == [("system", 0, 16, True), ("system", 16, 47, True),
                         ("assistant", 47, 66, True)]
    assert [c.kind for c in r.conv.turns[1].block.children] == ["tools"]
    assert r.trained() == ["yo"]
    # without the preamble occurrence: no phantom turn either
    r = run(fmt, text[16:], mode)
    assert r.roles() == ["system", "assistant"]


# =========================================================================== truncation

SAMPLES = {
    "chatml": CONV,
    "llama": "<|sh|>user<|eh|>hi<|eot|><|sh|>model<|eh|>yo<|eom|><|sh|>assistant<|eot|>",
    "harmony": ("<|start|>user<|message|>hi<|end|>"
                "<|start|>assistant<|channel|>analysis<|message|>th<|end|>"
                "<|start|>assistant<|channel|>final<|message|>yo<|return|>"),
    "xtml": ('<|open|>message role="user"<|sep|>hi<|close|>message<|sep|><|eom|>'
             '<|open|>message role="assistant"<|sep|>a<|open|>think<|sep|>t<|close|>think'
             '<|sep|>b<|close|>message<|sep|><|eom|>'),
    "mistral": "<s>[INST]q[/INST]a</s>[INST]q2[/INST]</s>[INST]q3[/INST]",
    "noclose": "<|system|>be<tools>[]</tools>!<|user|>hi<|image|>x<|bot|>yo<|user|>q<|bot|>a",
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_truncation_at_every_prefix(fmts, name, mode):
    """Cut anywhere: strict parsing never raises, the mask has one value per unit, nothing
    trains that the whole conversation does not train, and nothing of a turn trains before
    its body starts (a cut inside a header trains nothing of that turn)."""
    fmt, text = fmts[name], SAMPLES[name]
    full = run(fmt, text, mode)
    full_mask = full.mask()
    n = len(text) if mode == "text" else len(full.ids)
    for k in range(n + 1):
        conv = (fmt.parse(text[:k]) if mode == "text"
                else fmt.parse_ids(full.ids[:k], full.tok))
        mask = conv.mask()
        assert len(mask) == k
        assert all(m <= f for m, f in zip(mask, full_mask)), k
        if mode != "text":
            assert fmt.loss_mask(full.ids[:k], full.tok) == mask
        check_spans(conv)
        starts = [t.start for t in full.conv.turns]
        assert [t.start for t in conv.turns] == starts[:len(conv.turns)]
        for s in conv.spans():
            whole = full.conv.turns[s.turn]
            assert whole.body_start <= s.start and s.end <= k, (k, s)
        if k < n and conv.turns:
            last = conv.turns[-1]
            assert last.end <= k


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_closing_a_cut_input_is_the_same_from_the_driver_memo(fmts, name):
    """The driver keeps, per state stack, the synthetic terminators that closed a cut input
    (Driver._closings): every prefix parses to the same conversation with the memo filled
    as with it empty."""
    fmt, text = fmts[name], SAMPLES[name]

    def shape(conv):
        return ([(t.role, t.start, t.end, t.complete, t.valid, t.block.body_start,
                  t.block.body_end, t.block.close_start, t.block.close_end)
                 for t in conv.turns], conv.spans(), [w.message for w in conv.warnings])
    hits = 0
    for k in range(len(text) + 1):
        fmt._driver._closings.clear()
        fmt._text_memo = None  # (the text memo would answer a parse seen before itself)
        first = shape(fmt.parse(text[:k], strict=False))
        filled = len(fmt._driver._closings)
        fmt._text_memo = None
        again = shape(fmt.parse(text[:k], strict=False))  # closed from the memo
        hits += filled > 0
        assert again == first, k
    assert hits


@pytest.mark.parametrize("name, text, marker", [
    ("chatml", "<|im_start|>assistant\nyo<|im_e", "<|im_e"),
    ("chatml", "<|im_start|>assistant\nyo<thi", "<thi"),
    ("xtml", '<|open|>message role="assistant"<|sep|>yo<|clo', "<|clo"),
    ("noclose", "<|bot|>yo<|us", "<|us"),
])
def test_text_cut_inside_a_marker_string(fmts, name, text, marker):
    """Text mode: input ending inside a marker string is reported, and the fragment trains
    nothing (it is the start of a terminator, not content)."""
    conv = fmts[name].parse(text)
    cut = len(text) - len(marker)
    assert [(w.offset, w.message) for w in conv.warnings] == \
        [(cut, f"input ends inside a marker ({marker!r})")]
    assert conv.trained_text() == ["yo"] and len(conv.mask()) == len(text)
    assert conv.turns[-1].end == cut
    # a cut terminator leaves the turn incomplete; a cut opener (of the next element, for
    # elements that end where the next one opens) does not
    assert conv.turns[-1].complete == (name == "noclose")


@pytest.mark.parametrize("mode", MODES)
def test_a_cut_element_names_no_close_marker(fmts, mode):
    """The end of input closes what is open with zero-width synthetic terminators: the turn
    is incomplete, and it names no close marker (none was written: a cut Harmony message is
    not a `<|call|>` just because that terminator was picked to finish the parse)."""
    text = "<|start|>assistant<|channel|>commentary to=functions.f<|message|>{\"a\""
    r = run(fmts["harmony"], text, mode)
    t = r.conv.turns[0]
    assert (t.complete, t.block.close, t.block.kind) == (False, None, "tool_call")
    assert r.c(t.block.close_start) == r.c(t.block.close_end) == len(text)
    assert r.kinds(cg.MaskPolicy(end_marker=True)) == [('{"a"', "tool_call")]


# =========================================================================== errors

@pytest.mark.parametrize("mode", ["text", "ids"])
def test_parse_error_fields(fmts, mode):
    """A structure error names its position, what was found and what the grammar expected
    there, in spec terms (marker names and texts, not grammar terminals), with an excerpt."""
    fmt = fmts["chatml"]
    text = "<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n<think>a<|im_end|>"
    with pytest.raises(ParseError) as info:
        run(fmt, text, mode)
    e = info.value
    assert e.message == "unexpected end '<|im_end|>'"
    assert e.expected == ["think_end '</think>'", "text"]
    assert (e.mode, e.format) == (mode, "eng-chatml")
    assert not any("M_" in x or x in ("TEXT", "HEADER", "$END") for x in e.expected)
    if mode == "text":
        assert e.offset == text.rindex("<|im_end|>")
        assert f"at char {e.offset}" in str(e)
        line, caret = e.excerpt.splitlines()
        assert caret.index("^") == line.index("<|im_end|>", line.index("<think>"))
    else:
        ids = tokenizer(fmt).encode(text)
        assert e.offset == len(ids) - 1 and f"at token {e.offset}" in str(e)
        assert e.excerpt.splitlines()[0].endswith(f"| {ids[-1]}")


@pytest.mark.parametrize("mode", MODES)
def test_lenient_parsing_skips_a_broken_turn_and_keeps_the_rest(fmts, mode):
    fmt = fmts["chatml"]
    text = ("<|im_start|>assistant\nok<|im_end|>\n"
            "<|im_start|>assistant\n<think>a<|im_end|>\n"   # never closes its think
            "<|im_start|>assistant\nfine<|im_end|>")
    r = run(fmt, text, mode, strict=False)
    assert r.trained() == ["ok", "fine"]
    assert [(r.c(w.offset), w.message) for w in r.conv.warnings] == [
        (text.index("<|im_end|>", 40), "skipped malformed input: unexpected end '<|im_end|>'; "
                                       "expected think_end '</think>', text")]


def _mutants(text, markers):
    """Inputs one edit away from a well-formed one: each marker occurrence deleted, doubled,
    or moved to the end."""
    spots = sorted((i, m) for m in markers for i in range(len(text)) if text.startswith(m, i))
    for i, m in spots:
        yield text[:i] + text[i + len(m):]
        yield text[:i] + m + text[i:]
        yield text[:i] + text[i + len(m):] + m


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_lenient_never_raises(fmts, name):
    """Broken inputs: strict raises ParseError only; lenient never raises, explains what it
    skipped when strict would have raised, and keeps the mask contract."""
    fmt = fmts[name]
    markers = [m.text for m in fmt.spec.markers.values()]
    for text in _mutants(SAMPLES[name], markers):
        for mode in ("text", "ids", "ids-soft-decoded"):
            try:
                run(fmt, text, mode)
                failed = False
            except ParseError:
                failed = True
            r = run(fmt, text, mode, strict=False)
            r.mask()
            check_spans(r.conv)
            if failed:
                assert r.conv.warnings, (mode, text)


# =========================================================================== compile errors

BASE = r'''
name: eng-base
markers:
  a: {text: "<A>"}
  e: {text: "<E>"}
elements:
  turn:
    open: a
    role: assistant
    close: {markers: [e]}
top: [turn]
'''


def _edit(old, new, text=BASE):
    assert old in text
    return text.replace(old, new, 1)


@pytest.mark.parametrize("yaml_text, line, col, path, message", [
    (_edit("markers: [e]", "markers: [zz]"), 10, 23, "elements.turn.close.markers[0]",
     "unknown marker 'zz'; declared markers: a, e"),
    (_edit("open: a", "open: [a, b]"), 8, 15, "elements.turn.open[1]",
     "unknown marker 'b'; declared markers: a, e"),
    (_edit("top: [turn]", "top: [turn, nope]"), 11, 13, "top[1]",
     "unknown element 'nope'; declared elements: turn"),
    (_edit("role: assistant", "role: assistant\n    children: [kid]"), 10, 16,
     "elements.turn.children[0]", "unknown element 'kid'; declared elements: turn"),
    (_edit('e: {text: "<E>"}', 'e: {text: "<A>"}'), 5, 6, "markers.e",
     "marker text '<A>' is declared twice ('a' and 'e')"),
    (_edit("role: assistant", "role: assistant\n    header: {pattern: x}"), 10, 13,
     "elements.turn.header",
     "a header needs exactly one of `until` (a marker) or `until_text` (a literal)"),
    (BASE + 'between: ".*"\n', 12, 10, "between",
     "content pattern '.*' can swallow marker 'a' ('<A>')"),
    (_edit("role: assistant", 'role: assistant\n    header: {until_text: ":", pattern: ".+"}'),
     10, 40, "elements.turn.header.pattern",
     "content pattern '.+' can swallow marker 'a' ('<A>')"),
])
def test_compile_errors(make, yaml_text, line, col, path, message):
    """Semantic errors Lark cannot see, located file:line:col + YAML path, in spec terms."""
    with pytest.raises(CompileError) as info:
        make(yaml_text)
    e = info.value
    assert (e.line, e.col, e.path) == (line, col, path)
    assert e.message == message
    assert str(e).startswith(f"{e.file}:{line}:{col}: {path}: ")


@pytest.mark.parametrize("yaml_text, path, message", [
    (_edit("role: assistant", 'role: assistant\n    header: {until_text: ":", pattern: '
           '"(?P<role>\\\\w+):", trained_after: name}'),
     "elements.turn.header.trained_after",
     "`trained_after` names 'name', which is not a named group of this header's `pattern`"),
    (_edit("role: assistant", 'role: assistant\n    header: {until_text: ":", '
           'trained_after: role}'),
     "elements.turn.header.trained_after",
     "`trained_after` names 'role', which is not a named group of this header's `pattern`"),
    (_edit("close: {markers: [e]}", 'close: {markers: [e], header: {until: a, pattern: '
           '"(?P<x>\\\\w*)", trained_after: x}}'),
     "elements.turn.close.header.trained_after",
     "`trained_after` is for an element's header (a close header is part of the terminator)"),
    (_edit("close: {markers: [e]}", "close: {markers: [e], opens_follow: true}"),
     "elements.turn.close.opens_follow",
     "`close.opens_follow` needs a `follow` element without a header, and a close marker "
     "without a close header or `after` markers"),
])
def test_construct_compile_errors(make, yaml_text, path, message):
    """`header.trained_after` and `close.opens_follow` misuse, located in spec terms."""
    with pytest.raises(CompileError) as info:
        make(yaml_text)
    assert (info.value.path, info.value.message) == (path, message)
    assert info.value.line is not None


def test_catastrophic_backtracking_pattern_is_rejected(make):
    with pytest.raises(CompileError) as info:
        make(BASE + 'between: "(\\\\s+)+"\n')
    assert (info.value.line, info.value.col, info.value.path) == (12, 10, "between")
    assert "catastrophic backtracking" in info.value.message


def test_lalr_conflict_is_a_compile_error_in_spec_terms(make):
    """`between` text plus an element without a close whose body takes text: after `<U>…`
    the parser cannot tell the body's text from the text between turns."""
    spec = r'''
        name: eng-conflict
        markers:
          u: {text: "<U>"}
          a: {text: "<A>"}
        elements:
          turn:
            open: [u, a]
            role_by_marker: {u: user, a: assistant}
        top: [turn]
        between: "\\s*"
    '''
    with pytest.raises(CompileError) as info:
        make(spec)
    e = info.value
    assert (e.line, e.col, e.path) == (8, 5, "elements.turn")  # the element's body
    assert e.message.startswith("grammar is ambiguous")
    assert "element 'turn' (elements.turn)" in e.message
    assert "text" in e.message and "'<A>'" in e.message
    assert "e_turn" not in e.message and "M_A" not in e.message and "__" not in e.message


# =========================================================================== spec errors

def test_yaml_syntax_error_location(make):
    with pytest.raises(SpecError) as info:
        make(BASE.replace("top: [turn]", "top: [turn"))
    assert (info.value.line, info.value.col) == (12, 1)
    assert info.value.message.startswith("YAML error")
    assert not isinstance(info.value, CompileError)


def test_unknown_key_location(make):
    with pytest.raises(SpecError) as info:
        make(_edit("role: assistant", "role: assistant\n    colse: {markers: [e]}"))
    e = info.value
    assert (e.line, e.col, e.path, e.message) == \
        (10, 5, "elements.turn.colse", "unknown key 'colse'")


def test_wrong_type(make):
    with pytest.raises(SpecError) as info:
        make(_edit("role: assistant", "role: assistant\n    children: 3"))
    e = info.value
    assert (e.line, e.col, e.path) == (10, 15, "elements.turn.children")
    assert "valid list" in e.message and "(got 3)" in e.message


def test_python_tags_never_execute(make, tmp_path):
    marker = tmp_path / "pwned"
    with pytest.raises(SpecError) as info:
        make(BASE.replace("top: [turn]",
                          f"top: !!python/object/apply:os.system ['touch {marker}']"))
    assert not marker.exists()
    assert info.value.line == 11 and "python/object/apply:os.system" in info.value.message


# =========================================================================== Format API

def test_format_pickles(fmts):
    fmt = fmts["xtml"]
    back = pickle.loads(pickle.dumps(fmt))
    text = SAMPLES["xtml"]
    assert back.name == fmt.name and back.grammar == fmt.grammar
    assert back.parse(text).spans() == fmt.parse(text).spans()
    tok = tokenizer(fmt)
    assert back.loss_mask(tok.encode(text), tok) == fmt.loss_mask(tok.encode(text), tok)


def test_unknown_format_name_suggests():
    with pytest.raises(SpecError, match="Unknown format 'kimi-k4'. Did you mean 'kimi-k3'?"):
        cg.load_format("kimi-k4")


def test_loss_mask_containers(fmts):
    import torch

    fmt = fmts["chatml"]
    tok = tokenizer(fmt)
    ids = tok.encode("<|im_start|>user\nq<|im_end|><|im_start|>assistant\nab<|im_end|>")
    want = [0] * 19 + [1, 1, 0]
    assert fmt.loss_mask(ids, tok) == want
    assert fmt.loss_mask(tuple(ids), tok) == want
    for dtype in (np.int32, np.int64, np.uint32):
        m = fmt.loss_mask(np.array(ids, dtype=dtype), tok)
        assert isinstance(m, np.ndarray) and m.dtype == np.int64 and m.tolist() == want
    for dtype in (torch.int32, torch.long):
        m = fmt.loss_mask(torch.tensor(ids, dtype=dtype), tok)
        assert isinstance(m, torch.Tensor) and m.dtype == torch.long and m.tolist() == want
    assert fmt.loss_mask([], tok) == []
    assert fmt.loss_mask(np.array([], dtype=np.int64), tok).shape == (0,)
    assert fmt.loss_mask(torch.tensor([], dtype=torch.long), tok).shape == (0,)
    assert fmt.loss_masks([ids, ids[:20]], tok) == [want, want[:20]]


@pytest.mark.parametrize("bad", [[-5], [10 ** 9], [-1, 2 ** 40]])
def test_ids_outside_the_vocabulary(fmts, bad):
    """Negative or unknown ids are never markers; they decode as U+FFFD: strict parsing
    reports them where they break the structure, lenient parsing never raises."""
    fmt = fmts["chatml"]
    tok = tokenizer(fmt)
    ok = tok.encode("<|im_start|>assistant\nab<|im_end|>")
    inside = ok[:-1] + bad + ok[-1:]  # in content: just content
    assert fmt.loss_mask(inside, tok) == [0] * 11 + [1] * (2 + len(bad)) + [0]
    for ids in (bad + ok, ok + bad):
        with pytest.raises(ParseError) as info:
            fmt.parse_ids(ids, tok)
        assert info.value.offset in (0, len(ok))
        conv = fmt.parse_ids(ids, tok, strict=False)
        assert conv.warnings and len(conv.mask()) == len(ids)
        assert conv.spans()[0].end - conv.spans()[0].start == 2
