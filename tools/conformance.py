"""Conformance runner: every bundled format × its real chat templates × the conversation matrix.

For each (format, template) pair of :data:`TEMPLATES`, renders every case of the built-in matrix
with the template exactly as transformers does, parses it with the format (text mode, and id
mode with a one-id-per-marker tokenizer), and checks that what the format trains is exactly the
assistant output (see :mod:`chatgrammar.conformance` for the oracle). Prints a markdown report;
``--write`` stores it as ``docs/conformance.md``.

Usage::

    python tools/conformance.py                      # print the report
    python tools/conformance.py --write              # regenerate docs/conformance.md
    python tools/conformance.py -f kimi-k3 -v        # one format, with failure details

Exit code: 0 when no case fails, 1 otherwise (2: usage error).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(ROOT))

from chatgrammar.conformance import check_template  # noqa: E402
from chatgrammar.errors import ChatGrammarError  # noqa: E402
from chatgrammar.matrix import case_names  # noqa: E402
from chatgrammar.registry import list_formats, load_format  # noqa: E402

TEMPLATE_DIR = ROOT / "tests" / "data" / "templates"
DEFAULT_OUT = ROOT / "docs" / "conformance.md"

#: Which templates belong to which format: the models of each spec's ``covers:`` whose template
#: is in tests/data/templates (provenance: tests/data/templates/SOURCES.md). Kept here, not in
#: the specs, because it names test data, not format facts.
TEMPLATES: dict[str, list[str]] = {
    "kimi-k2": ["moonshotai-Kimi-K2.jinja", "moonshotai-Kimi-K2-Thinking.jinja"],
    "kimi-k3": ["moonshotai-Kimi-K3.jinja"],
    "chatml": [
        "Qwen-Qwen2.5-7B-Instruct.jinja", "Qwen-Qwen2.5-VL.jinja", "Qwen-QwQ-32B.jinja",
        "Qwen-Qwen3.jinja", "Qwen-Qwen3-0.6B.jinja", "Qwen-Qwen3-235B-A22B.jinja",
        "Qwen-Qwen3-Instruct-2507.jinja", "Qwen-Qwen3-VL.jinja",
        "Qwen-Qwen3-Coder-30B-A3B-Instruct.jinja", "Qwen3-Coder.jinja",
        "Qwen-Qwen3.5-2B.jinja", "Qwen3.5-4B.jinja", "Qwen-Qwen3.6.jinja",
        "HuggingFaceTB-SmolLM3-3B.jinja", "NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use.jinja",
        "NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja", "MiMo-VL.jinja",
        "tiiuae-Falcon-H1.jinja", "NVIDIA-Nemotron-3-Nano-30B-A3B-BF16.jinja",
        "nvidia-NVIDIA-Nemotron-3-Super.jinja", "nvidia-NVIDIA-Nemotron-3-Ultra.jinja",
        "stepfun-ai-Step-3.5-Flash.jinja", "StepFun3.5-Flash.jinja",
        "Bielik-11B-v3.0-Instruct.jinja", "LiquidAI-LFM2.jinja", "LFM2.5-8B-A1B.jinja",
        "LFM2.5-Instruct.jinja",
        # LFM2-8B-A1B.jinja is left out: with tools it writes a bare notice before the first
        # turn (docs/formats.md, chatml quirks)
    ],
    "cohere": [
        "CohereForAI-c4ai-command-r-v01.jinja", "CohereForAI-c4ai-command-r-plus-tool_use.jinja",
        "CohereForAI-c4ai-command-r7b-12-2024-default.jinja",
        "CohereForAI-c4ai-command-r7b-12-2024-tool_use.jinja",
        "CohereForAI-c4ai-command-r7b-12-2024-rag.jinja", "CohereLabs-c4ai-command-r7b-12-2024.jinja",
        "CohereLabs-c4ai-command-a-03-2025.jinja", "Cohere2MoE.jinja",
    ],
    "deepseek-v3": [
        "deepseek-ai-DeepSeek-V3.jinja", "deepseek-ai-DeepSeek-R1.jinja",
        "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja",
        "deepseek-ai-DeepSeek-R1-Distill-Llama-8B.jinja", "deepseek-ai-DeepSeek-V3.1.jinja",
        "deepseek-ai-DeepSeek-V3.2.jinja",
    ],
    "gemma": ["google-gemma-2-2b-it.jinja", "google-gemma-3-it.jinja", "google-gemma-3n.jinja"],
    "functiongemma": ["google-functiongemma.jinja",
                      "google-ai-edge-LiteRT-LM-functiongemma.jinja"],
    "functionary-v3": ["meetkai-functionary-medium-v3.2.jinja"],
    "gemma4": ["google-gemma-4-31B-it.jinja", "google-gemma-4-31B-it-interleaved.jinja"],
    "gigachat3": ["GigaChat3-10B-A1.8B.jinja", "GigaChat3.1-10B-A1.8B.jinja"],
    "glm4": ["zai-org-GLM-4.5.jinja", "GLM-4.6.jinja", "GLM-4.7-Flash.jinja"],
    "granite": ["ibm-granite-granite-3.3-2B-Instruct.jinja", "ibm-granite-granite-4.0.jinja",
                "ibm-granite-granite-4.1.jinja"],
    "harmony": ["openai-gpt-oss-120b.jinja"],
    "llama3": [
        "meta-llama-Meta-Llama-3-8B-Instruct.jinja", "meta-llama-Llama-3.1-8B-Instruct.jinja",
        "meta-llama-Llama-3.2-3B-Instruct.jinja", "meta-llama-Llama-3.3-70B-Instruct.jinja",
        "meetkai-functionary-medium-v3.1.jinja",
    ],
    "llama4": ["meta-llama-Llama-4-Scout-17B-16E-Instruct.jinja"],
    "minimax-m1": ["MiniMaxAI-MiniMax-M1.jinja"],
    "minimax-m2": ["MiniMax-M2.jinja"],
    "reka": ["Reka-Edge.jinja"],
    "mistral": [
        "mistralai-Mistral-7B-Instruct-v0.3.jinja", "mistralai-Mistral-Nemo-Instruct-2407.jinja",
        "mistralai-Mistral-Small-24B-Instruct-2501.jinja",
        "Mistral-Small-3.2-24B-Instruct-2506.jinja",
        "mistralai-Ministral-3-14B-Reasoning-2512.jinja",
    ],
    "nemotron-nano-v2": ["NVIDIA-Nemotron-Nano-v2.jinja"],
    "apertus": ["Apertus-8B-Instruct.jinja"],
    "apriel": ["ServiceNow-AI-Apriel-1.5-15b-Thinker.jinja"],
    "seed-oss": ["ByteDance-Seed-OSS.jinja"],
    "solar-open": ["upstage-Solar-Open-100B.jinja"],
    "phi3": ["microsoft-Phi-3-mini-4k-instruct.jinja", "microsoft-Phi-3.5-mini-instruct.jinja",
             "microsoft-Phi-4-mini-instruct.jinja"],
    "phi4": ["microsoft-phi-4.jinja", "microsoft-Phi-4-reasoning.jinja"],
    # issue 11 §2 families (their formats/<name>.tests.yaml lists the same templates)
    "llama2": ["meta-llama-Llama-2-7b-chat-hf.jinja", "codellama-CodeLlama-7b-Instruct-hf.jinja",
               "bofenghuang-vigogne-2-70b-chat.jinja"],
    "zephyr": ["HuggingFaceH4-zephyr-7b-beta.jinja", "TinyLlama-TinyLlama-1.1B-Chat-v1.0.jinja"],
    "tulu": ["allenai-OLMo-2-1124-13B-Instruct.jinja", "allenai-tulu-2-7b.jinja",
             "allenai-OLMo-7B-Instruct.jinja"],
    # their tool cases are accepted deviations (formats/deepseek-*.tests.yaml `accepted:`)
    "deepseek-llm": ["deepseek-ai-DeepSeek-V2-Chat.jinja"],
    "deepseek-coder": ["deepseek-ai-deepseek-coder-33b-instruct.jinja"],
    "exaone": ["LGAI-EXAONE-EXAONE-3.5-7.8B-Instruct.jinja"],
    "openchat": ["openchat-openchat-3.5-0106.jinja"],
    "chatglm3": ["THUDM-chatglm3-6b.jinja"],
    "glm-edge": ["THUDM-glm-edge-1.5b-chat.jinja"],
    "idefics3": ["HuggingFaceM4-Idefics3-8B-Llama3.jinja"],
    "hunyuan": ["vllm-tool_chat_template_hunyuan_a13b.jinja"],
    "baichuan2": ["vllm-template_baichuan.jinja"],
    "starcoder2-instruct": ["bigcode-starcoder2-15b-instruct-v0.1.jinja"],
    "jamba": ["ai21labs-AI21-Jamba-Mini-1.7.jinja"],
}

#: Template variables transformers would pass from each family's tokenizer
#: (``special_tokens_map``); only the ones the templates read.
VARIABLES: dict[str, dict[str, str]] = {
    "mistral": {"bos_token": "<s>", "eos_token": "</s>"},
    "llama3": {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
    "deepseek-v3": {"bos_token": "<\uff5cbegin\u2581of\u2581sentence\uff5c>",
                    "eos_token": "<\uff5cend\u2581of\u2581sentence\uff5c>"},
    "gemma": {"bos_token": "<bos>", "eos_token": "<eos>"},
    "phi3": {"bos_token": "<s>", "eos_token": "<|endoftext|>"},
    "phi4": {"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>"},
    "chatml": {"eos_token": "<|im_end|>"},
    "cohere": {"bos_token": "<BOS_TOKEN>", "eos_token": "<|END_OF_TURN_TOKEN|>"},
    "llama4": {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot|>"},
    "gemma4": {"bos_token": "<bos>"},
    "gigachat3": {"bos_token": "<s>"},
    "apertus": {"bos_token": "<s>", "eos_token": "</s>"},
    "apriel": {"bos_token": "<s>", "eos_token": "</s>"},
    "functiongemma": {"bos_token": "<bos>"},
    "functionary-v3": {"bos_token": "<|begin_of_text|>"},
    "seed-oss": {"bos_token": "<seed:bos>", "eos_token": "<seed:eos>"},
    "llama2": {"bos_token": "<s>", "eos_token": "</s>"},
    "zephyr": {"bos_token": "<s>", "eos_token": "</s>"},
    "tulu": {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>"},
    "deepseek-llm": {"bos_token": "<\uff5cbegin\u2581of\u2581sentence\uff5c>",
                     "eos_token": "<\uff5cend\u2581of\u2581sentence\uff5c>"},
    "deepseek-coder": {"bos_token": "<\uff5cbegin\u2581of\u2581sentence\uff5c>",
                       "eos_token": "<|EOT|>"},
    "openchat": {"bos_token": "<s>", "eos_token": "<|end_of_turn|>"},
    "starcoder2-instruct": {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>"},
    "jamba": {"bos_token": "<|startoftext|>"},
}

MARK = {"pass": "✓", "fail": "✗", "skip": "–", "deviation": "✓†"}


def run(formats: list[str], template_dir: Path) -> tuple[list, list[str]]:
    """Check every (format, template) pair; returns (results, missing template files)."""
    results, missing = [], []
    for name in formats:
        fmt = load_format(name)
        for tname in TEMPLATES.get(name, []):
            path = template_dir / tname
            if not path.is_file():
                missing.append(f"{name}: {tname}")
                continue
            results.append(check_template(fmt, path.read_text(encoding="utf-8"), name=tname,
                                          variables=VARIABLES.get(name)))
    return results, missing


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def markdown(results: list, missing: list[str], formats: list[str]) -> str:
    """The report: summary, per-case grid, failure and skip reasons."""
    cases = case_names()
    lines = [
        "# Conformance: bundled formats × real chat templates",
        "",
        "Generated by `python tools/conformance.py --write`; do not edit by hand. Each template",
        "(tests/data/templates, provenance in its SOURCES.md) renders the built-in conversation",
        "matrix (`chatgrammar.matrix`) exactly as transformers does; the format must parse every",
        "rendering, in text mode and in id mode (one id per marker), and train exactly the",
        "assistant output: after the template's generation prompt (or from a body block it",
        "prefills, such as an opened think block), up to the end of the message, terminator",
        "excluded, and nothing outside assistant messages. `chatgrammar validate FORMAT",
        "--template FILE` runs the same check for one pair and shows every mismatch. Shapes a",
        "template rejects (it raises) are skipped.",
        "",
        f"Legend: {MARK['pass']} pass · {MARK['deviation']} pass with a documented deviation "
        f"(listed below) · {MARK['fail']} fail · {MARK['skip']} skipped (the template rejects "
        "this conversation).",
        "",
        "## Summary",
        "",
        "| format | template | pass | fail | skipped |",
        "|---|---|---:|---:|---:|",
    ]
    for r in results:
        c = r.counts()
        if r.error:
            lines.append(f"| {r.format} | {r.template} | – | – | – |")
            continue
        lines.append(f"| {r.format} | {r.template} | {c['pass']} | {c['fail']} | {c['skip']} |")
    tot = {k: sum(r.counts()[k] for r in results) for k in ("pass", "fail", "skip")}
    lines += ["", f"{len(results)} pairs, {sum(tot.values())} cases: {tot['pass']} pass, "
                  f"{tot['fail']} fail, {tot['skip']} skipped.", ""]

    lines += ["## Cases", "", "Columns are the matrix cases, in order: "
              + ", ".join(f"{i + 1} `{c}`" for i, c in enumerate(cases)) + ".", ""]
    head = "| format | template | " + " | ".join(str(i + 1) for i in range(len(cases))) + " |"
    lines += [head, "|---|---|" + "|".join(":-:" for _ in cases) + "|"]
    for r in results:
        by = {c.case: "deviation" if c.status == "pass" and c.deviations else c.status
              for c in r.cases}
        cells = " | ".join(MARK.get(by.get(c, ""), " ") for c in cases)
        lines.append(f"| {r.format} | {r.template} | {cells} |")
    lines.append("")

    fails = [(r, c) for r in results for c in r.cases if c.status == "fail"]
    if fails or any(r.error for r in results):
        lines += ["## Failures", "", "First reason of each failing case; run `chatgrammar "
                  "validate FORMAT --template FILE --case NAME` for the rendering with the "
                  "expected and the found spans marked.", ""]
        for r in results:
            if r.error:
                lines.append(f"- **{r.format} × {r.template}**: {_cell(r.error)}")
        for r, c in fails:
            lines.append(f"- **{r.format} × {r.template}**, `{c.case}`: {_cell(c.reason)}")
        lines.append("")
    devs = [(r, c, d) for r in results for c in r.cases if c.status == "pass"
            for d in dict.fromkeys(c.deviations)]
    if devs:
        lines += ["## Documented deviations", "",
                  "Cases that pass with a difference from the assistant output which the format "
                  "makes on purpose and documents (`chatgrammar.conformance.ACCEPTED`).", ""]
        for r, c, d in devs:
            lines.append(f"- **{r.format} × {r.template}**, `{c.case}`: {_cell(d)}")
        lines.append("")
    skips: dict[tuple, list[str]] = {}
    for r in results:
        for c in r.cases:
            if c.status == "skip":
                skips.setdefault((r.format, r.template, c.reason), []).append(c.case)
    if skips:
        lines += ["## Skipped shapes", ""]
        for (f, t, why), names in skips.items():
            lines.append(f"- {f} × {t}: {', '.join(f'`{n}`' for n in names)} — {_cell(why)}")
        lines.append("")
    unassigned = sorted(set(p.name for p in TEMPLATE_DIR.glob("*.jinja"))
                        - {t for ts in TEMPLATES.values() for t in ts})
    if unassigned:
        lines += ["## Templates without a bundled format", "",
                  "In tests/data/templates but not covered by any bundled format yet: "
                  + ", ".join(unassigned) + ".", ""]
    if missing:
        lines += ["## Missing template files", "", *[f"- {m}" for m in missing], ""]
    no_templates = [f for f in formats if not TEMPLATES.get(f)]
    if no_templates:
        lines += ["## Formats without templates here", "", ", ".join(no_templates), ""]
    return "\n".join(lines).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-f", "--format", action="append", default=[], metavar="NAME",
                    help="only these formats (repeatable; default: every bundled format)")
    ap.add_argument("--templates", default=str(TEMPLATE_DIR), metavar="DIR",
                    help="where the template files are (default: tests/data/templates)")
    ap.add_argument("--write", nargs="?", const=str(DEFAULT_OUT), metavar="FILE",
                    help="write the markdown report (default file: docs/conformance.md)")
    ap.add_argument("-v", "--verbose", action="store_true",
                    help="print every failing case with its rendering and marked spans")
    args = ap.parse_args(argv)
    known = list_formats()
    formats = args.format or known
    bad = [f for f in formats if f not in known]
    if bad:
        print(f"conformance: unknown format(s): {', '.join(bad)}", file=sys.stderr)
        return 2
    try:
        results, missing = run(formats, Path(args.templates))
    except ChatGrammarError as exc:
        print(f"conformance: error: {exc}", file=sys.stderr)
        return 2
    report = markdown(results, missing, formats)
    if args.write:
        Path(args.write).write_text(report, encoding="utf-8")
        print(f"wrote {args.write}", file=sys.stderr)
    else:
        sys.stdout.write(report)
    if args.verbose:
        for r in results:
            for c in r.cases:
                if c.status == "fail":
                    print(f"\n### {r.format} × {r.template} · {c.case}: {c.reason}\n{c.details}",
                          file=sys.stderr)
    return 1 if any(not r.ok for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
