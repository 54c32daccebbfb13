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
import textwrap

import numpy as np
import pytest

import chatgrammar as cg
from chatgrammar.errors import ChatGrammarError, CompileError, ParseError, SpecError

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
        assert [t.generation_prompt for t in r.conv.turns] == \
            [t.generation_prompt for t in runs[0].conv.turns], r.mode
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
              pattern: "(?P<role>\\w+)(?:<\\|channel\\|>(?P<channel>\\w+))?(?: to=(?P<to>[\\w.]+))?"
            close: {markers: [end, return, call]}
            kind_by_attr: {channel: {analysis: think, commentary: tool_call}}
        top: [msg]
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


# --------------------------------------------------------------------------- header checks

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


# --------------------------------------------------------------------------- preamble

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


# --------------------------------------------------------------------------- spans of nested blocks

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


# --------------------------------------------------------------------------- text: false

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
