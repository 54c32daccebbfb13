"""``chatgrammar schema`` — the JSON Schema of the spec language, for editors.

Generated from the pydantic models of :mod:`chatgrammar.spec` (so it never drifts from what
the loader accepts), with a description on every key so that editors (VS Code / any
yaml-language-server client) complete and explain YAML specs. The repository keeps a copy in
``docs/format-spec.schema.json``; point an editor at it with a first line
``# yaml-language-server: $schema=<path or URL>/format-spec.schema.json``.

Exit codes: 0 written; 2 the output file cannot be written.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

SCHEMA_ID = "https://chatgrammar.invalid/format-spec.schema.json"

#: One line per key of the spec language: (model, key) → description. Keys missing here get
#: no description (``tests/test_cli.py`` checks this table covers every key).
FIELD_DOCS: dict[tuple[str, str], str] = {
    # FormatSpec
    ("FormatSpec", "name"): "Format id, kebab-case (kimi-k3). Must be unique among all formats.",
    ("FormatSpec", "description"): "One paragraph: what the format is, for humans.",
    ("FormatSpec", "covers"): "Model families / models this format covers (listed by "
                              "`chatgrammar formats`).",
    ("FormatSpec", "extends"): "Derive from another format: a bundled / plugin format name or "
                               "a spec path relative to this file. Mappings merge key by key "
                               "(`null` removes an inherited key), anything else is replaced; "
                               "name, description, covers, detect and examples are not "
                               "inherited.",
    ("FormatSpec", "markers"): "Marker name → literal string. Markers are the grammar's "
                               "terminals; everything else is text.",
    ("FormatSpec", "elements"): "Element name → element: turns (listed in `top`) and the blocks "
                                "nested inside their bodies.",
    ("FormatSpec", "top"): "Elements that can appear at the top level (the turns).",
    ("FormatSpec", "preamble"): "Markers / elements that may open the conversation once, "
                                "before the first turn (BOS, a tool declaration block).",
    ("FormatSpec", "between"): "Regex that text between top-level turns must fully match "
                               "(e.g. '\\s*' for a newline after each turn). Absent: no text "
                               "between turns.",
    ("FormatSpec", "between_markers"): "Markers that may stand alone between turns (e.g. an "
                                       "EOS after each turn).",
    ("FormatSpec", "role_aliases"): "Role name as written → canonical role (model: assistant).",
    ("FormatSpec", "generation_prompt"): "Exact strings a template appends for "
                                         "add_generation_prompt; a final turn equal to one of "
                                         "them trains nothing.",
    ("FormatSpec", "policy"): "The default mask policy (what trains when policy=None).",
    ("FormatSpec", "detect"): "The detector: evidence that a tokenizer / chat template speaks "
                              "this format, and precedence over other formats.",
    ("FormatSpec", "examples"): "Embedded examples checked by `chatgrammar validate`, with the "
                                "expected trained text marked \u27e6\u2026\u27e7.",
    # Marker
    ("Marker", "text"): "The literal string (<|im_end|>).",
    ("Marker", "special"): "true: in id mode it must be ONE special/added id (ordinary ids "
                           "spelling it are text). false: a soft marker (<think>), one id if "
                           "the tokenizer has one, else found in the decoded text.",
    ("Marker", "lstrip"): "A run of whitespace alone right before the marker belongs to it "
                          "(like AddedToken(lstrip=True)).",
    ("Marker", "description"): "For humans.",
    # Element
    ("Element", "open"): "Opener marker(s) (one name or a list of alternatives). Empty: the "
                         "element starts with text and needs a close marker.",
    ("Element", "header"): "The header after the opener (role name, tag and attributes), up to "
                           "a marker (`until`) or a literal (`until_text`). Not trained, "
                           "except the part after `trained_after`.",
    ("Element", "close"): "The terminator: close marker(s), optional close header, trailing "
                          "markers (`after`). The `end` span of a turn.",
    ("Element", "children"): "Elements that may nest in the body (any depth; no recursion "
                             "limit).",
    ("Element", "inner_markers"): "Markers allowed inside the body as content (e.g. a media "
                                  "placeholder).",
    ("Element", "text"): "Whether the body may contain text.",
    ("Element", "role"): "Fixed role of this element when it is a turn.",
    ("Element", "role_by_marker"): "Opener marker → role (K2: im_user → user).",
    ("Element", "kind"): "Span kind of this block: content, think, tool_call, or your own "
                         "(policies can exclude kinds).",
    ("Element", "kind_by_tag"): "Parsed XTML tag → kind (think → think, tools → tool_call).",
    ("Element", "kind_by_attr"): "Attribute → (value → kind), for headers that carry the kind in "
                                 "an attribute or a named regex group.",
    ("Element", "tag"): "The XTML tag this element must have (message).",
    ("Element", "follow"): "An element without opener that may directly follow this one's "
                           "close (a continuation read as the next turn).",
    ("Element", "lead"): "A literal that still belongs to the header when the body starts with "
                         "it (Llama 3's \"\\n\\n\" after <|end_header_id|>).",
    ("Element", "ends_with_parent"): "No terminator of its own: runs to the parent's close "
                                     "marker (must be the last child).",
    ("Element", "description"): "For humans.",
    # Header
    ("Header", "until"): "The marker that ends the header (<|im_middle|>, <|sep|>).",
    ("Header", "until_text"): "A literal inside the text after the opener that ends the "
                              "header (\"\\n\" in ChatML's role line).",
    ("Header", "markers"): "Markers allowed inside the header.",
    ("Header", "pattern"): "Regex the header text must fully match; named groups become "
                           "attributes (e.g. (?P<role>\\w+)).",
    ("Header", "attributes"): "`xtml`: parse `tag key=\"value\" …` (&amp; &quot; unescaped); "
                              "the role comes from the `role` attribute.",
    ("Header", "required"): "false: an element without its header terminator parses but has "
                            "no body (trains nothing), and later turns still parse.",
    ("Header", "max_tokens"): "How many tokens of header id mode decodes at most.",
    ("Header", "trained_after"): "A named group of `pattern`: the header text after it is model "
                                 "output and trains with the body, as its kind (Harmony: "
                                 "everything after `<|start|>assistant`).",
    # Close
    ("Close", "markers"): "Close marker alternatives (at least one).",
    ("Close", "header"): "A header after the close marker (XTML <|close|>tag<|sep|>); must end "
                         "at a marker.",
    ("Close", "after"): "Markers that may follow and still belong to the element's end "
                        "(<|end_of_msg|>).",
    ("Close", "required"): "false (top-level only): a missing close ends the element where the "
                           "next one opens (reported incomplete).",
    ("Close", "opens_follow"): "true: the close marker is the first thing of the `follow` "
                               "element, which starts at it and trains it (DeepSeek-V3.2's "
                               "reply starts with the `</think>` ending the function results).",
    ("Close", "follow_after"): "Close markers after which the `follow` element always comes "
                               "(and after no other): Gemma 4's model turn stopped by "
                               "`<|tool_response>` goes on with the tool's response.",
    ("Close", "roles"): "Top-level only: the roles whose turns end with this close; a turn of "
                        "another role ends where the next one opens, complete (Nemotron Nano "
                        "v2's user turns).",
    # Policy
    ("Policy", "roles"): "Roles whose turns train (after role_aliases).",
    ("Policy", "thinking"): "Train reasoning blocks (kind think).",
    ("Policy", "tool_calls"): "Train tool-call blocks (kind tool_call).",
    ("Policy", "end_marker"): "Also train the turn terminator (kind end).",
    ("Policy", "last_turn_only"): "Train only the last trainable turn.",
    ("Policy", "truncated"): "Train the content of a turn cut off by the end of input.",
    # Detector
    ("Detector", "require"): "Strings the tokenizer must map to ONE special/added id (all).",
    ("Detector", "require_any"): "Strings of which at least one must be a special/added id.",
    ("Detector", "absent"): "Strings that must NOT be special/added ids.",
    ("Detector", "template"): "Literals a chat template of the family contains (all).",
    ("Detector", "template_absent"): "Literals such a template never contains.",
    ("Detector", "precedence_over"): "Formats this one wins against when both match; must be "
                                     "acyclic, and overlapping detectors must be ordered.",
    # Example
    ("Example", "name"): "What the example shows.",
    ("Example", "text"): "A rendered conversation with the expected trained text marked "
                         "\u27e6\u2026\u27e7 (run in text mode and id mode).",
    ("Example", "policy"): "Policy fields overriding the default for this example "
                           "({thinking: false}).",
    ("Example", "error"): "The example must fail to parse, with this text in the message.",
}


#: Keys whose validator also accepts one string for a one-item list.
ONE_OR_MANY: dict[str, tuple[str, ...]] = {"Element": ("open",)}


def build_schema() -> dict:
    """The JSON Schema (draft 2020-12) of a format spec, with descriptions.

    Returns:
        The schema as a dict.

    Example:
        >>> build_schema()["title"]
        'chatgrammar format spec'
    """
    from ..spec import FormatSpec

    schema = FormatSpec.model_json_schema()
    defs = schema.get("$defs", {})

    def annotate(model: str, node: dict) -> None:
        for key in ONE_OR_MANY.get(model, ()):
            prop = node.get("properties", {}).get(key)
            if prop is not None and prop.get("type") == "array":
                # the loader also takes a single name (``open: im_user``)
                items = prop.pop("items")
                prop.pop("type")
                prop["anyOf"] = [items, {"type": "array", "items": items}]
        for key, prop in node.get("properties", {}).items():
            doc = FIELD_DOCS.get((model, key))
            if doc:
                prop["description"] = doc
            prop.pop("title", None)

    annotate("FormatSpec", schema)
    # the kebab-case rule of FormatSpec.name is a pydantic validator; say it in the schema too
    schema["properties"]["name"]["pattern"] = r"^[a-z0-9]+(?:[-.][a-z0-9]+)*$"
    for name, node in defs.items():
        annotate(name, node)
    out = {"$schema": "https://json-schema.org/draft/2020-12/schema", "$id": SCHEMA_ID,
           "title": "chatgrammar format spec",
           "description": "A chat format as data: markers, elements (turns and nested blocks), "
                          "the default mask policy, the detector and embedded examples. See "
                          "docs/writing-a-format.md.",
           **{k: v for k, v in schema.items() if k not in ("title", "description")}}
    return out


def schema_text() -> str:
    """The schema as the JSON text written to ``docs/format-spec.schema.json``."""
    return json.dumps(build_schema(), ensure_ascii=False, indent=2, sort_keys=False) + "\n"


def register(subparsers: Any) -> None:
    """Add the ``schema`` subcommand to the ``chatgrammar`` parser.

    Args:
        subparsers: the object returned by ``ArgumentParser.add_subparsers()``.
    """
    p = subparsers.add_parser(
        "schema", help="print the JSON Schema of the spec language (for editors)",
        description="Print the JSON Schema of format specs, generated from the spec models, so "
                    "that editors validate and complete YAML specs. Add "
                    "'# yaml-language-server: $schema=<path>/format-spec.schema.json' as the "
                    "first line of a spec.")
    p.add_argument("-o", "--output-file", metavar="FILE",
                   help="write the schema to FILE instead of stdout "
                        "(the repository's copy: docs/format-spec.schema.json)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run ``chatgrammar schema``; returns the exit code."""
    text = schema_text()
    if not args.output_file:
        sys.stdout.write(text)
        return 0
    try:
        Path(args.output_file).write_text(text, encoding="utf-8")
    except OSError as exc:
        print(f"chatgrammar schema: error: cannot write {args.output_file}: "
              f"{exc.strerror or exc}", file=sys.stderr)
        return 2
    print(f"wrote {args.output_file}", file=sys.stderr)
    return 0
