"""``chatgrammar show -f NAME [FILE|-]`` — what a format trains in one conversation.

The input is a rendered conversation (text), or with ``--ids`` a JSON list of token ids (needs
``--tokenizer DIR``), or with ``--template FILE`` a JSON list of messages rendered with that chat
template first. Each turn is printed under a label (index, role, state, the kinds it trains);
trained spans are coloured by kind in a terminal and marked ``⟦…⟧`` otherwise (the notation of
embedded examples, so the output can be pasted into a spec). ``--html OUT.html`` writes the same
as a standalone page. Policy flags (``--no-thinking``, ``--end-marker``, ``--roles``…) change what
trains; ``--lenient`` skips malformed parts instead of failing.

Exit codes: 0 shown; 1 the input does not parse (strict) or the format is invalid; 2 usage error.
"""
from __future__ import annotations

import argparse
import html
import json
import sys
from pathlib import Path
from typing import Any

from .._io import read_text

from ..runtime.spans import merge_spans
from ._common import (UsageError, add_command, add_policy_args, add_tokenizer_args,
                      load_format_arg, policy_for, read_template, tokenizer_arg)

OPEN_MARK, CLOSE_MARK = "\u27e6", "\u27e7"
KIND_STYLES = {"content": "bold green", "think": "bold magenta", "tool_call": "bold yellow",
               "end": "bold cyan"}
KIND_CSS = {"content": "#c8f7c5", "think": "#ecd4f7", "tool_call": "#fff1b8", "end": "#c9eef5"}
OTHER_STYLE, OTHER_CSS = "bold blue", "#d6e4ff"


def register(subparsers: Any) -> None:
    """Add ``chatgrammar show`` (see the module docstring)."""
    p = add_command(subparsers, run, __doc__, output="text: labelled turns; json: turns and spans")
    p.add_argument("input", nargs="?", default="-", metavar="FILE|-",
                   help="the rendered text (default: stdin); with --ids a JSON list of ids; "
                        "with --template a JSON list of messages (or {messages, tools})")
    p.add_argument("-f", "--format", metavar="NAME|PATH",
                   help="the format (default: detected from --tokenizer / --template)")
    p.add_argument("--ids", action="store_true", help="the input is token ids (needs --tokenizer)")
    add_tokenizer_args(p)
    p.add_argument("--template", metavar="FILE",
                   help="render the input messages with this chat template first")
    p.add_argument("--add-generation-prompt", action="store_true",
                   help="with --template: append the generation prompt")
    p.add_argument("--html", metavar="OUT.html", help="also write a standalone HTML page")
    p.add_argument("--color", choices=("auto", "always", "never"), default="auto",
                   help="colour trained spans (auto: when stdout is a terminal); without "
                        "colour they are marked \u27e6\u2026\u27e7")
    add_policy_args(p)
    p.add_argument("--lenient", action="store_true",
                   help="skip malformed parts (reported as warnings) instead of failing")


def _read_input(path: str) -> str:
    if path == "-":
        return sys.stdin.read()
    return read_text(path, UsageError)



def run(args: argparse.Namespace) -> int:
    """Run ``chatgrammar show``; returns the exit code (a UsageError is the caller's: 2)."""
    from ..conformance.templates import encode_text
    from ..core.detect import detect_format

    if args.ids and not args.tokenizer:
        raise UsageError("--ids needs --tokenizer DIR")
    raw = _read_input(args.input)
    tokenizer = tokenizer_arg(args.tokenizer, args.trust_remote_code)
    template = read_template(args.template)
    if args.format:
        fmt = load_format_arg(args.format)
    elif tokenizer is not None or template is not None:
        fmt = detect_format(tokenizer, chat_template=template)
    else:
        raise UsageError("which format? pass -f NAME (or --tokenizer / --template to detect it)")

    text = None
    ids = None
    if template is not None and not args.ids:
        try:
            data = json.loads(raw)
        except ValueError as exc:
            raise UsageError(f"--template needs a JSON list of messages as input: {exc}") from None
        messages, tools = (data.get("messages"), data.get("tools")) if isinstance(data, dict) \
            else (data, None)
        if not isinstance(messages, list):
            raise UsageError("--template needs a JSON list of messages (or {\"messages\": [...]})")
        from ..conformance.render import render_chat, special_token_vars
        text = render_chat(template, messages, tools=tools,
                           add_generation_prompt=args.add_generation_prompt,
                           **special_token_vars(tokenizer))
        if tokenizer is not None:
            ids = encode_text(tokenizer, text)
    elif args.ids:
        try:
            data = json.loads(raw)
        except ValueError:
            data = raw.replace(",", " ").split()
        if isinstance(data, dict):
            data = data.get("input_ids", data.get("ids"))
        try:
            ids = [int(x) for x in data]
        except (TypeError, ValueError):
            raise UsageError("--ids needs a JSON list of integers") from None
    else:
        text = raw

    policy = policy_for(fmt, args)
    strict = not args.lenient
    if ids is not None:
        conv = fmt.parse_ids(ids, tokenizer, strict=strict)
        from ..runtime.tokenizers import adapt
        shown, starts = adapt(tokenizer).decode_offsets(ids)
        bounds = list(starts) + [len(shown)]
        to_char = lambda k: bounds[k]  # noqa: E731 - token index → display char
        unit = "token"
    else:
        conv = fmt.parse(text, strict=strict)
        shown = text
        to_char = lambda k: k  # noqa: E731
        unit = "char"
    spans = conv.spans(policy)
    view = _View(fmt, conv, spans, shown, to_char, unit, policy)
    if args.html:
        try:
            Path(args.html).write_text(view.html(), encoding="utf-8")
        except OSError as exc:
            raise UsageError(f"cannot write {args.html}: {exc.strerror or exc}") from None
    if args.output == "json":
        print(json.dumps(view.json(ids), ensure_ascii=False, indent=2))
    else:
        color = args.color == "always" or (args.color == "auto" and sys.stdout.isatty())
        view.terminal(color)
        if args.html:
            print(f"wrote {args.html}", file=sys.stderr)
    return 0


class _View:
    """One parsed conversation laid out for display (terminal, JSON, HTML)."""

    def __init__(self, fmt, conv, spans, shown: str, to_char, unit: str, policy):
        self.fmt, self.conv, self.spans, self.shown = fmt, conv, spans, shown
        self.to_char, self.unit, self.policy = to_char, unit, policy
        # display segments: (start char, end char, label or None) — turns and the gaps
        self.rows: list[tuple[int, int, Any]] = []
        pos = 0
        for i, t in enumerate(conv.turns):
            s, e = to_char(t.start), to_char(t.end)
            if s > pos:
                self.rows.append((pos, s, None))
            self.rows.append((s, e, i))
            pos = max(pos, e)
        if pos < len(shown):
            self.rows.append((pos, len(shown), None))

    def _label(self, i: int) -> str:
        t = self.conv.turns[i]
        state = []
        if t.generation_prompt:
            state.append("generation prompt")
        if not t.complete:
            state.append("truncated")
        if not t.valid:
            state.append("malformed (skipped)")
        kinds = list(dict.fromkeys(s.kind for s in self.spans if s.turn == i))
        trains = f"trains {', '.join(kinds)}" if kinds else "trains nothing"
        extra = f" · {', '.join(state)}" if state else ""
        return f"turn {i} · {t.role}{extra} · {trains} · {self.unit}s [{t.start}, {t.end})"

    def _char_spans(self) -> list[tuple[int, int, str]]:
        return [(self.to_char(s.start), self.to_char(s.end), s.kind) for s in self.spans]

    def terminal(self, color: bool) -> None:
        from rich.console import Console
        from rich.text import Text

        console = Console(highlight=False, soft_wrap=True, force_terminal=color or None,
                          no_color=not color, emoji=False)
        cspans = self._char_spans()
        pol = self.policy
        console.print(Text(f"{self.fmt.name} · {self.conv.mode} mode · policy: roles="
                           f"{','.join(pol.roles)} thinking={pol.thinking} "
                           f"tool_calls={pol.tool_calls} end_marker={pol.end_marker} "
                           f"last_turn_only={pol.last_turn_only} truncated={pol.truncated}",
                           style="dim" if color else ""))
        if color:
            legend = Text("trained: ")
            for k, st in KIND_STYLES.items():
                legend.append(k, style=st + " reverse")
                legend.append(" ")
            console.print(legend)
        for s, e, label in self.rows:
            if label is None:
                seg = self.shown[s:e]
                if seg.strip():
                    console.print(Text("(outside any turn) ", style="dim")
                                  + Text(seg, style="dim"))
                continue
            console.print(Text(self._label(label), style="bold" if color else ""))
            inner = [(max(a, s), min(b, e), k) for a, b, k in cspans if min(b, e) > max(a, s)]
            if color:
                t = Text(self.shown[s:e])
                for a, b, k in inner:
                    t.stylize(KIND_STYLES.get(k, OTHER_STYLE) + " reverse", a - s, b - s)
                console.print(t)
            else:
                out, pos = [], s
                for a, b, k in merge_spans(inner):
                    out += [self.shown[pos:a], OPEN_MARK, self.shown[a:b], CLOSE_MARK]
                    pos = b
                out.append(self.shown[pos:e])
                console.print(Text("".join(out)))
        total = sum(s.end - s.start for s in self.spans)
        n = self.conv.length
        pct = f" ({100.0 * total / n:.1f}%)" if n else ""
        nt = len(self.conv.turns)
        console.print(Text(f"{nt} turn{'s' if nt != 1 else ''}, {total} of {n} {self.unit}s "
                           f"trained{pct}", style="dim" if color else ""))
        for w in self.conv.warnings:
            console.print(Text(f"warning: {w}", style="yellow" if color else ""))
        for b in self.conv.boundaries:
            console.print(Text(f"boundary: {b}", style="yellow" if color else ""))

    def json(self, ids) -> dict:
        return {
            "format": self.fmt.name, "mode": self.conv.mode, "length": self.conv.length,
            "policy": {"roles": list(self.policy.roles), "thinking": self.policy.thinking,
                       "tool_calls": self.policy.tool_calls,
                       "end_marker": self.policy.end_marker,
                       "last_turn_only": self.policy.last_turn_only,
                       "truncated": self.policy.truncated},
            "turns": [{"index": i, "role": t.role, "start": t.start, "end": t.end,
                       "complete": t.complete, "generation_prompt": t.generation_prompt,
                       "valid": t.valid} for i, t in enumerate(self.conv.turns)],
            "spans": [{"start": s.start, "end": s.end, "role": s.role, "kind": s.kind,
                       "turn": s.turn,
                       "text": self.shown[self.to_char(s.start):self.to_char(s.end)]}
                      for s in self.spans],
            "mask": self.conv.mask(self.policy) if ids is None else None,
            "warnings": [str(w) for w in self.conv.warnings],
            "boundaries": [str(b) for b in self.conv.boundaries],
        }

    def html(self) -> str:
        esc = html.escape
        cspans = self._char_spans()
        parts = []
        for s, e, label in self.rows:
            if label is None:
                if self.shown[s:e].strip():
                    parts.append(f'<div class="gap"><pre>{esc(self.shown[s:e])}</pre></div>')
                continue
            t = self.conv.turns[label]
            body, pos = [], s
            for a, b, k in sorted((max(a, s), min(b, e), k) for a, b, k in cspans
                                  if min(b, e) > max(a, s)):
                body.append(esc(self.shown[pos:a]))
                title = esc(f"turn {label} · {t.role} · {k}")
                body.append(f'<span class="t k-{esc(k)}" title="{title}">'
                            f"{esc(self.shown[a:b])}</span>")
                pos = b
            body.append(esc(self.shown[pos:e]))
            cls = "turn" + ("" if t.valid else " bad")
            parts.append(f'<div class="{cls}"><div class="label">{esc(self._label(label))}'
                         f'</div><pre>{"".join(body)}</pre></div>')
        kinds = sorted({k for _, _, k in cspans} | set(KIND_CSS))
        css_k = "\n".join(f".k-{k} {{ background: {KIND_CSS.get(k, OTHER_CSS)}; }}"
                          for k in kinds)
        legend = " ".join(f'<span class="t k-{esc(k)}">{esc(k)}</span>' for k in kinds)
        pol = self.policy
        notes = "".join(f"<li>{esc(str(w))}</li>" for w in
                        list(self.conv.warnings) + list(self.conv.boundaries))
        total = sum(s.end - s.start for s in self.spans)
        return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<title>chatgrammar · {esc(self.fmt.name)}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em; color: #222; }}
pre {{ white-space: pre-wrap; word-break: break-word; margin: .3em 0 1em 0;
       font-family: ui-monospace, monospace; font-size: 13px; }}
.turn {{ border-left: 3px solid #999; padding-left: .8em; margin-bottom: .6em; }}
.turn.bad {{ border-color: #d33; }}
.gap pre {{ color: #999; }}
.label {{ font-size: 12px; color: #555; font-weight: 600; }}
.t {{ border-radius: 2px; }}
{css_k}
</style></head><body>
<h1>{esc(self.fmt.name)}</h1>
<p>{esc(self.conv.mode)} mode · {len(self.conv.turns)} turns · {total} of {self.conv.length}
{esc(self.unit)}s trained · policy: roles={esc(','.join(pol.roles))}
thinking={pol.thinking} tool_calls={pol.tool_calls} end_marker={pol.end_marker}
last_turn_only={pol.last_turn_only} truncated={pol.truncated}</p>
<p>trained: {legend}</p>
{''.join(parts)}
{f'<h2>Notes</h2><ul>{notes}</ul>' if notes else ''}
</body></html>
"""
