"""One home for each fact of the package: every error class in chatgrammar.errors, one
span-merge helper."""
from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest

import chatgrammar
from chatgrammar import errors
from chatgrammar.runtime.spans import merge_spans


def _package_modules():
    for info in pkgutil.walk_packages(chatgrammar.__path__, "chatgrammar."):
        if info.name.endswith("__main__"):  # (importing it runs the CLI)
            continue
        try:
            yield importlib.import_module(info.name)
        except ImportError:  # (an integration whose optional dependency is not installed)
            continue


def test_every_error_class_is_defined_in_errors():
    outside = sorted(
        f"{mod.__name__}.{name}" for mod in _package_modules()
        for name, obj in vars(mod).items()
        if inspect.isclass(obj) and issubclass(obj, errors.ChatGrammarError)
        and obj.__module__ != "chatgrammar.errors")
    assert not outside, f"define these in chatgrammar/errors.py (re-export them): {outside}"
    assert all(name in vars(errors) for name in errors.__all__)


# (whole dotted names, so that a re-layout of the package rewrites them with the imports)
@pytest.mark.parametrize("where, name", [("chatgrammar.core.detect", "PrecedenceError"),
                                         ("chatgrammar.conformance.render", "TemplateError"),
                                         ("chatgrammar.conformance.render", "RenderTimeout"),
                                         ("chatgrammar.runtime.tokenizers", "TokenizerLoadError")])
def test_moved_error_classes_keep_their_import_paths(where, name):
    mod = importlib.import_module(where)
    assert getattr(mod, name) is getattr(errors, name)


def test_merge_spans():
    assert merge_spans([]) == []
    # overlapping and abutting ranges merge; empty ones vanish; input order does not matter
    assert merge_spans([(5, 7), (0, 2), (2, 3), (6, 9), (4, 4)]) == [(0, 3), (5, 9)]
    assert merge_spans([(0, 2), (3, 4)]) == [(0, 2), (3, 4)]
    # with kinds: only abutting or overlapping neighbours of one kind merge
    assert merge_spans([(0, 2, "think"), (2, 4, "think"), (4, 6, "content"),
                        (6, 8, "content")], by_kind=True) == [(0, 4, "think"), (4, 8, "content")]
    # without by_kind, a third field is kept from the first span of each merged run
    assert merge_spans([(0, 2, "a"), (1, 4, "b"), (6, 7, "c")]) == [(0, 4, "a"), (6, 7, "c")]


def _code_strings(tree):
    """The string constants of a module that are not docstrings."""
    import ast

    docs = {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and n.body and isinstance(n.body[0], ast.Expr)
            and isinstance(n.body[0].value, ast.Constant)}
    return [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant)
            and isinstance(n.value, str) and id(n) not in docs]


def test_no_bundled_format_name_is_a_string_in_the_package():
    # a format's facts live with the format (its YAML and .tests.yaml), never in Python
    import ast
    from pathlib import Path

    names = set(chatgrammar.list_formats())
    root = Path(chatgrammar.__file__).parent
    found = sorted(f"{p.relative_to(root)}: {s!r}" for p in root.rglob("*.py")
                   for s in _code_strings(ast.parse(p.read_text(encoding="utf-8")))
                   if s in names)
    assert not found, found


# Functions of the package allowed over MAX_FUNCTION_LINES, each with its reason (none today:
# issue 14 "no function over ~100 lines"). An entry that is no longer over the limit fails
# the test too, so the list never hides anything.
MAX_FUNCTION_LINES = 100
LONG_FUNCTIONS: dict[str, str] = {}


def _function_lengths():
    """``(lines, "path:line qualname")`` of every function and method of the package,
    counting from its first decorator to its last line (docstring and comments included)."""
    import ast
    from pathlib import Path

    root = Path(chatgrammar.__file__).resolve().parent
    for py in sorted(root.rglob("*.py")):
        tree = ast.parse(py.read_text(encoding="utf-8"))
        stack = [(tree, "")]
        while stack:
            node, prefix = stack.pop()
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    qual = prefix + child.name
                    if not isinstance(child, ast.ClassDef):
                        start = min([d.lineno for d in child.decorator_list] + [child.lineno])
                        yield (child.end_lineno - start + 1,
                               f"{py.relative_to(root.parent).as_posix()}:{qual}")
                    stack.append((child, qual + "."))
                else:
                    stack.append((child, prefix))


def test_no_function_over_a_hundred_lines():
    """No function of the package is longer than MAX_FUNCTION_LINES lines (docstrings
    counted) unless LONG_FUNCTIONS names it with a reason."""
    lengths = list(_function_lengths())
    assert len(lengths) > 500  # the scan saw the package (every module, nested functions too)
    long = {where: n for n, where in lengths if n > MAX_FUNCTION_LINES}
    assert sorted(set(long) - set(LONG_FUNCTIONS)) == [], \
        f"split these (lines counted with the docstring): {long}"
    assert sorted(set(LONG_FUNCTIONS) - set(long)) == [], "no longer long: remove the entry"


def test_docs_formats_lists_every_bundled_format():
    """docs/formats.md's table has one row and one section per bundled format and states
    their number (a new format added as data must not leave the page stale)."""
    import re
    from pathlib import Path
    doc = (Path(__file__).resolve().parents[1] / "docs" / "formats.md").read_text(
        encoding="utf-8")
    names = chatgrammar.list_formats()
    rows = re.findall(r"^\| \[`([^`]+)`\]\(#([^)]+)\) \|", doc, re.M)
    assert sorted(r[0] for r in rows) == sorted(names)
    assert all(name == anchor for name, anchor in rows)
    missing = [n for n in names if not re.search(rf"^## {re.escape(n)}$", doc, re.M)]
    assert not missing, f"docs/formats.md has no section for: {missing}"
    assert f"\n{len(names)} bundled formats" in doc
