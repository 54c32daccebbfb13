"""Run cg.infer_format on every template of some directories and group the refusals.

    python tools/infer_survey.py [DIR ...] [--json OUT] [--match SUBSTR]

Default directories: tests/data/templates (recursively). Each distinct template (by content)
is inferred once with the variables its bundled format's tests.yaml gives it (else none).
Prints one line per template (captured / refused + reason, seconds) and a table of the
refusal reasons grouped by their leading words. Development tool for docs/inference.md.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import chatgrammar as cg  # noqa: E402
from chatgrammar.conformance import infer as inf  # noqa: E402
from chatgrammar.conformance.format_tests import tests_for  # noqa: E402


def known_vars() -> dict:
    out: dict = {}
    for name in cg.list_formats():
        try:
            facts = tests_for(cg.load_format(name))
        except Exception:  # noqa: BLE001
            continue
        for t in facts.get("templates") or []:
            out.setdefault(Path(t["file"]).name, dict(t.get("vars") or {}))
    return out


def default_vars(template: str) -> dict:
    """What a tokenizer of the template's family would likely pass (the same guess as
    tools/wild.py), for templates no bundled format's facts name."""
    if "<|im_start|>" in template:
        return {"bos_token": "", "eos_token": "<|im_end|>"}
    if "<|start_header_id|>" in template:
        return {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
    if "<start_of_turn>" in template:
        return {"bos_token": "<bos>", "eos_token": "<eos>"}
    if "<|endoftext|>" in template:
        return {"bos_token": "<s>", "eos_token": "<|endoftext|>"}
    return {"bos_token": "<s>", "eos_token": "</s>"}


def wild_vars(p: Path) -> dict:
    """The variables an ``expected.yaml`` beside the template names (the wild set)."""
    e = p.parent / "expected.yaml"
    if not e.exists():
        return {}
    import yaml

    data = yaml.safe_load(e.read_text(encoding="utf-8")) or {}
    return dict(((data.get("templates") or {}).get(p.name) or {}).get("vars") or {})


def group(reason: str) -> str:
    r = re.sub(r"'[^']*'|\"[^\"]*\"", "'…'", reason)
    r = re.sub(r"\(.*", "", r)
    r = re.sub(r"\d+", "N", r)
    return r[:70]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("dirs", nargs="*", default=[str(ROOT / "tests/data/templates")])
    ap.add_argument("--json")
    ap.add_argument("--match", default="")
    args = ap.parse_args()
    kv = known_vars()
    seen: set = set()
    rows = []
    for d in args.dirs:
        for p in sorted(Path(d).rglob("*.jinja")):
            if args.match and args.match not in str(p):
                continue
            text = p.read_text(encoding="utf-8")
            h = hashlib.sha256(text.encode()).hexdigest()
            if h in seen:
                continue
            seen.add(h)
            v = kv.get(p.name) or wild_vars(p) or default_vars(text)
            t0 = time.time()
            try:
                fmt = inf.infer_format(text, **v)
                status, why = "captured", fmt.verification.summary()
            except cg.ChatGrammarError as exc:
                status, why = "refused", str(exc).splitlines()[0]
            except Exception as exc:  # noqa: BLE001
                status, why = "CRASH", f"{type(exc).__name__}: {exc}"
            dt = time.time() - t0
            try:
                det = cg.detect_format(chat_template=text).name
            except cg.ChatGrammarError:
                det = "-"
            why = f"[{det}] {why}"
            rows.append({"file": str(p), "status": status, "why": why, "s": round(dt, 2)})
            print(f"{status:8} {dt:5.1f}s {p.relative_to(d) if p.is_relative_to(d) else p}: "
                  f"{why[:160]}", flush=True)
    c = Counter(r["status"] for r in rows)
    print("\n", dict(c))
    g = Counter(group(r["why"]) for r in rows if r["status"] != "captured")
    for k, n in g.most_common():
        print(f"{n:4}  {k}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
