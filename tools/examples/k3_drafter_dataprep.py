#!/usr/bin/env python
"""Kimi-K3 drafter data prep: messages → K3 template render → ids → loss mask → JSONL.

The shape of an EAGLE-3 / DFlash data-prep step: every conversation is rendered with the real
Kimi-K3 chat template (sandboxed Jinja, exactly as transformers renders), tokenised, and masked
by the ``kimi-k3`` grammar in id mode (authoritative: a ``<|close|>`` typed by a user is
ordinary text). A sample that does not parse is reported and written to a reject file — never
given a silent all-zero mask.

Where NVIDIA Model-Optimizer is installed (``pip install 'chatgrammar[modelopt]'``), the masks are
computed the way its speculative-decoding data paths compute them: after
``chatgrammar.integrations.modelopt.install()``, through Model-Optimizer's own loss-mask
registry (``get_loss_mask_recovery(tokenizer).compute``), strict so that rejects are still
reported. Without it (``pip install '.[tiktoken]'``) chatgrammar computes them directly; the
masks are the same. ``--mask-with`` chooses.

Run from a checkout:
    python tools/examples/k3_drafter_dataprep.py --out k3_masks.jsonl
With a real Kimi-K3 tokenizer directory (remote code):
    python tools/examples/k3_drafter_dataprep.py --tokenizer /models/Kimi-K3 --trust-remote-code
Without ``--tokenizer`` a demo tiktoken Encoding is used (Qwen's BPE ranks bundled with the
tests, Kimi-K3's special ids: see tests/kimi_tokenizers.py).
"""
from __future__ import annotations

import argparse
import copy
import json
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent

import chatgrammar as cg  # noqa: E402
from chatgrammar.conformance.render import render_chat  # noqa: E402

_SENT = re.compile("\ue000(\\d+)\ue001")


def demo_tokenizer():
    sys.path.insert(0, str(ROOT))
    from tests.kimi_tokenizers import kimi_k3_encoding
    return kimi_k3_encoding(with_k2_strings=True)


def encode(tok, text: str, specials: bool) -> list[int]:
    if type(tok).__name__ == "Encoding":  # bare tiktoken
        return (tok.encode(text, allowed_special="all") if specials
                else tok.encode(text, allowed_special=set(), disallowed_special=()))
    return tok.encode(text, add_special_tokens=False, split_special_tokens=not specials)


def render_ids(tok, template: str, sample: dict) -> tuple[str, list[int]]:
    """Render, then tokenise template text with specials and message text without them."""
    msgs = copy.deepcopy(sample["messages"])
    texts: list[str] = []
    for m in msgs:
        for key in ("content", "reasoning_content"):
            if isinstance(m.get(key), str) and m[key]:
                texts.append(m[key])
                m[key] = f"\ue000{len(texts) - 1}\ue001"
    kw = {"tools": sample.get("tools")}
    marked = render_chat(template, msgs, **kw)
    ids, pos, out = [], 0, []
    for mt in _SENT.finditer(marked):
        ids += encode(tok, marked[pos:mt.start()], True)
        ids += encode(tok, texts[int(mt.group(1))], False)
        out += [marked[pos:mt.start()], texts[int(mt.group(1))]]
        pos = mt.end()
    ids += encode(tok, marked[pos:], True)
    out.append(marked[pos:])
    return "".join(out), ids


def mask_function(tok, fmt, policy, how: str = "auto"):
    """(a description, ids -> list of 0/1): Model-Optimizer's registry with chatgrammar
    installed when it is there (or asked for), else chatgrammar directly."""
    direct = ("chatgrammar (fmt.loss_mask)", lambda ids: fmt.loss_mask(ids, tok, policy=policy))
    if how == "chatgrammar":
        return direct
    try:
        from chatgrammar.integrations import modelopt as cg_modelopt
        from modelopt.torch.utils.loss_mask import get_loss_mask_recovery
    except ImportError:
        if how == "modelopt":
            raise SystemExit("--mask-with modelopt needs nvidia-modelopt: "
                             "pip install 'chatgrammar[modelopt]'")
        return direct
    cg_modelopt.install(format=fmt.name, policy=policy, strict=True)  # the two lines
    rec = get_loss_mask_recovery(tok)
    if rec is None:
        raise SystemExit(f"Model-Optimizer found no loss-mask recovery for {type(tok).__name__}")
    return (f"Model-Optimizer's loss-mask registry ({rec.name})",
            lambda ids: rec.compute(tok, ids).tolist())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--input", default=str(HERE / "data" / "k3_conversations.jsonl"))
    ap.add_argument("--template", default=str(HERE / "data" / "kimi-k3.jinja"))
    ap.add_argument("--tokenizer", help="local transformers tokenizer directory (default: demo)")
    ap.add_argument("--trust-remote-code", action="store_true")
    ap.add_argument("--out", default="k3_masks.jsonl")
    ap.add_argument("--no-thinking", action="store_true", help="do not train reasoning")
    ap.add_argument("--mask-with", choices=("auto", "modelopt", "chatgrammar"), default="auto",
                    help="auto (default): Model-Optimizer's registry when it is installed")
    args = ap.parse_args(argv)

    if args.tokenizer:
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(args.tokenizer, trust_remote_code=args.trust_remote_code)
    else:
        tok = demo_tokenizer()
    fmt = cg.detect_format(tok)
    print(f"format: {fmt.name} (detected from the tokenizer)")
    policy = fmt.default_policy.replace(thinking=not args.no_thinking)
    template = Path(args.template).read_text(encoding="utf-8")
    how, loss_mask = mask_function(tok, fmt, policy, args.mask_with)
    print(f"masks:  {how}")

    n = rejects = tokens = trained = 0
    reject_path = Path(args.out).with_suffix(".rejects.jsonl")
    with open(args.input, encoding="utf-8") as fin, open(args.out, "w", encoding="utf-8") as fout, \
            open(reject_path, "w", encoding="utf-8") as frej:
        for line_no, line in enumerate(fin, 1):
            sample = json.loads(line)
            _, ids = render_ids(tok, template, sample)
            try:
                mask = loss_mask(ids)
            except cg.ParseError as exc:
                rejects += 1
                frej.write(json.dumps({"line": line_no, "error": str(exc)}) + "\n")
                continue
            n += 1
            tokens += len(ids)
            trained += sum(mask)
            fout.write(json.dumps({"input_ids": ids, "loss_mask": mask,
                                   "num_trained": sum(mask)}) + "\n")
    print(f"{n} samples, {tokens} tokens, {trained / max(tokens, 1):.1%} trained, "
          f"{rejects} rejected → {args.out}")
    return 1 if rejects else 0


if __name__ == "__main__":
    sys.exit(main())
