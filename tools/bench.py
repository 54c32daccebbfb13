"""Side-by-side benchmark of chatgrammar's loss masks, in one process, as ratios.

Run from the repository root::

    python tools/bench.py                 # full run; prints the table, writes docs/performance.md
    python tools/bench.py --quick --no-write

Workload: Kimi-K2 and Kimi-K3 conversations (1-8 user/assistant exchanges, lognormal turn
lengths: user median ~55 tokens, assistant median ~200, some tool calls, K3 reasoning; ~3.7k
tokens per sample on average) rendered with the real templates (``chatgrammar.render``, exactly as
transformers renders them) and tokenised with tiktoken into lists of ints, as trainers pass them.
The tokenizer is Qwen2.5's byte-level BPE ranks with Kimi's special ids (as
``tests/kimi_tokenizers.py`` builds them; the bench does not import from ``tests/``).

Contenders, each timed best-of-N, interleaved round-robin so machine noise hits all alike:

- ``ours``: ``Format.loss_mask(ids, tok)`` per sample (list in, list out), and
  ``Format.loss_masks(batch, tok)``;
- ``scanner``: a straightforward per-token Python scanner with NVIDIA Model-Optimizer's
  semantics (:func:`scan_k2`, :func:`scan_k3`);
- ``numpy bound``: specials located with ``np.isin``, then a Python loop over markers only
  (:func:`numpy_k2`, :func:`numpy_k3`): a lower bound for any marker-driven approach;
- ``regex``: one whole-turn ``re.finditer`` over the rendered text (text mode's baseline).

The numbers are throughputs (Mtok/s, Mchar/s) and ratios measured in the same run.
"""
from __future__ import annotations

import gc
import json
import math
import os
import platform
import random
import re
import struct
import time
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "data"
QWEN_TIKTOKEN = DATA / "tokenizers" / "Qwen-Qwen2.5" / "qwen.tiktoken"
TEMPLATES = {
    "kimi-k2": DATA / "templates" / "moonshotai-Kimi-K2.jinja",
    "kimi-k3": DATA / "templates" / "moonshotai-Kimi-K3.jinja",
}
# Kimi's pre-tokenizer is GPT-4-like (digits in runs of 1-3); the split does not matter here.
PAT_STR = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"""
           r""" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
# Kimi's real special ids (K2: tokenizer_config.json added_tokens_decoder; K3: its reference
# encoder) on Qwen2.5's byte-level BPE ranks, as tests/kimi_tokenizers.py builds them.
KIMI_K2_SPECIALS = {
    "[BOS]": 163584, "[EOS]": 163585, "<|im_end|>": 163586, "<|im_user|>": 163587,
    "<|im_assistant|>": 163588, "<|start_header_id|>": 163590, "<|end_header_id|>": 163591,
    "[EOT]": 163593, "<|im_system|>": 163594, "<|tool_calls_section_begin|>": 163595,
    "<|tool_calls_section_end|>": 163596, "<|tool_call_begin|>": 163597,
    "<|tool_call_argument_begin|>": 163598, "<|tool_call_end|>": 163599,
    "<|im_middle|>": 163601, "<|media_start|>": 163602, "<|media_content|>": 163603,
    "<|media_end|>": 163604, "<|media_pad|>": 163605, "<think>": 163606, "</think>": 163607,
}
KIMI_K3_SPECIALS = {"<|end_of_msg|>": 163586, "<|open|>": 163587, "<|close|>": 163588,
                    "<|sep|>": 163589}


@lru_cache(maxsize=None)
def kimi_encoding(version: str = "kimi-k2", ranks: str | None = None):
    """A ``tiktoken.Encoding`` with Qwen2.5's BPE ranks and Kimi's special ids (every other id
    of 163584..163839 is ``<|reserved_token_N|>``, as in Kimi's tokenizer)."""
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe

    specials = dict(KIMI_K2_SPECIALS if version == "kimi-k2" else KIMI_K3_SPECIALS)
    used = set(specials.values())
    specials.update({f"<|reserved_token_{i}|>": i for i in range(163584, 163840) if i not in used})
    return tiktoken.Encoding(name=f"{version}-bench", pat_str=PAT_STR,
                             mergeable_ranks=load_tiktoken_bpe(str(ranks or QWEN_TIKTOKEN)),
                             special_tokens=specials)


_WORDS = (
    "the of and to in is that for it as with was on be by this are or from at an which but "
    "not have has had were can all their there been if more when will would who so no one "
    "model data training loss mask token tokens sequence batch gradient learning rate layer "
    "attention head value key query output input function return result error check test "
    "python numpy array list dict string int float None True False class def import self "
    "because however therefore first second finally example consider suppose answer question "
    "time year people way day man thing woman life child world school state family student "
    "group country problem hand part place case week company system program number night point "
    "home water room mother area money story fact month lot right study book eye job word "
    "business issue side kind head house service friend father power hour game line end member "
    "law car city community name president team minute idea kid body information back parent "
    "face others level office door health person art war history party morning reason research "
    "girl guy moment air teacher force education 数据 模型 训练 你好 世界 こんにちは ありがとう "
    "naïve café résumé Zürich São"
).split()
_PUNCT = [",", ".", ".", ":", ";", "?", "!", " -", " (see", ")", "\n", "\n\n", "\n- ", " `x`", " 42",
          " 3.14", " 2024", " #"]


def _text(rng: random.Random, n_tokens: int) -> str:
    """Pseudo-prose of roughly ``n_tokens`` BPE tokens (about 1.3 tokens per word)."""
    n_words = max(1, int(n_tokens / 1.3))
    out = []
    for i in range(n_words):
        w = rng.choice(_WORDS)
        out.append(w if i == 0 or out[-1].endswith("\n") else " " + w)
        if rng.random() < 0.12:
            out.append(rng.choice(_PUNCT))
    return "".join(out).strip() or "ok"


def _lognormal(rng: random.Random, median: float, sigma: float, cap: int) -> int:
    return max(1, min(cap, int(round(median * math.exp(rng.gauss(0.0, sigma))))))


USER_MEDIAN, ASSISTANT_MEDIAN, SIGMA, CAP = 55, 200, 1.5, 16_000


def make_messages(version: str, rng: random.Random) -> list[dict]:
    """One conversation: 1-8 user/assistant exchanges with lognormal turn lengths; some
    assistant turns call a tool (followed by the tool result); K3 assistants carry reasoning."""
    msgs: list[dict] = []
    if rng.random() < 0.5:
        msgs.append({"role": "system", "content": _text(rng, _lognormal(rng, 30, 0.6, 400))})
    for k in range(rng.randint(1, 8)):
        msgs.append({"role": "user", "content": _text(rng, _lognormal(rng, USER_MEDIAN, SIGMA,
                                                                        CAP))})
        n = _lognormal(rng, ASSISTANT_MEDIAN, SIGMA, CAP)
        if rng.random() < 0.15:  # a tool call, its result, then the answer
            call = {"id": f"call{rng.randrange(10**5):05d}", "type": "function",
                    "function": {"name": "search",
                                 "arguments": {"query": _text(rng, 8), "k": rng.randint(1, 9)}}}
            msgs.append({"role": "assistant", "content": _text(rng, 12), "tool_calls": [call]})
            msgs.append({"role": "tool", "tool_call_id": call["id"], "name": "search",
                         "content": _text(rng, _lognormal(rng, 80, 0.8, 2000))})
        if version == "kimi-k3" and rng.random() < 0.8:  # reasoning takes ~40% of the output
            m = {"role": "assistant", "content": _text(rng, max(1, n - 2 * n // 5)),
                 "reasoning_content": _text(rng, max(1, 2 * n // 5))}
        else:
            m = {"role": "assistant", "content": _text(rng, n)}
        msgs.append(m)
    return msgs


def render(version: str, messages: list[dict]) -> str:
    """The conversation rendered with the real template (chatgrammar.render, as transformers)."""
    from chatgrammar.render import render_chat

    return render_chat(TEMPLATES[version].read_text(encoding="utf-8"), messages)


def workload(version: str, n: int, seed: int = 0) -> tuple[list[str], list[list[int]]]:
    """``n`` rendered samples and their token ids (lists of int, as trainers pass them)."""
    rng = random.Random(f"{version}:{seed}")
    enc = kimi_encoding(version)
    texts = [render(version, make_messages(version, rng)) for _ in range(n)]
    ids = [enc.encode(t, allowed_special="all") for t in texts]
    return texts, ids


# ----------------------------------------------------------------------------- baselines

def scan_k2(ids, *, im_assistant=163588, im_middle=163601, im_end=163586) -> list[int]:
    """Model-Optimizer-style K2 recovery, one token at a time: walk to ``<|im_assistant|>``,
    then to ``<|im_middle|>``, and mark every token until ``<|im_end|>`` (both excluded)."""
    n = len(ids)
    mask = [0] * n
    i = 0
    while i < n:
        if ids[i] == im_assistant:
            j = i + 1
            while j < n and ids[j] != im_middle:
                j += 1
            j += 1
            while j < n and ids[j] != im_end:
                mask[j] = 1
                j += 1
            i = j
        i += 1
    return mask


_K3_ROLE = re.compile(r'\s*message\b[^<]*?\brole="([^"]*)"')


def scan_k3(ids, decode, *, open_=163587, close=163588, sep=163589) -> list[int]:
    """Model-Optimizer-style K3 recovery, one token at a time: at each ``<|open|>`` walk to
    ``<|sep|>`` and decode the header; for an assistant message, count depth (``<|open|>`` +1,
    ``<|close|>`` -1) and mark every token up to the matching ``<|close|>`` (excluded)."""
    n = len(ids)
    mask = [0] * n
    i = 0
    while i < n:
        if ids[i] == open_:
            j = i + 1
            while j < n and ids[j] != sep:
                j += 1
            m = _K3_ROLE.match(decode(ids[i + 1:j]))
            if m is not None and m.group(1) == "assistant":
                depth = 1
                k = j + 1
                while k < n:
                    t = ids[k]
                    if t == open_:
                        depth += 1
                    elif t == close:
                        depth -= 1
                        if depth == 0:
                            break
                    mask[k] = 1
                    k += 1
                i = k
            else:
                i = j
        i += 1
    return mask


def _ids_array(ids) -> "np.ndarray":
    """The fastest list→int64 conversion we know (shared by the numpy bound)."""
    import numpy as np

    return np.frombuffer(struct.pack(f"{len(ids)}q", *ids), dtype=np.int64)


def _to_list(n: int, spans) -> list[int]:
    m = bytearray(n)
    for a, b in spans:
        m[a:b] = b"\x01" * (b - a)
    return list(m)


def numpy_k2(ids, *, im_assistant=163588, im_middle=163601, im_end=163586) -> list[int]:
    """Lower bound for K2: specials located with ``np.isin``; a Python loop over them only."""
    import numpy as np

    arr = _ids_array(ids)
    pos = np.flatnonzero(np.isin(arr, (im_assistant, im_middle, im_end)))
    spans = []
    state = 0
    start = 0
    for p, t in zip(pos.tolist(), arr[pos].tolist()):
        if t == im_assistant:
            state = 1
        elif t == im_middle:
            if state == 1:
                state, start = 2, p + 1
        elif state == 2:  # im_end
            spans.append((start, p))
            state = 0
        else:
            state = 0
    if state == 2:
        spans.append((start, len(ids)))
    return _to_list(len(ids), spans)


def numpy_k3(ids, decode, *, open_=163587, close=163588, sep=163589) -> list[int]:
    """Lower bound for K3: specials located with ``np.isin``; a Python loop over them only
    (headers decoded only for top-level elements)."""
    import numpy as np

    arr = _ids_array(ids)
    pos = np.flatnonzero(np.isin(arr, (open_, close, sep)))
    kinds = arr[pos].tolist()
    pl = pos.tolist()
    spans = []
    depth = 0
    train_from = -1
    i, m = 0, len(pl)
    while i < m:
        k = kinds[i]
        if k == open_:
            if depth == 0 and i + 1 < m and kinds[i + 1] == sep:
                h = _K3_ROLE.match(decode(ids[pl[i] + 1:pl[i + 1]]))
                if h is not None and h.group(1) == "assistant":
                    train_from = pl[i + 1] + 1
            depth += 1
        elif k == close:
            depth -= 1
            if depth == 0 and train_from >= 0:
                spans.append((train_from, pl[i]))
                train_from = -1
        i += 1
    return _to_list(len(ids), spans)


REGEX = {
    "kimi-k2": re.compile(r"<\|im_assistant\|>[^<]*<\|im_middle\|>(.*?)<\|im_end\|>", re.S),
    "kimi-k3": re.compile(r'<\|open\|>message role="assistant"<\|sep\|>(.*?)'
                          r"<\|close\|>message<\|sep\|><\|end_of_msg\|>", re.S),
}


def regex_spans(version: str, text: str) -> list[tuple[int, int]]:
    """Text-mode baseline: one whole-turn ``re.finditer`` (what SpecForge-style loaders do)."""
    return [m.span(1) for m in REGEX[version].finditer(text)]


# ----------------------------------------------------------------------------- timing

def race(contenders: dict, items, rounds: int = 5) -> dict[str, float]:
    """Best-of-``rounds`` seconds for each contender over ``items``, interleaved round-robin."""
    best = {k: float("inf") for k in contenders}
    for _ in range(rounds):
        for name, fn in contenders.items():
            gc.collect()
            t0 = time.perf_counter()
            for x in items:
                fn(x)
            best[name] = min(best[name], time.perf_counter() - t0)
    return best


def race_calls(contenders: dict, rounds: int = 5) -> dict[str, float]:
    """Best-of-``rounds`` seconds for zero-argument callables, interleaved round-robin."""
    best = {k: float("inf") for k in contenders}
    for _ in range(rounds):
        for name, fn in contenders.items():
            gc.collect()
            t0 = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t0)
    return best


def machine() -> dict[str, str]:
    """Where the numbers were measured."""
    import numpy as np

    cpu = platform.processor() or "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info = {"cpu": cpu, "cores": str(os.cpu_count()),
            "python": platform.python_version(), "numpy": np.__version__,
            "platform": platform.platform()}
    from chatgrammar import fastpath

    info["C accelerator"] = ("built (chatgrammar._speedups)" if fastpath._speedups is not None
                             else "not built or disabled (pure numpy path)")
    for mod in ("lark", "tiktoken", "transformers", "tokenizers"):
        try:
            info[mod] = __import__(mod).__version__
        except Exception:
            pass
    return info


# ----------------------------------------------------------------------------- ChatML part

QWEN_ADDED = (  # (id, content, special): Qwen2.5/Qwen3 tokenizer_config.json added tokens
    (151643, "<|endoftext|>", True), (151644, "<|im_start|>", True), (151645, "<|im_end|>", True),
    (151646, "<|object_ref_start|>", True), (151647, "<|object_ref_end|>", True),
    (151648, "<|box_start|>", True), (151649, "<|box_end|>", True),
    (151650, "<|quad_start|>", True), (151651, "<|quad_end|>", True),
    (151652, "<|vision_start|>", True), (151653, "<|vision_end|>", True),
    (151654, "<|vision_pad|>", True), (151655, "<|image_pad|>", True),
    (151656, "<|video_pad|>", True), (151657, "<tool_call>", False), (151658, "</tool_call>", False),
    (151659, "<|fim_prefix|>", False), (151660, "<|fim_middle|>", False),
    (151661, "<|fim_suffix|>", False), (151662, "<|fim_pad|>", False),
    (151663, "<|repo_name|>", False), (151664, "<|file_sep|>", False),
    (151665, "<tool_response>", False), (151666, "</tool_response>", False),
    (151667, "<think>", False), (151668, "</think>", False),
)
QWEN_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"""
              r""" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")


@lru_cache(maxsize=None)
def qwen_fast_tokenizer():
    """Qwen2.5's tokenizer as a transformers fast tokenizer, offline (as tests/tokenizers.py)."""
    from tokenizers import AddedToken, normalizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    backend = TikTokenConverter(vocab_file=str(QWEN_TIKTOKEN), pattern=QWEN_SPLIT).converted()
    backend.normalizer = normalizers.NFC()
    for tid, content, special in QWEN_ADDED:
        tok = AddedToken(content, normalized=False, special=special)
        (backend.add_special_tokens if special else backend.add_tokens)([tok])
        assert backend.token_to_id(content) == tid
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>")


TRL_QWEN = DATA / "templates" / "generation" / "trl-qwen2_5_training.jinja"


def chatml_messages(rng: random.Random) -> list[dict]:
    msgs = make_messages("kimi-k2", rng)
    for m in msgs:  # the Qwen2.5 template prints arguments with tojson: dicts are fine
        m.pop("name", None)
    return msgs


# ----------------------------------------------------------------------------- sections

def _mtok(n: int, seconds: float) -> float:
    return n / seconds / 1e6


def bench_loss_mask(version: str, n_samples: int, rounds: int) -> dict:
    import chatgrammar as cg

    texts, ids = workload(version, n_samples)
    enc = kimi_encoding(version)
    fmt = cg.load_format(version)
    if version == "kimi-k2":
        scanner, bound = scan_k2, numpy_k2
    else:
        def scanner(x):
            return scan_k3(x, enc.decode)

        def bound(x):
            return numpy_k3(x, enc.decode)
    for x in ids:  # all contenders agree on every sample before anything is timed
        ours = fmt.loss_mask(x, enc)
        if ours != scanner(x) or ours != bound(x):
            raise SystemExit(f"{version}: contenders disagree on a sample")
    if fmt.loss_masks(ids, enc) != [fmt.loss_mask(x, enc) for x in ids]:
        raise SystemExit(f"{version}: loss_masks disagrees with loss_mask")
    ntok = sum(map(len, ids))
    from chatgrammar import fastpath

    accel = fastpath._speedups

    def ours_pure(x):  # the same call where the C accelerator is not built
        fastpath._speedups = None
        try:
            return fmt.loss_mask(x, enc)
        finally:
            fastpath._speedups = accel

    if [ours_pure(x) for x in ids] != [fmt.loss_mask(x, enc) for x in ids]:
        raise SystemExit(f"{version}: the pure path disagrees with the accelerated one")
    per = race({"ours": lambda x: fmt.loss_mask(x, enc), "ours pure": ours_pure,
                "scanner": scanner, "numpy bound": bound}, ids, rounds)
    batch = race_calls({"ours batch": lambda: fmt.loss_masks(ids, enc)}, rounds)
    # Loaders that already hold arrays (datasets' numpy format, torch) skip the list→array
    # conversion: numpy in, numpy out.
    import numpy as np

    arrs = [np.asarray(x, dtype=np.int64) for x in ids]
    per_np = race({"ours numpy": lambda a: fmt.loss_mask(a, enc)}, arrs, rounds)
    # Linear: one ~1M-token sequence (samples back to back) against the per-sample cost.
    big: list[int] = []
    k = 0
    while len(big) < 1_000_000:
        big += ids[k % len(ids)]
        k += 1
    if fmt.loss_mask(big, enc) != scanner(big):
        raise SystemExit(f"{version}: the 1M-token sequence masks disagree")
    long = race_calls({"ours 1M": lambda: fmt.loss_mask(big, enc)}, max(3, rounds))
    # Text mode against one whole-turn regex over the same text.
    nchar = sum(map(len, texts))
    text = race({"ours text": lambda t: fmt.parse(t).spans(),
                 "regex": lambda t: regex_spans(version, t)}, texts, rounds)
    return {
        "samples": len(ids), "tokens": ntok, "chars": nchar, "big_tokens": len(big),
        "ours": _mtok(ntok, per["ours"]), "ours_batch": _mtok(ntok, batch["ours batch"]),
        "ours_pure": _mtok(ntok, per["ours pure"]), "accelerated": accel is not None,
        "ours_numpy": _mtok(ntok, per_np["ours numpy"]),
        "scanner": _mtok(ntok, per["scanner"]), "numpy": _mtok(ntok, per["numpy bound"]),
        "ours_1m": _mtok(len(big), long["ours 1M"]),
        "text_ours": nchar / text["ours text"] / 1e6, "text_regex": nchar / text["regex"] / 1e6,
    }


def bench_chatml(n_samples: int, rounds: int) -> dict | None:
    import chatgrammar as cg

    if "chatml" not in cg.list_formats():
        return None
    import transformers

    transformers.logging.set_verbosity_error()
    from chatgrammar.render import render_chat

    tok = qwen_fast_tokenizer()
    tpl = TRL_QWEN.read_text(encoding="utf-8")
    fmt = cg.load_format("chatml")
    rng = random.Random("chatml:0")
    convs = [chatml_messages(rng) for _ in range(n_samples)]
    ids = [tok.apply_chat_template(c, chat_template=tpl, tokenize=True, return_dict=True)
           ["input_ids"] for c in convs]
    ours_ids = [tok(render_chat(tpl, c), add_special_tokens=False)["input_ids"] for c in convs]
    if ours_ids != ids:
        raise SystemExit("chatml: render + tokenize differs from apply_chat_template")
    ntok = sum(map(len, ids))

    def hf_plain():
        for c in convs:
            tok.apply_chat_template(c, chat_template=tpl, tokenize=True, return_dict=True)

    def hf_mask():
        for c in convs:
            tok.apply_chat_template(c, chat_template=tpl, tokenize=True, return_dict=True,
                                    return_assistant_tokens_mask=True)

    def ours_full():
        for c in convs:
            x = tok(render_chat(tpl, c), add_special_tokens=False)["input_ids"]
            fmt.loss_mask(x, tok)

    def ours_mask():
        for x in ids:
            fmt.loss_mask(x, tok)

    t = race_calls({"hf": hf_plain, "hf+mask": hf_mask, "ours": ours_full,
                    "ours mask": ours_mask}, rounds)
    return {"samples": n_samples, "tokens": ntok,
            "hf_base_us": t["hf"] / n_samples * 1e6,
            "hf_added_us": (t["hf+mask"] - t["hf"]) / n_samples * 1e6,
            "ours_total_us": t["ours"] / n_samples * 1e6,
            "ours_added_us": t["ours mask"] / n_samples * 1e6}


_COMPILE_SNIPPET = """
import json, os, time
t0 = time.perf_counter()
import chatgrammar as cg
t1 = time.perf_counter()
names = cg.list_formats()
for n in names:
    cg.load_format(n)
t2 = time.perf_counter()
print(json.dumps({"import": t1 - t0, "load": t2 - t1, "formats": len(names)}))
"""


def bench_compile(rounds: int = 3) -> dict:
    """Cold: every bundled format compiled in a fresh process with an empty compile cache.
    Cached: the same in a fresh process once the persistent cache is filled."""
    import subprocess
    import sys
    import tempfile

    def run(cache_dir: str) -> dict:
        env = dict(os.environ, CHATGRAMMAR_CACHE_DIR=cache_dir, PYTHONPATH=str(ROOT))
        out = subprocess.run([sys.executable, "-c", _COMPILE_SNIPPET], env=env, cwd=str(ROOT),
                             capture_output=True, text=True, check=True)
        return json.loads(out.stdout.strip().splitlines()[-1])

    cold, warm = [], []
    for _ in range(rounds):
        with tempfile.TemporaryDirectory(prefix="cg-bench-cache-") as d:
            cold.append(run(d))
            warm.append(run(d))
    return {"formats": cold[0]["formats"], "cold_s": min(c["load"] for c in cold),
            "cached_s": min(w["load"] for w in warm),
            "import_s": min(w["import"] for w in warm)}


# ----------------------------------------------------------------------------- report

def report(results: dict, info: dict, args) -> str:
    lines = ["# Performance", "",
             "Measured by `tools/bench.py` (all contenders in one process, interleaved, "
             f"best of {args.rounds} rounds). Regenerate with `python tools/bench.py`.", "",
             "## Machine", ""]
    lines += [f"- {k}: {v}" for k, v in info.items()]
    lines += ["", "## Loss masks from token ids (list of int in, list of int out)", "",
              "| format | samples | tokens/sample | ours Mtok/s | ours batch Mtok/s | scanner "
              "Mtok/s | numpy bound Mtok/s | ours / scanner (target ≥ 2) | batch / scanner | "
              "bound / ours (target ≤ 4) |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for v in ("kimi-k2", "kimi-k3"):
        r = results[v]
        lines.append(f"| {v} | {r['samples']} | {r['tokens'] / r['samples']:.0f} | "
                     f"{r['ours']:.1f} | {r['ours_batch']:.1f} | {r['scanner']:.1f} | "
                     f"{r['numpy']:.1f} | {r['ours'] / r['scanner']:.2f} | "
                     f"{r['ours_batch'] / r['scanner']:.2f} | {r['numpy'] / r['ours']:.2f} |")
    lines += ["", "Same workload and call without the C accelerator (`chatgrammar._speedups`, built by "
              "`pip install` where a C compiler is present; `CHATGRAMMAR_PURE=1` turns it off): "
              "what a machine without a compiler gets.", "",
              "| format | ours pure Mtok/s | ours pure / scanner |", "|---|---|---|"]
    for v in ("kimi-k2", "kimi-k3"):
        r = results[v]
        pure = f"{r['ours_pure']:.1f} | {r['ours_pure'] / r['scanner']:.2f}"
        if not r["accelerated"]:
            pure += " (accelerator not built: same as ours)"
        lines.append(f"| {v} | {pure} |")
    lines += ["", "Same workload with numpy arrays in (numpy out): no list→array conversion.", "",
              "| format | ours (numpy in) Mtok/s | ours (numpy in) / scanner (list in) |",
              "|---|---|---|"]
    for v in ("kimi-k2", "kimi-k3"):
        r = results[v]
        lines.append(f"| {v} | {r['ours_numpy']:.1f} | {r['ours_numpy'] / r['scanner']:.2f} |")
    lines += ["", "## Linear cost: one sequence of ~1M tokens", "",
              "| format | tokens | ours Mtok/s | per-token cost vs samples (≤ 1.5) |",
              "|---|---|---|---|"]
    for v in ("kimi-k2", "kimi-k3"):
        r = results[v]
        lines.append(f"| {v} | {r['big_tokens']} | {r['ours_1m']:.1f} | "
                     f"{r['ours'] / r['ours_1m']:.2f} |")
    lines += ["", "## Text mode: `fmt.parse(text).spans()` against one whole-turn `re.finditer`",
              "", "| format | ours Mchar/s | regex Mchar/s | ours / regex (≥ 0.5) |",
              "|---|---|---|---|"]
    for v in ("kimi-k2", "kimi-k3"):
        r = results[v]
        lines.append(f"| {v} | {r['text_ours']:.1f} | {r['text_regex']:.1f} | "
                     f"{r['text_ours'] / r['text_regex']:.2f} |")
    c = results.get("chatml")
    lines += ["", "## Messages → ids + mask (`chatml`, Qwen2.5 fast tokenizer, TRL Qwen2.5 "
              "training template)", ""]
    if c is None:
        lines.append("Skipped: the `chatml` format is not bundled yet.")
    else:
        lines += ["| samples | tokens/sample | transformers render+tokenize µs | "
                  "+ `return_assistant_tokens_mask` adds µs | ours render+tokenize+mask µs | "
                  "our mask step adds µs | ours added / transformers added (≤ 0.5) |",
                  "|---|---|---|---|---|---|---|",
                  f"| {c['samples']} | {c['tokens'] / c['samples']:.0f} | {c['hf_base_us']:.0f} | "
                  f"{c['hf_added_us']:.0f} | {c['ours_total_us']:.0f} | {c['ours_added_us']:.0f} "
                  f"| {c['ours_added_us'] / c['hf_added_us']:.3f} |"]
    k = results["compile"]
    lines += ["", "## Compile", "",
              "| formats | cold load of all (s, < 1) | cached load of all (s, < 0.05) | "
              "`import chatgrammar` (s) |", "|---|---|---|---|",
              f"| {k['formats']} | {k['cold_s']:.3f} | {k['cached_s']:.4f} | {k['import_s']:.3f} |"]
    lines += ["", "## Targets", "", "| target | measured | met |", "|---|---|---|"]
    for label, value, ok in targets(results):
        lines.append(f"| {label} | {value} | {'yes' if ok else '**no**'} |")
    lines += ["", "## Method", "", METHOD, "", "## Where the time goes", "", NOTES]
    return "\n".join(lines) + "\n"


def targets(results: dict) -> list[tuple[str, str, bool]]:
    """The issue's targets against this run's numbers: (target, measured, met)."""
    out = []
    for v in ("kimi-k2", "kimi-k3"):
        r = results[v]
        x = r["ours"] / r["scanner"]
        out.append((f"{v}: `loss_mask` per sample ≥ 2× the scanner (list in, list out)",
                    f"{x:.2f}×", x >= 2))
        x = r["ours_batch"] / r["scanner"]
        out.append((f"{v}: `loss_masks` batch ≥ 2× the scanner (list in, list out)",
                    f"{x:.2f}×", x >= 2))
        x = r["ours_numpy"] / r["scanner"]
        out.append((f"{v}: `loss_mask` per sample, numpy in, ≥ 2× the scanner", f"{x:.2f}×",
                    x >= 2))
        x = r["numpy"] / r["ours"]
        out.append((f"{v}: within 4× of the numpy lower bound", f"{x:.2f}×", x <= 4))
        x = r["ours"] / r["ours_1m"]
        out.append((f"{v}: per-token cost on 1M tokens ≤ 1.5× the per-sample cost",
                    f"{x:.2f}×", x <= 1.5))
        x = r["text_ours"] / r["text_regex"]
        out.append((f"{v}: text mode ≥ 0.5× one whole-turn regex", f"{x:.2f}×", x >= 0.5))
    c = results.get("chatml")
    if c is not None:
        x = c["ours_added_us"] / c["hf_added_us"]
        out.append(("chatml: our mask step ≤ 0.5× what `return_assistant_tokens_mask` adds",
                    f"{x:.2f}×", x <= 0.5))
    k = results["compile"]
    out.append(("all bundled formats, cold load < 1 s", f"{k['cold_s']:.3f} s", k["cold_s"] < 1))
    out.append(("all bundled formats, cached load < 50 ms", f"{1000 * k['cached_s']:.1f} ms",
                k["cached_s"] < 0.05))
    return out


NOTES = """- **List input.** A Python list of ints must be read one object at a time before
  anything vectorised can look at it. The C accelerator (`chatgrammar/_speedups.c`) does that
  read (~2.5 ns per token), finds the markers in the resulting int64 array and builds the list
  that comes back (~1 ns per token); without it, `struct.pack` (the fastest pure way we found;
  `np.asarray` is ~2× slower) costs ~9 ns per token and building the list ~2 ns. The scanner
  spends ~33-47 ns per token. What is left per sample (walking the memoised automaton, looking
  up item programs, filling spans, numpy calls on marker-sized arrays) is a few tens of
  microseconds of Python, so per-sample calls gain most from batching (`loss_masks`) and from
  arrays in (numpy or torch, as `datasets` with a numpy format or a collator hands them over).
- **The numpy bound** converts with `struct.pack`, as a pure-Python program would; ours with the
  accelerator can beat it (bound / ours < 1).
- **What is memoised** (`chatgrammar/fastpath.py`): LALR transitions per stack configuration and
  symbol (4 symbols per lookup), and each top-level item's turns, keyed by its marker kinds,
  content-run presence, header ids and anything else the parse read; a new item shape is parsed
  once by the full pipeline. Masks are always exactly `parse_ids(...).mask()`: anything unusual
  (truncation, errors, lenient repairs, `last_turn_only`) takes the full pipeline.
- **Text mode** rebuilds known items from templates (fresh objects with this text's positions);
  lexing the markers with one regex pass is most of what remains.
- Numbers move by ±20% between runs on a shared 2-core machine; ratios measured in the same run
  (interleaved rounds, best of N) are the stable part."""


METHOD = """\
- Workload: `make_messages` in `tools/bench.py`: 1-8 exchanges, user turns lognormal (median 55
  tokens), assistant turns lognormal (median 200), σ = 1.5 (capped at 16k tokens), a system
  message half the time, a tool call (and its result) in 15% of exchanges, K3 reasoning in 80% of
  assistant turns. Rendered with `tests/data/templates/moonshotai-Kimi-K2.jinja` /
  `moonshotai-Kimi-K3.jinja` through `chatgrammar.render` (byte-identical to transformers),
  tokenised with tiktoken (Qwen2.5 ranks + Kimi's special ids).
- Every contender's mask is checked equal to ours on every sample (and on the 1M-token
  sequence) before timing. That pass also warms chatgrammar's memo (`chatgrammar/fastpath.py`),
  as the first few hundred samples of any real run do: this workload has 5 (K2) and 7 (K3)
  distinct item shapes, each parsed once by the full pipeline; timed rounds are warm.
- The scanners walk the list one token at a time (K2: `<|im_assistant|>` → `<|im_middle|>` → mark
  to `<|im_end|>`; K3: `<|open|>` … `<|sep|>`, decode the header, count depth to the matching
  `<|close|>`). The numpy bound converts the list with `struct.pack` (the fastest conversion we
  found), finds the specials with `np.isin` and loops over markers only.
- Converting a Python list of ints to an array with `struct` costs ~9 ns per token and is part of
  every pure contender that uses numpy: it is most of the numpy bound's time. "Ours pure" is the
  same `loss_mask` call with the C accelerator switched off (a machine without a compiler).
- Text mode times `fmt.parse(text).spans()` (a typed parse, strict) against a regex that only
  extracts the assistant bodies (no validation).
- ChatML: "adds" is the time a mask step adds on top of render + tokenize: for transformers the
  difference between `apply_chat_template(..., return_assistant_tokens_mask=True)` and without
  it; for us, `fmt.loss_mask(ids, tok)` alone.
- Compile: fresh processes (`CHATGRAMMAR_CACHE_DIR` pointing at an empty directory, then the same
  directory again); the time excludes interpreter start-up and `import chatgrammar`.
"""


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=400, help="samples per format (default 400)")
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds, best kept (default 5)")
    ap.add_argument("--quick", action="store_true", help="60 samples, 3 rounds")
    ap.add_argument("--no-write", action="store_true", help="do not write docs/performance.md")
    ap.add_argument("--out", default=str(ROOT / "docs" / "performance.md"))
    args = ap.parse_args(argv)
    if args.quick:
        args.samples, args.rounds = 60, 3
    results: dict = {}
    for v in ("kimi-k2", "kimi-k3"):
        results[v] = bench_loss_mask(v, args.samples, args.rounds)
        print(v, json.dumps({k: round(x, 3) if isinstance(x, float) else x
                             for k, x in results[v].items()}), flush=True)
    results["chatml"] = bench_chatml(max(20, args.samples // 4), args.rounds)
    print("chatml", results["chatml"], flush=True)
    results["compile"] = bench_compile()
    print("compile", results["compile"], flush=True)
    text = report(results, machine(), args)
    print(text)
    if not args.no_write:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    import sys

    sys.path.insert(0, str(ROOT))
    sys.exit(main())
