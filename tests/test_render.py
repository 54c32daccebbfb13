"""chatgrammar.conformance.render renders exactly like transformers; chatgrammar.conformance.matrix is well-formed.

The oracle is transformers itself: ``apply_chat_template(tokenize=False)`` on a tokenizer built
offline with the template, and ``render_jinja_template(return_assistant_tokens_mask=True)`` for
the ``{% generation %}`` spans. Every template under tests/data/templates is rendered over the
whole conversation matrix; a shape the template rejects must be rejected by both.
"""
from __future__ import annotations

import copy
import json
import re
import signal
import threading
import time
from pathlib import Path

import pytest

from chatgrammar.errors import ChatGrammarError
from chatgrammar.conformance.matrix import (
    MatrixCase,
    case_names,
    default_matrix,
    get_case,
    iter_renderable,
    missing_outputs,
    render_case,
)
from chatgrammar.conformance.render import (
    RenderResult,
    RenderTimeout,
    TemplateError,
    compile_template,
    has_generation_tags,
    render_chat,
    render_chat_with_spans,
)

transformers = pytest.importorskip("transformers")
from tokenizers import Tokenizer, models  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402
from transformers.utils.chat_template_utils import (  # noqa: E402
    _normalize_chat_messages,
    render_jinja_template,
)

DATA = Path(__file__).resolve().parent / "data"
TEMPLATES = sorted((DATA / "templates").glob("*.jinja")) + sorted(
    (DATA / "templates" / "generation").glob("*.jinja"))
# Templates that reject every matrix case, and why (they need inputs no generic matrix has).
REJECT_ALL = {
    # reads an undeclared `functions` variable (firefunction's own tool layout)
    "fireworks-ai-llama-3-firefunction-v2.jinja",
}

# Loop forever for practical purposes (10^10 iterations); the sandbox caps each range at 10^5.
RUNAWAY_SILENT = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
RUNAWAY_OUTPUT = "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}"
USER = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def hf_tokenizer():
    """A tiny offline fast tokenizer: only its special tokens matter to the template."""
    backend = Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>"))
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>", pad_token="<pad>")


def _hf_render(tok, template, case: MatrixCase):
    """transformers' rendering of a case, or the exception it raised."""
    try:
        return tok.apply_chat_template(copy.deepcopy(case.messages), chat_template=template,
                                       tokenize=False, **case.render_kwargs()), None
    except Exception as exc:  # noqa: BLE001 - any failure counts as "rejects this shape"
        return None, exc


def _hf_spans(tok, template, case: MatrixCase):
    rendered, spans = render_jinja_template(
        [_normalize_chat_messages(copy.deepcopy(case.messages))], chat_template=template,
        return_assistant_tokens_mask=True, **tok.special_tokens_map, **case.render_kwargs())
    return rendered[0], [tuple(s) for s in spans[0]]


# ------------------------------------------------------------------------------ parity
@pytest.mark.parametrize("path", TEMPLATES, ids=[p.name for p in TEMPLATES])
def test_parity_with_transformers_over_matrix(path, hf_tokenizer):
    template = path.read_text(encoding="utf-8")
    tagged = has_generation_tags(template)
    rendered = 0
    for case in default_matrix():
        expected, hf_error = _hf_render(hf_tokenizer, template, case)
        try:
            result = render_case(template, case, **hf_tokenizer.special_tokens_map)
        except TemplateError as exc:
            assert expected is None, f"{case.name}: transformers renders it, we raise {exc}"
            continue
        assert hf_error is None, f"{case.name}: transformers raises {hf_error!r}, we render"
        assert result.text == expected, f"{case.name}: rendering differs from transformers"
        if tagged:
            hf_text, hf_spans = _hf_spans(hf_tokenizer, template, case)
            assert hf_text == result.text
            assert list(result.generation_spans) == hf_spans, case.name
            if case.outputs:
                assert result.generation_spans, f"{case.name}: a tagged template recorded no span"
        else:
            assert result.generation_spans == ()
        rendered += 1
    if path.name in REJECT_ALL:
        assert rendered == 0
    else:
        assert rendered > 0, "the template rejects every case of the matrix"


def test_every_corpus_template_is_covered():
    names = {p.name for p in TEMPLATES}
    # at least the 145 this test was written with: helpers add templates, none is removed
    assert len(TEMPLATES) >= 145 and "moonshotai-Kimi-K3.jinja" in names
    assert sum(1 for p in TEMPLATES if p.parent.name == "generation") == 26


@pytest.mark.parametrize("path", [p for p in TEMPLATES if has_generation_tags(p.read_text())][:4],
                         ids=lambda p: p.name)
def test_generation_spans_cover_assistant_content(path):
    template = path.read_text(encoding="utf-8")
    result = render_case(template, get_case("multi-turn"), bos_token="<s>", eos_token="</s>")
    trained = "".join(result.generation_text())
    for answer in ("Red is a primary color.", "Blue is another primary color.",
                   "The last one is yellow."):
        assert answer in trained
    assert "Name a primary color." not in trained


@pytest.mark.parametrize("kwargs", [
    {"continue_final_message": True},
    {"continue_final_message": "reasoning_content"},
])
@pytest.mark.parametrize("name", ["Qwen-Qwen3.jinja", "openai-gpt-oss-120b.jinja",
                                  "mistralai-Mistral-7B-Instruct-v0.3.jinja",
                                  "moonshotai-Kimi-K3.jinja"])
def test_continue_final_message_parity(name, kwargs, hf_tokenizer):
    template = (DATA / "templates" / name).read_text(encoding="utf-8")
    messages = [{"role": "user", "content": "Is 7 prime?"},
                {"role": "assistant", "content": "Yes, 7 is",
                 "reasoning_content": "Divisors of 7"}]
    try:
        expected = hf_tokenizer.apply_chat_template(copy.deepcopy(messages), chat_template=template,
                                                    tokenize=False, **kwargs)
    except ValueError:
        with pytest.raises((ValueError, TemplateError)):
            render_chat(template, messages, **hf_tokenizer.special_tokens_map, **kwargs)
        return
    assert render_chat(template, messages, **hf_tokenizer.special_tokens_map, **kwargs) == expected


def test_tools_given_as_functions_match_transformers(hf_tokenizer):
    def get_weather(city: str):
        """Get the weather.

        Args:
            city: The city.
        """

    template = (DATA / "templates" / "Qwen-Qwen2.5-7B-Instruct.jinja").read_text()
    expected = hf_tokenizer.apply_chat_template(USER, tools=[get_weather], chat_template=template,
                                                tokenize=False)
    assert render_chat(template, USER, tools=[get_weather]) == expected


# ---------------------------------------------------------------------- environment
@pytest.mark.parametrize("expr", [
    "{{ x|tojson }}",
    "{{ x|tojson(ensure_ascii=True) }}",
    "{{ x|tojson(indent=2) }}",
    "{{ x|tojson(separators=(',', ':')) }}",
    "{{ x|tojson(sort_keys=True) }}",
])
def test_tojson_semantics_match_transformers(expr, hf_tokenizer):
    # No HTML escaping of < > & ' (Jinja's own tojson escapes them), unicode kept by default.
    x = {"b": "<tag> & 'q' \"d\" 你好 🌍", "a": [1, 2.5, None, True]}
    expected = hf_tokenizer.apply_chat_template(USER, chat_template=expr, tokenize=False, x=x)
    assert render_chat(expr, USER, x=x) == expected
    assert json.loads(render_chat(expr, USER, x=x)) == x


def test_variables_and_special_tokens():
    template = ("{{ bos_token }}|{{ eos_token }}|{{ add_generation_prompt }}|{{ tools }}|"
                "{{ documents }}|{{ enable_thinking }}|{{ messages|length }}")
    assert render_chat(template, USER, bos_token="<s>", eos_token="</s>",
                       enable_thinking=False) == "<s>|</s>|False|None|None|False|1"
    # An undefined variable renders empty, as in transformers (no StrictUndefined).
    assert render_chat("[{{ bos_token }}]", USER) == "[]"


def test_none_values_dropped_and_input_not_mutated():
    messages = [{"role": "assistant", "content": None, "tool_calls": None,
                 "reasoning_content": "r"}]
    before = copy.deepcopy(messages)
    out = render_chat("{{ messages[0].keys()|list|sort|join(',') }}", messages)
    # reasoning is aliased under `thinking` too (transformers 5.x), None-valued keys are dropped
    assert out == "reasoning_content,role,thinking"
    assert messages == before


def test_compile_is_cached():
    source = "{{ messages[0].content }}"
    assert compile_template(source) is compile_template(source)


def test_raise_exception_becomes_template_error():
    template = "line one\n{{ raise_exception('System role not supported') }}"
    with pytest.raises(TemplateError) as info:
        render_chat(template, USER)
    assert info.value.kind == "raised"
    assert info.value.message == "System role not supported"
    assert info.value.lineno == 2
    assert isinstance(info.value, ChatGrammarError)


@pytest.mark.parametrize("template, kind", [
    ("{% for %}", "syntax"),
    ("{{ messages[0].content + 1 }}", "runtime"),
    ("{{ messages[0].content.nope.deeper }}", "undefined"),
    ("{{ messages.__class__.__mro__ }}", "security"),
    ("{% set ns = namespace() %}{% set ns._x = 1 %}", "security"),
    ("{{ messages.append(1) }}", "security"),
])
def test_template_failures_are_classified(template, kind):
    with pytest.raises(TemplateError) as info:
        render_chat(template, USER)
    assert info.value.kind == kind, info.value


def test_empty_conversation_and_incompatible_flags():
    with pytest.raises(ValueError):
        render_chat("x", [])
    with pytest.raises(ValueError):
        render_chat("{{ messages[0].content }}", USER, add_generation_prompt=True,
                    continue_final_message=True)


def test_loopcontrols_extension():
    template = "{% for m in [1, 2, 3] %}{% if m == 2 %}{% break %}{% endif %}{{ m }}{% endfor %}"
    assert render_chat(template, USER) == "1"


def test_generation_spans_like_assistant_tracker():
    template = ("{% for m in messages %}<{{ m.role }}>{% if m.role == 'assistant' %}"
                "{% generation %}{{ m.content }}</a>{% endgeneration %}"
                "{% else %}{{ m.content }}{% endif %}{% endfor %}")
    result = render_chat_with_spans(template, [
        {"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "q2"}, {"role": "assistant", "content": "a2"}])
    assert isinstance(result, RenderResult)
    assert result.generation_text() == ["a1</a>", "a2</a>"]
    assert result.text == "<user>q1<assistant>a1</a><user>q2<assistant>a2</a>"


# ------------------------------------------------------------------------------ timeout
@pytest.mark.parametrize("template", [RUNAWAY_SILENT, RUNAWAY_OUTPUT], ids=["silent", "output"])
def test_runaway_template_is_stopped_in_main_thread(template):
    assert threading.current_thread() is threading.main_thread()
    before = signal.getsignal(signal.SIGALRM)
    # the template never ends: that RenderTimeout is raised at all is the proof it was stopped
    with pytest.raises(RenderTimeout) as info:
        render_chat(template, USER, timeout=0.2)
    assert info.value.kind == "timeout" and info.value.timeout == 0.2
    # the previous handler is back and no timer is left armed
    assert signal.getsignal(signal.SIGALRM) is before
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    assert render_chat("ok", USER, timeout=0.2) == "ok"


@pytest.mark.parametrize("template", [RUNAWAY_SILENT, RUNAWAY_OUTPUT], ids=["silent", "output"])
def test_runaway_template_is_stopped_in_other_thread(template):
    outcome = {}

    def work():
        try:
            render_chat(template, USER, timeout=0.2)
        except RenderTimeout:
            outcome["stopped"] = True

    thread = threading.Thread(target=work)
    thread.start()
    thread.join(60.0)   # a hang guard: the render is stopped after 0.2 s
    assert not thread.is_alive() and outcome.get("stopped")
    deadline = time.monotonic() + 60.0  # the worker thread is stopped, not leaked (hang guard)
    while any(t.name == "chatgrammar-render" for t in threading.enumerate()):
        assert time.monotonic() < deadline, "runaway render thread still alive"
        time.sleep(0.01)


def test_timeout_leaves_a_callers_timer_alone():
    fired = []
    previous = signal.signal(signal.SIGALRM, lambda *a: fired.append(True))
    try:
        signal.setitimer(signal.ITIMER_REAL, 30.0)
        with pytest.raises(RenderTimeout):
            render_chat(RUNAWAY_SILENT, USER, timeout=0.2)  # falls back to a worker thread
        remaining, _ = signal.getitimer(signal.ITIMER_REAL)
        assert 25.0 < remaining <= 30.0 and not fired
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0.0)
        signal.signal(signal.SIGALRM, previous)


def test_no_timeout_means_no_limit():
    assert render_chat("{% for i in range(1000) %}x{% endfor %}", USER, timeout=None) == "x" * 1000


# ------------------------------------------------------------------------------- matrix
def test_matrix_shape():
    cases = default_matrix()
    names = [c.name for c in cases]
    assert names == case_names() and len(set(names)) == len(names)
    tags = set().union(*(c.tags for c in cases))
    for needed in ("system", "multi-turn", "tools", "tool-calls", "tool-results", "string-args",
                   "reasoning", "thinking-on", "thinking-off", "unicode", "empty-content",
                   "special-chars", "multiline", "generation-prompt", "content-parts"):
        assert needed in tags, needed
    assert any(not c.tags & {"system"} for c in cases)
    assert max(sum(m["role"] == "user" for m in c.messages) for c in cases) >= 3
    for case in cases:
        if case.add_generation_prompt:
            assert case.messages[-1]["role"] == "user"
        for message in case.messages:
            for call in message.get("tool_calls", ()):
                # Mistral templates require ids of exactly 9 alphanumeric characters
                assert re.fullmatch(r"[A-Za-z0-9]{9}", call["id"]), call["id"]
            if message["role"] == "tool":
                assert re.fullmatch(r"[A-Za-z0-9]{9}", message["tool_call_id"])


def test_matrix_outputs():
    case = get_case("tool-call-string-args")
    [call_turn, final] = case.outputs
    assert call_turn.content == "" and call_turn.tool_calls[0].argument_dict == {
        "city": "Paris", "unit": "celsius"}
    assert isinstance(call_turn.tool_calls[0].arguments, str)
    assert call_turn.strings() == ["get_weather", "Paris", "celsius"]
    assert final.strings() == ["It is sunny and 22 degrees in Paris."]
    reasoning = get_case("reasoning").outputs
    assert [o.reasoning for o in reasoning] == [
        "The user asks a simple sum. Two plus two is four.",
        "Another sum. Three plus three is six."]
    assert get_case("content-parts").outputs[0].content == "The sky is blue."
    assert get_case("generation-prompt").outputs[-1].message_index == 2


def test_matrix_copies_are_independent():
    first = get_case("basic")
    first.messages[0]["content"] = "changed"
    assert get_case("basic").messages[0]["content"] != "changed"
    with pytest.raises(KeyError, match="known"):
        get_case("nope")


def test_iter_renderable_reports_rejections():
    template = (DATA / "templates" / "google-gemma-2-2b-it.jinja").read_text()
    results = list(iter_renderable(template, bos_token="<bos>"))
    assert [r.case.name for r in results] == case_names()
    by_name = {r.case.name: r for r in results}
    assert by_name["basic"].rejected and by_name["basic"].reason == (
        "[raised] System role not supported")
    case, text, reason = by_name["no-system"]
    assert reason is None and text.startswith("<bos><start_of_turn>user\n")
    assert missing_outputs(case, text) == []
    with pytest.raises(TemplateError):
        list(iter_renderable("{% if %}"))


def test_qwen3_renders_every_case_with_its_outputs():
    template = (DATA / "templates" / "Qwen-Qwen3.jinja").read_text()
    for case, text, reason in iter_renderable(template):
        if "content-parts" in case.tags:  # Qwen3 concatenates content as a string
            assert reason.startswith("[runtime] TypeError"), reason
            continue
        assert reason is None, (case.name, reason)
        assert missing_outputs(case, text) == [], case.name


# ------------------------------------------------------------------------------ goldens
def test_gpt_oss_template_matches_harmony_goldens():
    """openai/harmony's expected renderings (tests/data/goldens/openai-harmony)."""
    goldens = DATA / "goldens" / "openai-harmony"
    template = (DATA / "templates" / "openai-gpt-oss-120b.jinja").read_text()
    messages = [
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "2 + 2 equals 4.",
         "thinking": 'User asks a simple question: "What is 2 + 2?" The answer: 4.'},
        {"role": "user", "content": "What about 9 / 2?"},
    ]
    out = render_chat(template, messages, add_generation_prompt=True)
    system, _, rest = out.partition("<|end|>")
    # analysis of a finished turn is dropped from history (harmony's default)
    assert "<|start|>user" + rest.partition("<|start|>user")[2] == (
        goldens / "test_dropping_cot_by_default.txt").read_text()
    # the template's automatic system message is harmony's, up to the (render-time) date
    no_tools = (goldens / "test_no_tools.txt").read_text().removesuffix("\n")  # file's EOL
    golden_date = re.search(r"Current date: (\S+)", no_tools).group(1)
    system = re.sub(r"Current date: \S+", f"Current date: {golden_date}", system)
    assert system + "<|end|><|start|>assistant" == no_tools
