"""Stage 1 — YAML format specs → validated ``FormatSpec`` models.

YAML is read with ``yaml.SafeLoader`` only (a ``!!python/...`` tag is a SpecError, nothing
executes). Every error names ``file:line:col`` and the YAML path, found by composing the YAML
node tree alongside the data so pydantic's error locations map back to source positions.
"""
from __future__ import annotations

import dataclasses
import difflib
import re
from pathlib import Path
from typing import (Annotated, Any, Callable, Literal, Optional, Union, get_args, get_origin,
                    get_type_hints)

import yaml
from pydantic import (BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, WithJsonSchema,
                      create_model, field_validator)

from ..errors import SpecError
from ..runtime.policy import MaskPolicy

ROLE_NAMES = ("system", "user", "assistant", "tool", "developer")
#: A format name: kebab-case (dots allowed between parts: ``deepseek-v3.2``).
NAME_PATTERN = r"[a-z0-9]+(?:[-.][a-z0-9]+)*"


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=False)


# Every key of the spec language is documented once, in its Field(description=...): the JSON
# Schema (`chatgrammar schema`) and the key reference of docs/writing-a-format.md
# (`chatgrammar schema --markdown`) are generated from these models. A model's docstring says
# what the whole thing is; what each key means belongs to its Field.


class Marker(_Model):
    """A literal string the grammar treats as one terminal (everything between markers is
    text)."""

    text: str = Field(min_length=1, description=(
        "The literal (`<|im_end|>`). Two markers cannot share a text."))
    special: bool = Field(True, description=(
        "In id mode the marker must be one special or added id of the tokenizer; ordinary ids "
        "spelling it are text. `false`: a soft marker (`<think>`), one id if the tokenizer "
        "has one, else found in the decoded text."))
    lstrip: bool = Field(False, description=(
        "A whitespace-only run right before the marker belongs to it, like a tokenizer's "
        "`AddedToken(lstrip=True)` (the `\"\\n\"` R1-Distill writes between two tool "
        "outputs; on an opener, the newline a message ends with before Granite Code's blank "
        "line and next role word): it is neither content nor the start of an element."))
    description: Optional[str] = Field(None, description="For humans.")


class Header(_Model):
    """How an element's header (role name, tag and attributes, channel…) after its opener, or
    a close header after its close marker, is delimited and read. Not trained, except its part
    after `trained_after`."""

    until: Optional[str] = Field(None, description=(
        "The marker that ends the header (`<|im_middle|>`, `<|sep|>`). Exactly one of `until` "
        "/ `until_text`."))
    until_text: Optional[str] = Field(None, description=(
        "A literal inside the text run after the opener that ends the header (`\"\\n\"` in "
        "ChatML's role line). Not for close headers."))
    markers: list[str] = Field(default_factory=list, description=(
        "Markers allowed inside the header (Harmony's `<|channel|>`)."))
    pattern: Optional[str] = Field(None, description=(
        "A regex the header text must match whole. Named groups become attributes (`role`, "
        "`channel`, …)."))
    attributes: Optional[Literal["xtml"]] = Field(None, description=(
        "`xtml`: parse `tag key=\"value\" …` (`&amp;` and `&quot;` unescaped). The role is the "
        "`role` attribute and the close header must name the tag."))
    required: bool = Field(True, description=(
        "`false`: an element without its header terminator parses with no body and trains "
        "nothing, and later turns still parse."))
    max_tokens: int = Field(64, ge=1, le=4096, description=(
        "The most header tokens id mode decodes."))
    trained_after: Optional[str] = Field(None, description=(
        "A named group of `pattern`. The header text after the end of that group is model "
        "output (Harmony: the model writes `<|channel|>final<|message|>` after the prompt's "
        "`<|start|>assistant`): from there the turn trains as its body's kind, `until` marker "
        "included. A header cut by the end of input trains nothing; a group that takes no part "
        "in the match leaves the header untrained. Element headers only."))


class Close(_Model):
    """The terminator of an element: alternatives of markers, an optional header after the
    marker and optional markers that follow and still belong to the element's end. The `end`
    span of a turn."""

    markers: list[str] = Field(min_length=1, description="Close marker alternatives.")
    header: Optional[Header] = Field(None, description=(
        "A header after the close marker, ending at a marker (XTML `<|close|>tag<|sep|>`)."))
    after: list[str] = Field(default_factory=list, description=(
        "Markers that may follow and still belong to the end (`<|end_of_msg|>`)."))
    required: bool = Field(True, description=(
        "`false`: the close may be missing. A top-level element then ends where the next "
        "top-level element opens (Falcon-H1's tool system prompt has no `<|im_end|>`); it is "
        "reported like a truncated one (incomplete: its content trains under `truncated`, no "
        "end marker trains) with a warning. A child (it needs an opener) runs to what cannot "
        "continue its body: its parent's close, a sibling's opener or the next top-level "
        "opener; it is complete and nothing is reported, as the template writes it so "
        "(Qwen-style tool instructions in a system prompt print `<tool_call>` unclosed, an "
        "assistant turn that opens `<tool_call>` and ends). A marker that may continue its "
        "body (its own opener when it nests in itself, an inner marker) never closes it."))
    opens_follow: bool = Field(False, description=(
        "The close marker ends this element but is the first thing of its `follow` element, "
        "which starts at it and trains it with its body, as its kind (DeepSeek-V3.2's "
        "function results end at the `</think>` the model's reply starts with). This element "
        "then has no terminator span. Where no follow comes (the input ends), the marker stays "
        "this element's end. Needs a `follow` element without a header, and no close `header` "
        "or `after`."))
    follow_after: list[str] = Field(default_factory=list, description=(
        "The close markers after which the `follow` element comes: always there (an input "
        "that ends first is cut inside it; a follow of which nothing was written is no turn), "
        "and never after the other close markers. Without it the follow may come after any "
        "close marker, or not at all. Gemma 4: a model turn that stops with "
        "`<|tool_response>` goes on with the tool's response; one closed by `<turn|>` is "
        "followed only by between-turn text, which an optional follow starting with text "
        "could not be told from. Needs a `follow` element, and no close `header`; `after` "
        "markers follow only the other close markers (a fine-tune's `<turn|>\\n<eos>`)."))
    roles: list[str] = Field(default_factory=list, description=(
        "Top-level only. The roles (after `role_aliases`) whose turns end with this close; a "
        "turn of any other role has no terminator and ends where the next top-level element "
        "opens, complete and without a warning (Nemotron Nano v2: only the assistant's "
        "`<SPECIAL_11>Assistant` turn ends with `<SPECIAL_12>`, the user's "
        "`<SPECIAL_11>User` turn, same opener, runs to the next one). A listed role's turn "
        "without its close is what `required` says. At the end of input every turn without "
        "its close is cut. Empty (default): all roles."))
    untrained_when_empty: list[str] = Field(default_factory=list, description=(
        "Close markers that, ending an empty body, are the template's and not the model's: "
        "such a turn has no terminator span, so `end_marker` trains nothing of it. "
        "FunctionGemma and Gemma 4 write a tool message as a model turn that opens with "
        "`<start_function_response>` / `<|tool_response>`, and a second parallel response right "
        "after the first: an empty model turn (or reply) that only stops for the tool. A "
        "turn with text or blocks that stops with that marker (the model's own stop after its "
        "calls) still trains it under `end_marker`. Each must be one of `markers`."))


def _one_or_many(v: Any) -> Any:
    return [v] if isinstance(v, str) else v


#: A list of names that may also be written as one name (``open: im_user``); the JSON Schema
#: says both.
_OneOrMany = Annotated[list[str], BeforeValidator(_one_or_many), WithJsonSchema(
    {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]})]


class Element(_Model):
    """A turn (listed in `top`) or a block nested in a body (think, tool call, channel, XTML
    element)."""

    open: _OneOrMany = Field(default_factory=list, description=(
        "The opener marker(s): one name or a list of alternatives. Empty: the element starts "
        "with text (it then needs a close, or is a `follow` or preamble element; a child "
        "without an opener can only open its parent's body: DeepSeek-V4's reasoning up to a "
        "lone `</think>`); with a "
        "`header` ending at a marker, that text is its header (GigaChat 3's role before "
        "`<|role_sep|>`), and `between` text can then only end the input."))
    header: Optional[Header] = Field(None, description=(
        "What follows the opener up to a marker or a literal."))
    close: Optional[Close] = Field(None, description=(
        "The terminator. Absent: the element ends where its body cannot continue."))
    children: list[str] = Field(default_factory=list, description=(
        "Elements that may nest in the body, to any depth (no recursion limit)."))
    inner_markers: list[str] = Field(default_factory=list, description=(
        "Markers allowed in the body as content (Kimi-K2's `<|media_pad|>`). A close marker "
        "may be one too (Granite Code's blank line after every message, which messages also "
        "hold): the element's last one (only `after` markers after it) closes it, where what "
        "follows cannot continue the body (the next opener, the end of the input), and an "
        "earlier one is content; such a close has no `header`."))
    text: bool = Field(True, description=(
        "Whether the body may contain text. `false`: the body holds only children and inner "
        "markers (a media block of pad markers); text there is a parse error."))
    role: Optional[str] = Field(None, description="Fixed role of this element as a turn.")
    role_by_marker: dict[str, str] = Field(default_factory=dict, description=(
        "Opener marker → role (Kimi-K2: `im_user: user`)."))
    kind: Optional[str] = Field(None, description=(
        "Span kind of this block: `content`, `think`, `tool_call`, or your own (`media`; "
        "policies can exclude kinds)."))
    kind_by_tag: dict[str, str] = Field(default_factory=dict, description=(
        "Parsed XTML tag → kind (`think: think`, `tools: tool_call`)."))
    kind_by_attr: Optional[dict[str, dict[str, str]]] = Field(None, description=(
        "Attribute → (value → kind): the kind from a header attribute or named pattern group. "
        "The value `\"*\"` matches any other value."))
    tag: Optional[str] = Field(None, description=(
        "The XTML tag this element must have (`message`)."))
    follow: Optional[str] = Field(None, description=(
        "An element without opener that may directly follow this one's close and is read as "
        "the next turn (Mistral's reply after `[/INST]`)."))
    lead: _OneOrMany = Field(default_factory=list, description=(
        "A literal that still belongs to the header when the body starts with it (Llama 3's "
        "`\"\\n\\n\"` after `<|end_header_id|>`, part of the generation prompt, so never "
        "trained), or a list of alternatives tried in order, the first the body starts with "
        "taken (`[\"\\n\\n\", \"\\n\"]`: RLHFlow's Llama 3 fine-tunes write one newline). A "
        "body that starts with none keeps all its text. In id mode, when the lead ends inside "
        "a merged token, that token is the body's (trained) and the boundary is reported."))
    trim_end: bool = Field(False, description=(
        "A body that ends without a close marker (the element has none, or it is missing, or "
        "the input ends) does not keep the whitespace it ends with: the blank line a template "
        "writes after an answer that has no terminator (Falcon's `\\n`, Granite-code's "
        "`\\n\\n`) is not trained. In id mode, a token that holds both text and that "
        "whitespace stays in the body (trained) and the boundary is reported. The fast id "
        "path does not take such formats (`fmt.stats()` says why): every sample is parsed "
        "in full."))
    ends_with_parent: bool = Field(False, description=(
        "No terminator of its own: runs to the parent's close and can only be the last child, "
        "so the grammar stays unambiguous (Llama 3's `<|python_tag|>` call runs to "
        "`<|eom_id|>`). The parent needs a close marker, or is itself `ends_with_parent` (a "
        "chain ending at the first closed ancestor: Functionary's `>>>` segments)."))
    kind_when_cut: Optional[str] = Field(None, description=(
        "An `ends_with_parent` block's kind when its parent has no close (the input ends "
        "inside it, or the close is missing): Nemotron Nano v2 writes its last reply after a "
        "prefilled `<think>\\n`, so a reply the template closes without `</think>` is the "
        "answer (`kind: content`), while one cut by the end of input may still be reasoning "
        "(`kind_when_cut: think`, which `thinking: false` drops)."))
    description: Optional[str] = Field(None, description="For humans.")


def _policy_model() -> type[BaseModel]:
    """The spec's ``policy:`` model, built from :class:`~chatgrammar.runtime.policy.MaskPolicy`'s
    fields (their names, types, defaults and descriptions), so the two cannot drift; tuples
    are YAML lists."""
    hints = get_type_hints(MaskPolicy)
    fields: dict[str, Any] = {}
    for f in dataclasses.fields(MaskPolicy):
        tp, desc = hints[f.name], f.metadata["description"]
        if get_origin(tp) is tuple:
            item = get_args(tp)[0]
            fields[f.name] = (list[item], Field(default_factory=lambda d=f.default: list(d),
                                                description=desc))
        else:
            fields[f.name] = (tp, Field(f.default, description=desc))
    return create_model("Policy", __base__=_Model, __module__=__name__,
                        __doc__="The default mask policy: what trains when `policy=None` "
                                "(callers override any field with `cg.MaskPolicy(...)`).",
                        **fields)


Policy = _policy_model()


class Detector(_Model):
    """Evidence that a tokenizer / chat template belongs to this format, and its precedence
    over other formats."""

    require: list[str] = Field(default_factory=list, description=(
        "Strings that must all be one special or added id of the tokenizer."))
    require_any: list[str] = Field(default_factory=list, description=(
        "Strings of which at least one must be a special or added id."))
    absent: list[str] = Field(default_factory=list, description=(
        "Strings that must not be special or added ids (makes detectors exclusive)."))
    template: list[str] = Field(default_factory=list, description=(
        "Literals a chat template of the family contains (all)."))
    template_absent: list[str] = Field(default_factory=list, description=(
        "Literals such a template never contains."))
    precedence_over: list[str] = Field(default_factory=list, description=(
        "Formats this one wins against when both match. Acyclic; overlapping detectors must "
        "be ordered, directly or through a chain."))


class Example(_Model):
    """An embedded example, checked by `chatgrammar validate` in text mode and id mode."""

    name: Optional[str] = Field(None, description="What the example shows (named in problems).")
    text: str = Field(description=(
        "A rendered conversation with the expected trained text marked `⟦…⟧`; none marked: "
        "nothing trains."))
    policy: Optional[dict[str, Any]] = Field(None, description=(
        "Policy fields overriding the default for this example (`{thinking: false}`)."))
    error: Optional[str] = Field(None, description=(
        "The example must fail to parse, in both modes, with this text in the message."))


class FormatSpec(_Model):
    """A chat format as data: markers, elements (turns and nested blocks), the default mask
    policy, the detector and embedded examples."""

    name: str = Field(json_schema_extra={"pattern": f"^{NAME_PATTERN}$"}, description=(
        "Format id, kebab-case (`kimi-k3`), unique among all formats (bundled and plugins)."))
    description: Optional[str] = Field(None, description=(
        "What the format is, for humans."))
    covers: list[str] = Field(default_factory=list, description=(
        "Model families and models this format covers (listed by `chatgrammar formats`)."))
    extends: Optional[str] = Field(None, description=(
        "Derive from another format: a bundled or plugin format name, or a spec path relative "
        "to this file. Mappings merge key by key (`null` removes an inherited key), anything "
        "else is replaced; `name`, `description`, `covers`, `detect` and `examples` are not "
        "inherited (see [Deriving a format](#deriving-a-format-extends))."))
    # Bounded so that a hostile spec cannot make the LALR construction run for minutes (it is
    # super-linear in the grammar size: 800 elements take ~10 s); real formats use < 30.
    markers: dict[str, Marker] = Field(max_length=1024, description=(
        "Marker name → marker: the terminals of the grammar."))
    elements: dict[str, Element] = Field(max_length=256, description=(
        "Element name → element: the turns and the blocks nested in their bodies."))
    top: list[str] = Field(min_length=1, description=(
        "The elements that may appear at top level (the turns)."))
    preamble: list[str] = Field(default_factory=list, description=(
        "Markers / elements that may open the conversation once each, in order, before the "
        "first turn (a BOS marker, a tool-declaration block, DeepSeek's bare system text). "
        "An element without opener here has a non-empty body; with `between`, the text before "
        "the first turn is that element (no turn when `between` accepts it whole: leading "
        "whitespace), and between-turn text belongs to the turn before it."))
    between: Optional[str] = Field(None, description=(
        "A regex that text between top-level turns must match whole (`'\\s*'` for a newline "
        "after each turn). Without it, text between turns is an error."))
    between_markers: list[str] = Field(default_factory=list, description=(
        "Markers that may stand alone between turns (an EOS after each turn). An element "
        "opened by one of them, with no header and no close, then has a non-empty body (a "
        "lone marker is the between-turn marker: Mistral's `<s>` before a bare system "
        "prompt)."))
    trailing: Optional[str] = Field(None, description=(
        "A regex that text at the very end of the input may match whole where the grammar "
        "takes no more text, after complete turns (`'\\s*'`: Mistral-7B-v0.1 writes "
        "`eos_token + ' '` after every answer; a lone SentencePiece `▁` decodes to nothing). "
        "It is no turn and never trains. A turn cut by the end of input keeps its text: this "
        "only accepts what would otherwise be an error."))
    role_aliases: dict[str, str] = Field(default_factory=dict, description=(
        "Role name as written → canonical role (`model: assistant`). Glob keys "
        "(`\"functions.*\"`) map roles that match no exact key and are not canonical."))
    generation_prompt: list[str] = Field(default_factory=list, description=(
        "Exact strings a template appends for `add_generation_prompt`: a final turn equal to "
        "one of them, from its start, trains nothing."))
    policy: Policy = Field(default_factory=Policy, description=(
        "The default mask policy (what trains when `policy=None`)."))
    plain_text_tool_calls: Union[bool, str] = Field(False, description=(
        "Templates of this family write some tool calls as plain text in the reply, with no "
        "marker that sets them apart (Llama 3.1's JSON `{\"name\": …}`, pythonic "
        "`[f(x=1)]` lists): no grammar can tell such a call from the answer, so it is "
        "content. `true`, or a string saying how they are written. Then a mask with "
        "`tool_calls=False` issues a `DeviationWarning` (never an error, strict or not): "
        "calls the format types (`<|python_tag|>`, `<tool_call>`) are dropped, plain-text "
        "ones train as assistant text."))
    plain_text_reasoning: Union[bool, str] = Field(False, description=(
        "Templates of this family write the reasoning as plain text before the answer, with "
        "no marker that opens it (Apriel 1.6's `REASONING\n[BEGIN FINAL RESPONSE]\n…` where "
        "the format has no such marker): it is content. `true`, or a string saying how. Then "
        "a mask with `thinking=False` issues a `DeviationWarning`, as for "
        "`plain_text_tool_calls`."))
    role_folds: dict[str, str] = Field(default_factory=dict, description=(
        "Messages a template writes as something else: key a message role (`tool`, "
        "`system`) or `content` (an assistant message's content), value the role of the "
        "turn the template writes it in (`system`: Unsloth's ChatML renders every role but "
        "user and assistant, tool results included, as a system turn; `user`: a Mistral "
        "template folds the system prompt into the last user turn) or `think` (written as "
        "reasoning: the first gpt-oss template writes content beside a tool call as an "
        "`analysis` message). No grammar tells such text from the turn that holds it, so it "
        "trains as that turn's text. Set per template by detection and inference "
        "(`resolve_format`, `infer_format`), not in a family's spec. Then a mask whose "
        "policy trains one side and not the other (`roles` with `system` but not `tool`; "
        "`thinking=False`) issues a `DeviationWarning`, as for `plain_text_tool_calls`; the "
        "default policy never does."))
    detect: Detector = Field(default_factory=Detector, description=(
        "The detector: evidence that a tokenizer / chat template speaks this format, and "
        "precedence over other formats."))
    examples: list[Example] = Field(default_factory=list, description=(
        "Embedded examples checked by `chatgrammar validate`, with the expected trained text "
        "marked `⟦…⟧`."))

    @field_validator("name")
    @classmethod
    def _kebab(cls, v: str) -> str:
        if not re.fullmatch(NAME_PATTERN, v):
            raise ValueError(f"format names are kebab-case ([a-z0-9-]), got {v!r}")
        return v


# --------------------------------------------------------------------------- YAML + positions

class _Loader(yaml.SafeLoader):
    """SafeLoader: only plain YAML types; any ``!!python`` tag fails to construct."""


def node_marks(node: yaml.Node, path: tuple = (), out: dict | None = None) -> dict:
    """Map every YAML path (tuple of keys/indices) to its node's start position, a 0-based
    ``(line, column)`` tuple (iteratively). Not yaml ``Mark`` objects: specs are cached
    pickled, and plain tuples unpickle fastest and carry no copy of the document."""
    out = {} if out is None else out
    stack = [(node, path)]
    while stack:
        n, p = stack.pop()
        out[p] = (n.start_mark.line, n.start_mark.column)
        if isinstance(n, yaml.MappingNode):
            for k, v in n.value:
                key = k.value if isinstance(k, yaml.ScalarNode) else str(k)
                out[p + (key, "__key__")] = (k.start_mark.line, k.start_mark.column)
                stack.append((v, p + (key,)))
        elif isinstance(n, yaml.SequenceNode):
            for i, v in enumerate(n.value):
                stack.append((v, p + (i,)))
    return out


def format_path(loc: tuple) -> str:
    parts: list[str] = []
    for x in loc:
        if isinstance(x, int):
            parts.append(f"[{x}]")
        else:
            parts.append(("." if parts else "") + str(x))
    return "".join(parts)


class SpecSource:
    """Where a spec came from, so later stages can locate their errors too.

    ``origins`` maps the YAML paths a spec inherited through ``extends:`` to the file they were
    written in (a path not in it belongs to ``file``)."""

    def __init__(self, file: str, marks: dict | Callable[[], dict],
                 origins: dict | None = None):
        self.file = file
        # (a callable: the compile cache decodes the positions only when an error needs them)
        self._marks = marks
        self.origins = origins or {}

    @property
    def marks(self) -> dict:
        """YAML path (tuple of keys / indices) → 0-based ``(line, column)`` of its node."""
        m = self._marks
        if callable(m):
            m = self._marks = m()
        return m

    def where(self, loc: tuple, key: bool = False) -> tuple[str, int | None, int | None]:
        """(file, line, col) of the nearest located node at or above ``loc``."""
        loc = tuple(loc)
        probe = loc + ("__key__",) if key else loc
        while probe:
            m = self.marks.get(probe)
            if m is not None:
                return self.origins.get(probe, self.file), m[0] + 1, m[1] + 1
            probe = probe[:-1]
        m = self.marks.get(())
        return (self.file, m[0] + 1, m[1] + 1) if m else (self.file, None, None)

    def locate(self, loc: tuple, key: bool = False) -> tuple[int | None, int | None]:
        return self.where(loc, key)[1:]

    def error(self, message: str, loc: tuple = (), cls=SpecError, key: bool = False) -> SpecError:
        file, line, col = self.where(loc, key=key)
        return cls(message, file=file, line=line, col=col, path=format_path(loc) or None)


# --------------------------------------------------------------------------- extends

# What a derived spec never inherits: its identity, how it is detected (a base's detector would
# claim the base's tokenizers twice) and the base's examples (they test the base's behaviour).
NOT_INHERITED = ("name", "description", "covers", "detect", "examples", "extends")
MAX_EXTENDS_DEPTH = 8


def _base_path(ref: str, file: str) -> Path | None:
    """A base named by ``extends:``: a spec path (relative to the deriving file) or the name of
    a bundled / plugin format. None when unknown."""
    if ref.endswith((".yaml", ".yml")) or "/" in ref:
        here = Path(file).parent if file and not file.startswith("<") else Path.cwd()
        p = (here / ref)
        return p if p.is_file() else None
    from .registry import bundled_paths, plugin_paths  # (registry imports this module)

    known = bundled_paths()
    if ref not in known:
        known = {**plugin_paths(), **known}
    return known.get(ref)


def _merge(base: Any, child: Any, bmarks: dict, cmarks: dict, bfile: str, path: tuple,
           marks: dict, origins: dict, borigins: dict) -> Any:
    """Deep-merge ``child`` over ``base``: mappings merge key by key (a ``null`` child value
    removes the key), anything else is replaced. Records each kept node's mark and file."""
    if isinstance(base, dict) and isinstance(child, dict):
        out = {}
        for k, v in base.items():
            if k in child:
                continue
            out[k] = v
            _copy_marks(bmarks, borigins, bfile, path + (k,), marks, origins)  # (+ its key)
        for k, v in child.items():
            if v is None and k in base:
                continue  # `key: null` deletes an inherited entry
            if k in base:
                out[k] = _merge(base[k], v, bmarks, cmarks, bfile, path + (k,), marks, origins,
                                borigins)
            else:
                out[k] = v
                _copy_marks(cmarks, {}, None, path + (k,), marks, origins)
            kp = path + (k, "__key__")
            if kp in cmarks:
                marks[kp] = cmarks[kp]
        if path in cmarks:
            marks[path] = cmarks[path]
        return out
    _copy_marks(cmarks, {}, None, path, marks, origins)
    return child


def _copy_marks(src: dict, src_origins: dict, file: str | None, prefix: tuple, marks: dict,
                origins: dict) -> None:
    n = len(prefix)
    for p, m in src.items():
        if p[:n] == prefix:
            marks[p] = m
            if file is not None:
                origins[p] = src_origins.get(p, file)


def _resolve_extends(data: dict, marks: dict, file: str, seen: tuple = ()
                     ) -> tuple[dict, dict, dict]:
    """``data`` with its ``extends:`` chain merged in: (data, marks, origins)."""
    ref = data.get("extends")
    if ref is None:
        return data, marks, {}
    src = SpecSource(file, marks)
    if not isinstance(ref, str) or not ref.strip():
        raise src.error("extends must name a format or a spec file", ("extends",))
    if len(seen) >= MAX_EXTENDS_DEPTH:
        raise src.error(f"extends chain longer than {MAX_EXTENDS_DEPTH}", ("extends",))
    base_path = _base_path(ref, file)
    if base_path is None:
        from .registry import list_formats

        close = difflib.get_close_matches(ref, list_formats(), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise src.error(f"extends {ref!r}: no such format or spec file{hint}", ("extends",))
    key = str(base_path.resolve())
    if key in seen:
        chain = " -> ".join([*seen, key])
        raise src.error(f"extends cycle: {chain}", ("extends",))
    try:
        btext = base_path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise src.error(f"extends {ref!r}: cannot read {base_path}: {exc}", ("extends",)) from None
    bfile = str(base_path)
    bdata, bmarks = load_yaml(btext, bfile)
    if not isinstance(bdata, dict):
        raise SpecError("a format spec must be a YAML mapping", file=bfile, line=1, col=1)
    bdata, bmarks, borigins = _resolve_extends(bdata, bmarks, bfile, (*seen, key))
    bdata = {k: v for k, v in bdata.items() if k not in NOT_INHERITED}
    out_marks: dict = {}
    origins: dict = {}
    merged = _merge(bdata, data, bmarks, marks, bfile, (), out_marks, origins, borigins)
    return merged, out_marks, origins


# A spec is a few hundred YAML nodes; aliases can multiply that exponentially (a "billion
# laughs" file) or make it cyclic, and everything after composition walks the expanded tree.
MAX_YAML_NODES = 100_000
# No spec nests deeper than ~8 levels. The limit is checked on the composed node graph, not
# left to a RecursionError: libyaml's composer (PyYAML's C binding) is not recursive in
# Python, so whether a deep document raised depended on the PyYAML build (6.0.3 composes
# 20,000 levels and hands them to the schema).
MAX_YAML_DEPTH = 200


def duplicate_keys(root: yaml.Node | None) -> list[tuple[tuple, str, yaml.Mark, yaml.Mark]]:
    """Every duplicate mapping key of a composed YAML document (the safe loader silently keeps
    the last one), for the checkers of specs and of norms.yaml.

    Returns:
        ``(yaml path of the key, key, mark of its first definition, mark of this one)`` each.
    """
    out = []
    stack: list[tuple[Any, tuple]] = [(root, ())] if root is not None else []
    while stack:
        node, path = stack.pop()
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, Any] = {}
            for k, v in node.value:
                key = k.value if isinstance(k, yaml.ScalarNode) else str(k)
                if key in seen:
                    out.append((path + (key,), key, seen[key], k.start_mark))
                else:
                    seen[key] = k.start_mark
                stack.append((v, path + (key,)))
        elif isinstance(node, yaml.SequenceNode):
            stack.extend((v, path + (i,)) for i, v in enumerate(node.value))
    return out


def check_node_graph(root: yaml.Node, file: str) -> None:
    """Reject recursive aliases, alias expansions beyond MAX_YAML_NODES and nesting beyond
    MAX_YAML_DEPTH (iteratively, counting each shared node once per reference, with memoised
    subtree sizes and depths)."""
    size: dict[int, int] = {}
    depth: dict[int, int] = {}
    open_: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        n, done = stack.pop()
        kids = ([c for kv in n.value for c in kv] if isinstance(n, yaml.MappingNode) else
                list(n.value) if isinstance(n, yaml.SequenceNode) else [])
        if done:
            open_.discard(id(n))
            size[id(n)] = min(MAX_YAML_NODES + 1, 1 + sum(size[id(k)] for k in kids))
            depth[id(n)] = 1 + max((depth[id(k)] for k in kids), default=0)
            if depth[id(n)] > MAX_YAML_DEPTH:
                m = n.start_mark
                raise SpecError(f"YAML nested too deeply (more than {MAX_YAML_DEPTH} levels)",
                                file=file, line=m.line + 1, col=m.column + 1)
            continue
        if id(n) in size:
            continue
        if id(n) in open_:
            m = n.start_mark
            raise SpecError("recursive YAML alias (a node contains itself)", file=file,
                            line=m.line + 1, col=m.column + 1)
        open_.add(id(n))
        stack.append((n, True))
        for k in kids:
            if id(k) in open_:
                m = k.start_mark
                raise SpecError("recursive YAML alias (a node contains itself)", file=file,
                                line=m.line + 1, col=m.column + 1)
            if id(k) not in size:
                stack.append((k, False))
    if size[id(root)] > MAX_YAML_NODES:
        raise SpecError(f"YAML aliases expand to more than {MAX_YAML_NODES} nodes", file=file,
                        line=1, col=1)


# libyaml's parser (PyYAML's C binding), when built: the same documents compose to the same
# nodes and marks, ~10x faster than the pure-Python scanner (most of a cold load). It is used
# only on text the pure-Python reader accepts, and any YAML error is reported by the
# pure-Python loader, so error messages and what is accepted never depend on the build.
_CLoader = None
if getattr(yaml, "__with_libyaml__", False):
    class _CLoader(yaml.CSafeLoader):  # type: ignore[no-redef]
        """CSafeLoader: libyaml's parser, the safe constructor (plain YAML types only)."""


def _compose_construct(text: str, loader_cls) -> tuple[yaml.Node | None, Any, Callable]:
    """Compose ``text`` once; the node and a constructor of its data (one parse, not two)."""
    loader = loader_cls(text)
    try:
        node = loader.get_single_node()
    except BaseException:
        loader.dispose()
        raise

    def construct() -> Any:
        try:
            return loader.construct_document(node)
        finally:
            loader.dispose()
    return node, construct


def load_yaml(text: str, file: str) -> tuple[Any, dict]:
    """Parse YAML safely; returns (data, marks). Raises SpecError with a position (also for
    recursive aliases and alias bombs)."""
    fast = _CLoader is not None and yaml.reader.Reader.NON_PRINTABLE.search(text) is None
    try:
        try:
            node, construct = _compose_construct(text, _CLoader if fast else _Loader)
        except yaml.YAMLError:
            if not fast:
                raise
            node, construct = _compose_construct(text, _Loader)  # its error, as without C
        if node is None:
            raise SpecError("empty spec", file=file, line=1, col=1)
        check_node_graph(node, file)
        data = construct()
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        msg = " ".join(x for x in (exc.context, exc.problem) if x) or str(exc)
        raise SpecError(f"YAML error: {msg}", file=file,
                        line=mark.line + 1 if mark else None,
                        col=mark.column + 1 if mark else None) from None
    except yaml.YAMLError as exc:
        raise SpecError(f"YAML error: {exc}", file=file) from None
    except RecursionError:  # PyYAML composes and constructs recursively
        raise SpecError("YAML nested too deeply", file=file, line=1, col=1) from None
    return data, node_marks(node)


def _schema_error(err: dict, src: SpecSource) -> SpecError:
    """One pydantic error → a located SpecError, in spec terms."""
    loc = tuple(err["loc"])
    kind = err["type"]
    if kind == "extra_forbidden":
        return src.error(f"unknown key {loc[-1]!r}", loc, key=True)
    if kind == "missing":
        return src.error(f"missing required key {loc[-1]!r}", loc[:-1])
    msg = err["msg"]
    if kind == "value_error":  # our own validators: the message already names the value
        return src.error(msg.removeprefix("Value error, "), loc)
    if "input" in err and not isinstance(err["input"], (dict, list)):
        got = repr(err["input"])
        msg += f" (got {got if len(got) <= 60 else got[:57] + '...'})"
    return src.error(msg, loc)


def spec_errors(text: str, file: str = "<string>"
                ) -> tuple[FormatSpec | None, SpecSource | None, list[SpecError]]:
    """Parse and schema-check a spec, collecting EVERY schema problem instead of raising.

    Used by ``chatgrammar validate``, which reports all problems of a file at once.

    Args:
        text: the YAML source.
        file: the name errors are reported against.

    Returns:
        ``(spec, source, errors)``: ``spec`` is None when ``errors`` is non-empty; ``source``
        is None only when the YAML itself does not parse (then ``errors`` holds that one error).

    Example:
        >>> spec, src, errs = spec_errors("name: x\nmarkers: {}\nelements: {}\ntop: [t]\nfoo: 1")
        >>> [e.message for e in errs]
        ["unknown key 'foo'"]
    """
    try:
        data, marks = load_yaml(text, file)
    except SpecError as exc:
        return None, None, [exc]
    src = SpecSource(file, marks)
    if not isinstance(data, dict):
        return None, src, [src.error("a format spec must be a YAML mapping")]
    if data.get("extends") is not None:
        try:
            own = (str(Path(file).resolve()),) if Path(file).is_file() else ()
            data, marks, origins = _resolve_extends(data, marks, file, own)
        except SpecError as exc:
            return None, src, [exc]
        src = SpecSource(file, marks, origins)
    try:
        spec = FormatSpec.model_validate(data)
    except ValidationError as exc:
        return None, src, [_schema_error(e, src) for e in exc.errors()]
    return spec, src, []


def parse_spec(text: str, file: str = "<string>") -> tuple[FormatSpec, SpecSource]:
    """Parse and schema-check a spec. Semantic checks happen in :mod:`chatgrammar.core.compile`.

    Raises:
        SpecError: YAML syntax or schema violations, located ``file:line:col`` + YAML path
            (the first one; :func:`spec_errors` collects them all).
    """
    spec, src, errors = spec_errors(text, file)
    if errors:
        first = errors[0]
        more = len(errors) - 1
        if more:
            first = SpecError(f"{first.message} (+{more} more problem{'s' if more > 1 else ''})",
                              file=first.file, line=first.line, col=first.col, path=first.path)
        raise first
    return spec, src


def read_spec(path: str | Path) -> tuple[FormatSpec, SpecSource]:
    """Read a spec file. Raises SpecError for unreadable files too."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SpecError("no such file", file=str(p)) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecError(f"cannot read: {exc}", file=str(p)) from None
    return parse_spec(text, str(p))
