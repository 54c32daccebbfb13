"""``chatgrammar infer TEMPLATE`` — infer a verified format spec from a chat template.

Renders the template in the sandbox on sentinel conversations, writes a spec in the ordinary
spec language and checks it against the template over the ``validate --template`` matrix
(see :func:`chatgrammar.infer_format` and docs/inference.md). Prints the spec (or writes it
with ``-o``) and the verification summary: the cases checked and the shapes the template
rejects.

Exit codes: 0 inferred and verified; 1 the template cannot be captured (one line saying what
and where; ``-v`` adds the failing case); 2 usage error (missing file, bad tokenizer).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from ..errors import ChatGrammarError, InferenceError
from ._common import UsageError, guarded


def register(subparsers: Any) -> None:
    """Add the ``infer`` subcommand to the ``chatgrammar`` parser.

    Args:
        subparsers: the object returned by ``ArgumentParser.add_subparsers()``.
    """
    p = subparsers.add_parser(
        "infer", help="infer a verified format spec from a chat template",
        description="Probe a Jinja chat template with sentinel conversations, write a format "
                    "spec for it and verify the spec against the template over the "
                    "validate --template matrix. Prints the spec and the verification summary.")
    p.add_argument("template", metavar="TEMPLATE", help="a Jinja chat template file")
    p.add_argument("--tokenizer", metavar="DIR",
                   help="a local transformers tokenizer directory: its special tokens are the "
                        "template's variables and decide which markers are special")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="let --tokenizer run the directory's own tokenizer code")
    p.add_argument("--var", action="append", default=[], metavar="KEY=VALUE",
                   help="a template variable (bos_token=<s>); VALUE is JSON if it parses")
    p.add_argument("-o", "--output", metavar="SPEC.yaml",
                   help="write the spec there instead of printing it")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="on failure, also show the failing case and the spec that failed")
    p.set_defaults(func=lambda a: guarded("infer", run, a))


def _read(path: str) -> str:
    p = Path(path)
    if not p.is_file():
        raise UsageError(f"no such template file: {path}")
    try:
        return p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"cannot read {path}: {exc}") from None


def run(args: argparse.Namespace) -> int:
    """Run ``chatgrammar infer``; returns the exit code."""
    from ..conformance.infer import infer_format
    from ._common import key_values, tokenizer_arg

    template = _read(args.template)
    variables = key_values(args.var, "--var")
    tokenizer = tokenizer_arg(args.tokenizer, args.trust_remote_code)
    try:
        fmt = infer_format(template, tokenizer=tokenizer, **variables)
    except InferenceError as exc:
        print(f"chatgrammar infer: error: {args.template}: {exc}", file=sys.stderr)
        if args.verbose and exc.details:
            print(exc.details, file=sys.stderr)
        return 1
    except ChatGrammarError as exc:
        print(f"chatgrammar infer: error: {args.template}: {str(exc).splitlines()[0]}",
              file=sys.stderr)
        return 1
    v = fmt.verification
    if args.output:
        try:
            Path(args.output).write_text(fmt.spec_yaml, encoding="utf-8")
        except OSError as exc:
            raise UsageError(f"cannot write {args.output}: {exc}") from None
        print(f"{fmt.name}: written to {args.output}")
        facts = _test_facts(fmt, Path(args.output))
        if facts:
            print(f"{fmt.name}: its test facts (refused shapes, accepted deviations, content "
                  f"shape) written to {facts} "
                  "(chatgrammar validate reads them)")
    else:
        sys.stdout.write(fmt.spec_yaml)
    out = sys.stdout if args.output else sys.stderr
    print(f"{fmt.name} × {Path(args.template).name}: {v.summary()}", file=out)
    for case, why in v.rejected:
        print(f"  rejected by the template: {case}: {why}", file=out)
    for note in v.notes:
        print(f"  note: {note}", file=out)
    return 0


def _test_facts(fmt, spec_path: Path) -> Path | None:
    """Beside a written spec, the ``.tests.yaml`` that tells ``chatgrammar validate`` the tool
    shapes the inferred format refuses on purpose (``refused:``), the deviation it accepts
    (``accepted:``) and the content shape it was verified with (``content: parts``), so the
    saved spec validates as it was verified; None when there is
    nothing to say or such a file exists already (never overwritten)."""
    import yaml

    from ..conformance.format_tests import tests_path
    from ..conformance.infer import ACCEPTED

    v = fmt.verification
    data: dict = {}
    if v.refused:
        data["refused"] = {case: why for case, why in v.refused}
    if v.deviations:
        data["accepted"] = dict(ACCEPTED)
    if v.content in ("parts", "sharegpt"):
        # the template prints content only as text parts (or reads ShareGPT's keys only):
        # check_template's default matrix for the saved spec gives it so
        # (conformance.templates.content_shape)
        data["content"] = v.content
    path = tests_path(spec_path)
    if not data or path.exists():
        return None
    head = (f"# {path.name}: test facts of {fmt.name} written by chatgrammar infer "
            "(docs/inference.md)\n")
    try:
        path.write_text(head + yaml.safe_dump(data, sort_keys=False, allow_unicode=True,
                                              width=100), encoding="utf-8")
    except OSError:
        return None
    return path
