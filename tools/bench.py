"""Side-by-side benchmark of chatgrammar's loss masks, in one process, as ratios.

Run from the repository root::

    python tools/bench.py                 # full run; prints the table, writes docs/performance.md
    python tools/bench.py --quick --no-write

Workload: Kimi-K2 and Kimi-K3 conversations (1-8 user/assistant exchanges, lognormal turn
lengths: user median ~55 tokens, assistant median ~200, some tool calls, K3 reasoning; ~3.7k
tokens per sample on average) rendered with the real templates (``chatgrammar.conformance.render``, exactly as
transformers renders them) and tokenised with tiktoken into lists of ints, as trainers pass them.
The tokenizer is Qwen2.5's byte-level BPE ranks with Kimi's special ids (as
``tests/kimi_tokenizers.py`` builds them; the bench does not import from ``tests/``).

Every input class of issue 12 (whole, truncated by ``max_length=2048``, ``last_turn_only``,
lenient, packed 8 per sequence, one ~1M-token sequence cut mid-turn, numpy in, no accelerator)
is timed on its FIRST PASS over fresh data (:func:`bench_classes`), against a straightforward
per-token scanner with NVIDIA Model-Optimizer's semantics (:func:`scan_k2`, :func:`scan_k3`);
text mode against one whole-turn ``re.finditer``. Ratios are measured on the same inputs in the
same process.
"""
from __future__ import annotations

import gc
import json
import math
import os
import platform
import random
import re
import statistics
import struct
import zlib
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

    specials = dict(KIMI_K2_SPECIALS if version == "kimi-k2" else KIMI_K3_SPECIALS)
    used = set(specials.values())
    specials.update({f"<|reserved_token_{i}|>": i for i in range(163584, 163840) if i not in used})
    return tiktoken.Encoding(name=f"{version}-bench", pat_str=PAT_STR,
                             mergeable_ranks=_ranks(str(ranks or QWEN_TIKTOKEN)),
                             special_tokens=specials)


@lru_cache(maxsize=1)
def _ranks(path: str) -> dict:
    """The BPE ranks file, read once for both versions' encodings (read-only)."""
    from tiktoken.load import load_tiktoken_bpe

    return load_tiktoken_bpe(path)


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
    """The conversation rendered with the real template (chatgrammar.conformance.render, as transformers)."""
    from chatgrammar.conformance.render import render_chat

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
    # (ChatML: the assistant line ends its header by a literal, "\n")
    "chatml": re.compile(r"<\|im_start\|>assistant\n(.*?)<\|im_end\|>", re.S),
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
            "platform": platform.platform(), "load average": _loadavg()}
    from chatgrammar.runtime import fastpath

    info["C accelerator"] = ("built (chatgrammar.runtime._speedups)" if fastpath._speedups is not None
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


# ----------------------------------------------------------------------------- input classes

MAX_LENGTH = 2048
PACK = 8
CLASSES = ("whole", "truncated", "last_turn_only", "lenient", "packed", "1M cut", "numpy in",
           "whole, pure", "never repeating")
CLASS_LABEL = {
    "whole": "whole samples",
    "truncated": f"truncated by `max_length={MAX_LENGTH}` (most cut mid-turn)",
    "last_turn_only": "`last_turn_only` policy",
    "lenient": "lenient mode (`strict=False`)",
    "packed": f"packed, {PACK} samples per sequence",
    "1M cut": "one ~1M-token sequence cut mid-turn",
    "numpy in": "whole samples, numpy in (numpy out)",
    "whole, pure": "whole samples without the C accelerator",
    "never repeating": "whole samples, a new tool name in every assistant turn (no target)",
}


def last_span_only(mask: list[int]) -> list[int]:
    """A scanner mask reduced to its last trained run (``last_turn_only`` for the scanners,
    whose assistant turns train one contiguous run each)."""
    n = len(mask)
    j = n - 1
    while j >= 0 and not mask[j]:
        j -= 1
    out = [0] * n
    while j >= 0 and mask[j]:
        out[j] = 1
        j -= 1
    return out


def cut_mid_turn(big: list[int], version: str, target: int = 1_000_000) -> list[int]:
    """``big`` cut near ``target`` tokens inside an assistant turn's content."""
    mask = scan_k2(big) if version == "kimi-k2" else None
    if mask is None:
        enc = kimi_encoding(version)
        mask = scan_k3(big, enc.decode)
    for k in range(min(target, len(big) - 1), 0, -1):
        if mask[k - 1] and mask[k]:
            return big[:k]
    return big[:target]


def never_repeating(version: str, n: int, seed) -> list[list[int]]:
    """``n`` whole samples in which every assistant turn calls a tool under a name no other turn
    has. Neither format's item key holds the name (kimi-k2's tool-call header is text nothing
    reads, keyed by its length class: ``lexers.value_free_openers``; kimi-k3's XTML keys do
    not hold it), so the items repeat as usual: this class checks that a new name costs no
    learning parse."""
    rng = random.Random(f"{version}:never:{seed}")
    enc = kimi_encoding(version)
    out = []
    for i in range(n):
        msgs = make_messages(version, rng)
        for k, m in enumerate(msgs):
            if m["role"] == "assistant" and not m.get("tool_calls"):
                m["tool_calls"] = [{"id": f"c{i}_{k}", "type": "function", "function": {
                    "name": f"t{seed}x{i}x{k}", "arguments": {"q": _text(rng, 3)}}}]
        out.append(enc.encode(render(version, msgs), allowed_special="all"))
    return out


def class_inputs(version: str, ids: list[list[int]], cls: str):
    """The inputs of one class made from fresh samples ``ids``: (inputs, call kwargs)."""
    import numpy as np

    from chatgrammar import MaskPolicy

    if cls in ("whole", "whole, pure"):
        return ids, {}
    if cls == "truncated":
        return [x[:MAX_LENGTH] for x in ids], {}
    if cls == "last_turn_only":
        return ids, {"policy": MaskPolicy(last_turn_only=True)}
    if cls == "lenient":
        return ids, {"strict": False}
    if cls == "packed":
        return [[t for x in ids[i:i + PACK] for t in x] for i in range(0, len(ids), PACK)], {}
    if cls == "1M cut":
        big = [t for x in ids for t in x]
        return [cut_mid_turn(big, version)], {}
    if cls == "numpy in":
        return [np.asarray(x, dtype=np.int64) for x in ids], {}
    if cls == "never repeating":  # (as many samples, drawn from what the slice starts with)
        return never_repeating(version, len(ids), zlib.crc32(repr(ids[0][:64]).encode())), {}
    raise ValueError(cls)


def _scanner_for(version: str, cls: str):
    enc = kimi_encoding(version)
    if version == "kimi-k2":
        scan = scan_k2
    else:
        def scan(x):
            return scan_k3(x, enc.decode)
    if cls == "last_turn_only":
        return lambda x: last_span_only(scan(x))
    return scan


def _once(fn, items, collect: bool = True) -> float:
    """CPU seconds of one pass of ``fn`` over ``items`` (process time: on a shared machine
    the other tenants weigh less than in wall time)."""
    if collect:
        gc.collect()
    t0 = time.process_time()
    for x in items:
        fn(x)
    return time.process_time() - t0


def _race_once(ours, scan, items, chunk: int = 8) -> tuple[float, float]:
    """CPU seconds of ONE pass of ``ours`` and of ``scan`` over ``items``, interleaved in
    chunks of a few items with the order alternating: both contenders see every input once,
    and neither is the one that always pays for bringing a chunk into the cache."""
    t_ours = t_scan = 0.0
    gc.collect()
    for k in range(0, len(items), chunk):
        part = items[k:k + chunk]
        if (k // chunk) % 2:
            t_scan += _once(scan[0], scan[1](part), collect=False)
            t_ours += _once(ours, part, collect=False)
        else:
            t_ours += _once(ours, part, collect=False)
            t_scan += _once(scan[0], scan[1](part), collect=False)
    return t_ours, t_scan


def bench_classes(version: str, n_samples: int, rounds: int, *, check: bool = True) -> dict:
    """Every input class, FIRST PASS over fresh data, against the scanner, in one process.

    A warm-up draw (seed ``"warm"``) runs every class once: it compiles the format and fills
    the memo as the first samples of a run would. Each round then draws fresh samples (a seed
    not used before) and gives each class its own disjoint slice of them, so no class sees
    items another class just memoised; ours and the scanner run exactly once on that slice
    (never best-of-N over the same samples). The ratio of a class is the median over rounds
    of scanner time / our time. Text mode (``fmt.parse(text).spans()`` against a whole-turn
    regex) gets its own fresh slice the same way."""
    import chatgrammar as cg
    from chatgrammar.runtime import fastpath

    enc = kimi_encoding(version)
    fmt = cg.load_format(version)
    need = {c: n_samples for c in CLASSES}
    need["1M cut"] = max(n_samples, 1_100_000 // 3000)
    need["text"] = n_samples
    accel = fastpath._speedups

    def slices(seed):
        texts, ids = workload(version, sum(need.values()), seed=seed)
        out, k = {}, 0
        for c in need:
            out[c] = (texts[k:k + need[c]], ids[k:k + need[c]])
            k += need[c]
        return out

    def ours_fn(c, kw):
        if c != "whole, pure":
            return lambda x: fmt.loss_mask(x, enc, **kw)

        def pure(x):  # the same call where the C accelerator is not built
            fastpath._speedups = None
            try:
                return fmt.loss_mask(x, enc, **kw)
            finally:
                fastpath._speedups = accel
        return pure

    warm = slices("warm")
    for c in CLASSES:
        xs, kw = class_inputs(version, warm[c][1], c)
        for x in xs:
            ours_fn(c, kw)(x)
    for t in warm["text"][0]:
        fmt.parse(t).spans()
    ratios: dict = {c: [] for c in (*CLASSES, "text")}
    ns: dict = {c: [] for c in ratios}
    ours_t = dict.fromkeys(ratios, 0.0)
    units = dict.fromkeys(ratios, 0)
    regex_t = 0.0
    stats0 = fmt.stats()
    for r in range(rounds):
        fresh = slices(f"fresh{r}")
        for c in CLASSES:
            xs, kw = class_inputs(version, fresh[c][1], c)
            scan = _scanner_for(version, c)
            as_lists = (lambda part: part) if c != "numpy in" else \
                (lambda part: [x.tolist() for x in part])
            t_ours, t_scan = _race_once(ours_fn(c, kw), (scan, as_lists), xs,
                                        chunk=1 if c == "1M cut" else 8)
            ratios[c].append(t_scan / t_ours)
            ns[c].append(1e9 * t_ours / sum(len(x) for x in xs))
            ours_t[c] += t_ours
            units[c] += sum(len(x) for x in xs)
            if check:  # after timing: ours equals the reference pipeline on every input
                pol, strict = kw.get("policy"), kw.get("strict", True)
                for x in xs:
                    got = ours_fn(c, kw)(x)
                    got = got if type(got) is list else got.tolist()
                    if got != fmt.parse_ids(x, enc, strict=strict).mask(pol):
                        raise SystemExit(f"{version} {c}: ours differs from the reference")
                if c == "whole" and any(fmt.loss_mask(x, enc) != scan(x) for x in xs):
                    raise SystemExit(f"{version}: the scanner disagrees on whole samples")
        texts = fresh["text"][0]
        t_ours, t_re = _race_once(lambda t: fmt.parse(t).spans(),
                                  (lambda t: regex_spans(version, t), lambda part: part), texts)
        ratios["text"].append(t_re / t_ours)
        ns["text"].append(1e9 * t_ours / sum(map(len, texts)))
        ours_t["text"] += t_ours
        regex_t += t_re
        units["text"] += sum(map(len, texts))
    stats1 = fmt.stats()
    out: dict = {c: {"ratio": statistics.median(ratios[c]), "ratios": ratios[c],
                     "rate": units[c] / ours_t[c] / 1e6,
                     "ns": statistics.median(ns[c])} for c in ratios}
    out["text"]["regex_rate"] = units["text"] / regex_t / 1e6
    out["_slow"] = {k: stats1["ids"]["reasons"].get(k, 0) - stats0["ids"]["reasons"].get(k, 0)
                    for k in stats1["ids"]["reasons"]}
    out["_fast"] = stats1["ids"]["fast"] - stats0["ids"]["fast"]
    out["_samples"] = sum(need.values()) - need["text"]
    out["_rounds"] = rounds
    out["_accelerated"] = accel is not None
    return out


def bench_text(version: str, n_samples: int, rounds: int, *, check: bool = True) -> dict:
    """Text mode alone, measured as :func:`bench_classes` measures its ``text`` row:
    ``fmt.parse(text).spans()`` (a typed, strict parse) against one whole-turn regex that only
    extracts the assistant bodies, FIRST PASS over fresh texts (a warm-up draw first, then
    each round on texts never seen), interleaved in chunks; the median ratio over rounds.
    ``python tools/bench.py --only text`` runs it (and the compile section) without the id
    classes."""
    import chatgrammar as cg

    fmt = cg.load_format(version)
    warm = text_workload(version, n_samples, "text-warm")
    for t in warm:
        fmt.parse(t).spans()
    ratios, ns = [], []
    ours_t = regex_t = 0.0
    chars = 0
    for r in range(rounds):
        texts = text_workload(version, n_samples, f"text-fresh{r}")
        t_ours, t_re = _race_once(lambda t: fmt.parse(t).spans(),
                                  (lambda t: regex_spans(version, t), lambda part: part), texts)
        ratios.append(t_re / t_ours)
        n = sum(map(len, texts))
        ns.append(1e9 * t_ours / n)
        ours_t += t_ours
        regex_t += t_re
        chars += n
        if check:  # after timing: the answers equal the full pipeline's
            from chatgrammar.runtime.format import _NO_MEMO

            for t in texts:
                if fmt.parse(t).spans() != fmt._parse_full(t, True, _NO_MEMO).spans():
                    raise SystemExit(f"{version} text: ours differs from the reference")
    stats = fmt.stats().get("text", {})
    return {"ratio": statistics.median(ratios), "ratios": ratios, "rate": chars / ours_t / 1e6,
            "regex_rate": chars / regex_t / 1e6, "ns": statistics.median(ns),
            "fast": stats.get("fast"), "slow": stats.get("slow")}


def text_workload(version: str, n: int, seed) -> list[str]:
    """Fresh texts for :func:`bench_text`: the Kimi workload, or for ``chatml`` the same
    messages rendered with the TRL Qwen2.5 training template (a ChatML format whose role line
    ends by a literal)."""
    if version != "chatml":
        return workload(version, n, seed=seed)[0]
    from chatgrammar.conformance.render import render_chat

    tpl = TRL_QWEN.read_text(encoding="utf-8")
    rng = random.Random(f"chatml-text:{seed}")
    return [render_chat(tpl, chatml_messages(rng)) for _ in range(n)]


def bench_chatml(n_samples: int, rounds: int) -> dict | None:
    import chatgrammar as cg

    if "chatml" not in cg.list_formats():
        return None
    import transformers

    transformers.logging.set_verbosity_error()
    from chatgrammar.conformance.render import render_chat

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


def _mask_step_ratio(c: dict) -> float:
    """Our mask step over what `return_assistant_tokens_mask` adds to transformers' call. The
    latter is a difference of two timings: where noise makes it zero or negative, the ratio is
    infinite (the target is not met), never a negative number that passes."""
    return c["ours_added_us"] / c["hf_added_us"] if c["hf_added_us"] > 0 else float("inf")


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
    vs = ("kimi-k2", "kimi-k3")
    lines = ["# Performance", "",
             "Measured by `tools/bench.py`: every input class, **first pass over fresh data**, "
             "side by side with a per-token scanner in one process, as ratios (how: see Method). "
             "Regenerate with `python tools/bench.py`.", "",
             "## Machine", ""]
    lines += [f"- {k}: {v}" for k, v in info.items()]
    lines += ["", "## Loss masks by input class (list of int in, list of int out unless noted)",
              "", "Ratio: scanner CPU time / our CPU time on the same fresh inputs (median of "
              f"{args.rounds} rounds, each on a new draw; higher is better). Mtok/s: ours.", "",
              "| input class | kimi-k2 | kimi-k3 | kimi-k2 Mtok/s | kimi-k3 Mtok/s | "
              "kimi-k2 rounds | kimi-k3 rounds |", "|---|---|---|---|---|---|---|"]
    for c in CLASSES:
        a, b = results["kimi-k2"][c], results["kimi-k3"][c]
        lines.append(f"| {CLASS_LABEL[c]} | {a['ratio']:.2f}× | {b['ratio']:.2f}× | "
                     f"{a['rate']:.1f} | {b['rate']:.1f} | "
                     f"{' '.join(f'{x:.2f}' for x in a['ratios'])} | "
                     f"{' '.join(f'{x:.2f}' for x in b['ratios'])} |")
    load = _start_load(info)
    if load is not None and load > 4:
        lines += ["", f"**A loaded machine**: the 1-minute load average was {load:.1f} when this "
                  "run started (other tenants' work on the same cores). Every ratio is lower than "
                  "on a quiet machine, and the wall-clock rows (Compile) most; compare with a "
                  "measurement taken in the same minutes, not with a quiet run."]
    lines += ["", history()]
    lines += ["", "Per-token cost of the 1M-token sequence against a whole sample's (ns per token, "
              "ours, median of the rounds):", "", "| format | whole ns/token | 1M cut ns/token | ratio (≤ 1.2) |",
              "|---|---|---|---|"]
    for v in vs:
        r = results[v]
        lines.append(f"| {v} | {r['whole']['ns']:.1f} | {r['1M cut']['ns']:.1f} | "
                     f"{r['1M cut']['ns'] / r['whole']['ns']:.2f} |")
    lines += ["", "Samples the full pipeline computed during the timed rounds, by reason "
              "(`fmt.stats()`); every other sample took the memoised engine:", "",
              "| format | samples (fast) | full pipeline, by reason |", "|---|---|---|"]
    for v in vs:
        r = results[v]
        slow = ", ".join(f"{k}: {n}" for k, n in sorted(r["_slow"].items()) if n) or "none"
        lines.append(f"| {v} | {r['_fast']} | {slow} |")
    lines += ["", "## Text mode: `fmt.parse(text).spans()` against one whole-turn `re.finditer`",
              "", "First pass over fresh texts, as above.", "",
              "| format | ours Mchar/s | regex Mchar/s | ours / regex (≥ 1) |",
              "|---|---|---|---|"]
    for v in vs:
        t = results[v]["text"]
        lines.append(f"| {v} | {t['rate']:.1f} | {t['regex_rate']:.1f} | {t['ratio']:.2f} |")
    t = results.get("chatml text")
    if t is not None:  # ChatML's literal-ended role line takes the vectorised text path too
        # (stats()["text"]["path"]); the label is pinned by tests/test_bench.py
        lines.append(f"| chatml (TRL Qwen2.5 renders) | {t['rate']:.1f} | "
                     f"{t['regex_rate']:.1f} | {t['ratio']:.2f} |")
    c = results.get("chatml")
    lines += ["", "## Messages → ids + mask (`chatml`, Qwen2.5 fast tokenizer, TRL Qwen2.5 "
              "training template)", ""]
    if c is None:
        lines.append("Skipped: the `chatml` format is not bundled yet (or `--no-chatml`).")
    else:
        lines += ["| samples | tokens/sample | transformers render+tokenize µs | "
                  "+ `return_assistant_tokens_mask` adds µs | ours render+tokenize+mask µs | "
                  "our mask step adds µs | ours added / transformers added (≤ 0.5) |",
                  "|---|---|---|---|---|---|---|",
                  f"| {c['samples']} | {c['tokens'] / c['samples']:.0f} | {c['hf_base_us']:.0f} | "
                  f"{c['hf_added_us']:.0f} | {c['ours_total_us']:.0f} | {c['ours_added_us']:.0f} "
                  f"| {_mask_step_ratio(c):.3f} |"]
    k = results.get("compile")
    if k is not None:
        lines += ["", "## Compile", "",
                  "| formats | cold load of all (s, < 1) | cached load of all (s, < 0.05) | "
                  "`import chatgrammar` (s) |", "|---|---|---|---|",
                  f"| {k['formats']} | {k['cold_s']:.3f} | {k['cached_s']:.4f} | "
                  f"{k['import_s']:.3f} |"]
    lines += ["", "## Targets", "", "| target | measured | met |", "|---|---|---|"]
    for label, value, ok in targets(results):
        lines.append(f"| {label} | {value} | {'yes' if ok else '**no**'} |")
    lines += ["", "## Method", "", METHOD, "", "## Where the time goes", "", NOTES]
    return "\n".join(lines) + "\n"


def _start_load(info: dict) -> float | None:
    """The 1-minute load average at the run's start, from Machine's line (None if unknown)."""
    try:
        return float(info.get("load average (start / end)", "").split()[0])
    except (IndexError, ValueError):
        return None


def targets(results: dict) -> list[tuple[str, str, bool]]:
    """The issue's targets against this run's numbers: (target, measured, met)."""
    out = []
    for v in ("kimi-k2", "kimi-k3"):
        r = results[v]
        for c in CLASSES:
            if c in ("whole, pure", "never repeating"):
                continue
            want = 5 if c == "numpy in" else 3
            x = r[c]["ratio"]
            out.append((f"{v}: {CLASS_LABEL[c]} ≥ {want}× the scanner", f"{x:.2f}×", x >= want))
        x = r["1M cut"]["ns"] / r["whole"]["ns"]
        out.append((f"{v}: 1M-token sequence per token ≤ 1.2× a sample's", f"{x:.2f}×",
                    x <= 1.2))
        x = r["text"]["ratio"]
        out.append((f"{v}: text mode ≥ 1× one whole-turn regex", f"{x:.2f}×", x >= 1))
    t = results.get("chatml text")
    if t is not None:
        out.append(("chatml: text mode ≥ 1× one whole-turn regex", f"{t['ratio']:.2f}×",
                    t["ratio"] >= 1))
    c = results.get("chatml")
    if c is not None:
        x = _mask_step_ratio(c)
        out.append(("chatml: our mask step ≤ 0.5× what `return_assistant_tokens_mask` adds",
                    f"{x:.2f}×", x <= 0.5))
    k = results.get("compile")
    if k is not None:
        out.append(("all bundled formats, cold load < 1 s", f"{k['cold_s']:.3f} s",
                    k["cold_s"] < 1))
        out.append(("all bundled formats, cached load < 50 ms", f"{1000 * k['cached_s']:.1f} ms",
                    k["cached_s"] < 0.05))
    return out


# Earlier measurements of the same classes, newest first: (what was measured, the ratios
# for kimi-k2 and kimi-k3 in HISTORY_ROWS order). report() renders them as tables.
# (the classes these earlier tables measured: "never repeating" came later)
HISTORY_ROWS = (*(CLASS_LABEL[c] for c in CLASSES if c != "never repeating"),
                "text mode against the regex")
HISTORY = (
    ("docs/performance.md at 89291e2 (session 9's final main, a quiet machine: load average\n"
     "1.05 -> 1.01; kimi-k3 rounds: truncated 4.77 3.99 4.21). Since then C runs the plan's one\n"
     "merge step for step (`_speedups.symbols` is gone), eager cut learning is bounded on data\n"
     "whose items never repeat, a header nothing reads is keyed by its length class only, and an\n"
     "lstrip marker absorbs up to 64 blank ids:",
     ((4.25, 6.03), (4.54, 4.21), (5.76, 7.45), (4.64, 6.85), (4.86, 6.84), (4.14, 5.92),
      (8.12, 11.63), (0.83, 1.05), (1.60, 1.19))),
    ("docs/performance.md at 2d7032e (session 8's final main, a quiet machine: load average\n"
     "0.5 -> 1.0; kimi-k3 rounds: truncated 3.14 2.58 3.36). Since then a cut item is learned by\n"
     "resuming a driver configuration saved during an earlier parse (Driver.run(saves=...) /\n"
     "Driver.resume), and ChatML-shaped formats take the vectorised text path:",
     ((4.69, 6.44), (3.51, 3.14), (6.16, 7.44), (5.38, 5.88), (4.72, 6.64), (4.97, 5.04),
      (7.58, 10.49), (0.81, 1.03), (1.60, 1.16))),
    ("At commit 2cfb8ce (session 8's start, main), measured by this bench (`--no-chatml\n"
     "--no-compile --no-write`) as two processes side by side with the branch that writes list\n"
     "masks in one pass and lightens learning parses (loaded machine, load average\n"
     "12.82 12.59 10.65 / 11.16 13.54 12.99). The branch gave in the same minutes: kimi-k3\n"
     "truncated 2.57x (rounds 2.57 2.28 3.38; 2cfb8ce's rounds 2.72 2.22 2.81), kimi-k2 truncated\n"
     "2.82x, kimi-k3 1M cut 5.19x and 1.18x a sample's cost per token (2cfb8ce: 0.93x), every\n"
     "class within the run-to-run noise of this load:",
     ((3.95, 5.08), (2.59, 2.72), (4.53, 6.85), (3.54, 5.24), (3.93, 6.77), (3.47, 5.26),
      (7.75, 8.55), (0.64, 0.83), (1.36, 1.09))),
    ("At commit b8a3cfd (this session's start, main), measured by this bench (`--no-chatml\n"
     "--no-compile`) right after the table above, as two processes side by side: b8a3cfd and the\n"
     "merged tree of the table above (quiet machine, load average 0.04 0.76 2.16 / 1.63 1.12\n"
     "2.14). The merged tree gave in the same minute: kimi-k3 truncated 2.72x (rounds 2.72 2.43\n"
     "3.07, ours 45.3 Mtok/s, against b8a3cfd's 35.1: the ratio moves with the scanner's timing,\n"
     "about +-20% per run), kimi-k2 truncated 3.41x, every other class within that noise:",
     ((5.06, 5.71), (4.07, 3.25), (5.49, 7.71), (4.86, 6.30), (4.40, 5.87), (4.73, 4.49),
      (8.69, 11.14), (0.77, 1.10), (1.52, 1.20))),
    ("At commit b8a3cfd, measured by this bench at the same time as the branch that resumed C's\n"
     "hand-backs (two processes side by side on a loaded machine, load average\n"
     "13.10 12.64 10.47 / 12.96 13.36 11.86; kimi-k3 rounds: truncated 2.38 2.12 2.64, 1M cut\n"
     "6.09 5.88 2.23):",
     ((3.59, 6.59), (2.96, 2.38), (4.64, 7.15), (4.05, 6.08), (4.36, 5.49), (4.22, 5.88),
      (5.98, 8.72), (0.63, 0.84), (1.37, 1.01))),
    ("docs/performance.md at b8a3cfd (the same code, a quiet machine: load average\n"
     "0.75 1.17 1.73 / 0.95 1.12 1.65; kimi-k3 rounds: truncated 3.13 2.81 3.39, 1M cut\n"
     "7.96 4.62 2.92):",
     ((4.29, 6.19), (3.74, 3.13), (5.85, 7.92), (4.84, 5.85), (4.63, 5.98), (3.50, 4.62),
      (8.17, 10.42), (0.86, 1.02), (1.93, 1.16))),
    ("At commit 0610040 (the previous session's start, main), the same classes measured by this bench's\n"
     "bench_classes a few minutes before the table above, on the same machine (load average\n"
     "3.38 7.22 9.31 / 3.33 6.28 8.81):",
     ((4.25, 5.15), (2.95, 2.60), (5.48, 6.86), (4.15, 5.33), (4.01, 5.35), (2.83, 4.12),
      (8.25, 9.24), (0.78, 0.97), (1.76, 1.13))),
    ("The final table two sessions ago (docs/performance.md at 52995ed: the id classes measured on\n"
     "the id-path branch before its merge, the text row on the merged tree; load average\n"
     "3.81 4.96 7.32 / 4.26 4.62 6.76):",
     ((3.92, 5.61), (3.00, 2.79), (5.27, 6.93), (4.20, 5.80), (4.00, 6.19), (3.83, 4.89),
      (8.19, 10.25), (0.81, 1.03), (1.97, 1.45))),
    ("At commit 13390b7 (the start of the session before), measured by this same bench on the same\n"
     "machine (load average 4.26 4.62 6.76 / 3.56 4.31 6.42; the machine was shared and loaded\n"
     "all session, which lowers every ratio against the earlier tables below):",
     ((3.99, 5.47), (2.95, 2.72), (5.06, 6.70), (4.32, 5.96), (4.04, 5.54), (3.30, 4.78),
      (7.23, 10.06), (0.80, 1.07), (0.89, 0.52))),
    ("The engine before issue 12 (commit 770d1c6, where truncation and `last_turn_only`\n"
     "took the full pipeline), measured by this same bench on the same machine in the same hour\n"
     "(load average ~8; the issue's own table was measured with the old bench on another run):",
     ((1.87, 2.19), (0.29, 0.24), (0.38, 0.31), (1.91, 2.18), (2.29, 2.55), (0.40, 0.17),
      (2.51, 2.95), (0.83, 1.02), (1.11, 0.57))),
    ("At commit 01c2808 (the same memo, executed by Python per item; the C passes only packed the\n"
     "list, found the markers and built the output), measured by this bench two sessions ago:",
     ((1.93, 2.20), (1.32, 1.09), (1.95, 2.18), (1.92, 2.19), (2.42, 2.58), (2.19, 2.38),
      (2.67, 2.59), (0.87, 1.12), (1.15, 0.61))),
)


def history() -> str:
    """The earlier measurements (``HISTORY``) as one table each, under what was measured."""
    out: list[str] = []
    for intro, ratios in HISTORY:
        out += [intro, "", "| input class | kimi-k2 | kimi-k3 |", "|---|---|---|"]
        out += [f"| {label} | {a:.2f}× | {b:.2f}× |"
                for label, (a, b) in zip(HISTORY_ROWS, ratios)]
        out.append("")
    return "\n".join(out).rstrip()


NOTES = """- **One engine.** Every class above runs the same memoised core
  (`chatgrammar/runtime/fastpath.py`): one lexing plan (marker id → code, run shapes, header budgets,
  literal-ended headers, `lstrip` markers, soft-marker pieces, the generation prompts' markers),
  a memoised LALR automaton (the driver's own tables, implicit closes included) and an item memo
  (each top-level item's turns, computed once by the full pipeline, keyed by bytes). The C
  executor (`_speedups.run`) takes a sample end to end — it reads the Python list (or int64
  array, or a CPU tensor through numpy) directly, finds the markers with the plan's table, ends
  literal-ended headers and applies `lstrip` from the memos of those two rules (which the Python
  engine fills: they decode), walks the automaton's table, looks each item key up and writes
  the mask (a list of the shared 0/1 ints, or into a zeroed int64 array) — with no per-item
  Python. Whatever it has not memoised it hands back: automaton entries its walk lacks (the
  configuration and the symbols from there: Python fills them and the C executor goes on), the
  item keys its memo lacks (filled from the Python memo, or learned by a full parse of the
  window around the item, then one retry; when the window would be the whole sample, the full
  pipeline's own mask is the answer; a retry resumes the sample it handed back, whose symbol
  tables C kept, so only the per-symbol walk is redone and a 1M-token sequence is read once;
  the end of input from each new configuration is computed when the automaton meets it), a last turn that may be a generation prompt (only when
  its markers and length fit in one: with tiktoken every other id adds at least one byte; the
  mask comes back with it and one decode decides), an id it does not read itself, a syntax
  error (the Python engine, which raises or recovers).
  Without the extension the numpy/Python executor of the same plan and memo runs (the "without
  the C accelerator" row).
- **Never-repeating items** (the "never repeating" row, no target): every assistant turn
  calls a tool under a new name. Neither format's item key holds the name: kimi-k2's
  tool-call header (`functions.NAME:IDX`) is text nothing reads, keyed by its length class
  alone (`lexers.value_free_openers`), and kimi-k3's XTML keys do not hold it, so the items
  repeat as usual (kimi-k2 went from 0.04-0.10x to about the "whole samples" ratio; a header
  whose value the parse reads, a role or channel, is still keyed by its ids). Where items
  truly never repeat (a header the key must hold, new every time) each sample is learned by
  a parse (a window, or the whole sample), far below the scanner. A learning parse also
  learns its cut items by resuming the configurations saved in it (at most 96 per parse),
  which costs a few times the parse itself (on such samples every sample ~3x dearer: kimi-k2
  with its tool names keyed by their ids, 150 samples, 0.03-0.04x the scanner with it,
  0.08-0.10x without). So it learns them only while the memo's items repeat: over each
  stretch of 16 learning parses, at most half the samples needed one (after the first 256,
  which always do: `FastMasker._learn_cuts`;
  `fmt.stats()["ids"]["cut_skip"]` counts the learning parses that skipped it).
- **Truncation** (an item cut by the end of input) is an item like any other, keyed also by
  the automaton configuration it ends in; a cut shape not seen before costs one full parse of
  a short window: a short whole first item the memo keeps, then the cut item (its key holds
  everything its parse depends on; a window that does not teach the key falls back to the
  item before it and itself). That parse is ~100-300 µs of Python, most of it the driver; the
  driver keeps, per parser configuration, the synthetic terminators that close a cut input, so
  that search is paid once. Where the format's headers are plain XTML (kimi-k3), an item cut inside
  a header is also memoised under what the parse reads of that header
  (`Driver.cut_reading`: an opener's tag and attributes, or nothing; nothing of a close header),
  so a cut at another id of the same kind of header costs no parse
  (`fmt.stats()["ids"]["alias"]`). Most new cut shapes on this workload differ in what comes
  before the cut, though, so this saves few parses. On fresh data the
  window parses are most of what the truncated class pays beyond the whole-sample rate (on
  kimi-k3 about 5 of the first 200 fresh samples have a new cut shape, ~0.5 ms of parse and
  learning each: ~2.5 ms against ~4.5 ms for the C executor over all 200; with the memo warm
  the same samples run at ~5.5× the scanner); the rate of new cut shapes falls as the memo fills.
  Where that learning goes (kimi-k3, 15 new cut shapes in 600 fresh samples after the bench's
  warm-up, CPU time per shape, median of reps; ~450-650 µs in all): the driver's parse of the
  window ~250 (the prefix's tokens ~100, the closing search and the synthetic terminators'
  reductions ~100, reading the window's ids ~45), the memo's own learning ~135 (the window's
  symbol tables, its walk, checking them against the reference tokens, the items' programs),
  filling the C memo ~75 (the item's spans under the policy: `Conversation.spans`), the C
  executor's retries ~40. No step dominates, so no constant-factor change makes a new cut
  shape cost what the scanner pays (~130 µs per 2048-id sample). The cut item's
  key holds every sibling before the cut (think, response, each tool call and its argument
  headers), so on this workload nearly every new cut shape is a new prefix: what would
  remove most of those parses is memoising the nested elements of an item on their own (a
  cut inside a nested element resuming the driver from the enclosing structure's state, with
  the elements before it already built), not the item whole. Learning parses skip the
  generation-prompt mark (the memo keeps none) and the closing search keeps its candidate
  order per parser state; asking the driver for the closing of every new configuration as the
  automaton meets it was tried and moved the search rather than saving it (the configurations
  a new cut shape ends in are mostly new themselves).
- **1M-token sequence.** One call per round; its rounds used to vary by 2-3× because the
  first round's cut at an unseen configuration made the C executor hand the sequence back
  twice (an automaton entry, then the cut item) and each retry read all 1M ids again (and
  the learn converted the whole list to learn one window). Retries now resume, so the learning
  round costs ~25% more than the others instead of ~2×. Its mask is a list of 1M slots (8 MB,
  past L2): the executor writes it in one forward pass over the spans in order, each slot once
  (it used to write zeros everywhere and then the spans again, a second pass that a sample's
  list, in cache, hardly pays). What is left per token over a sample's is the memory the
  sequence lives in (its ids are read once, its header ids a second time for the item keys).
- **List input.** A Python list of ints must be read one object at a time: the executor does
  that read (~1.5 ns per token) and builds the returned list (~1 ns per token, and as much
  again when the caller frees it); the scanner spends ~25-45 ns per token. What is left per call
  is ~1.5 µs of Python (`loss_mask`, the tokenizer's state — a one-entry shortcut for the last
  tokenizer —, the policy lookup).
- Numbers move by ±20% between runs on a shared 2-core machine, more when it is loaded (the
  load average is in Machine); the ratios, measured on the same inputs in the same process, are
  the stable part."""


METHOD = """\
- Workload: `make_messages` in `tools/bench.py`: 1-8 exchanges, user turns lognormal (median 55
  tokens), assistant turns lognormal (median 200), σ = 1.5 (capped at 16k tokens), a system
  message half the time, a tool call (and its result) in 15% of exchanges, K3 reasoning in 80% of
  assistant turns. Rendered with `tests/data/templates/moonshotai-Kimi-K2.jinja` /
  `moonshotai-Kimi-K3.jinja` through `chatgrammar.conformance.render` (byte-identical to transformers),
  tokenised with tiktoken (Qwen2.5 ranks + Kimi's special ids).
- First pass over fresh data: a warm-up draw runs every class once (compile, memo: what the
  first samples of a run do). Then each round draws new samples (a seed never used before) and
  gives every class its own disjoint slice, timed exactly once for ours and once for the
  scanner (CPU time of the process, `time.process_time`), interleaved in chunks of 8 inputs
  with the order alternating (so neither side always pays for bringing the data into the
  cache). The table keeps the median ratio over the rounds and lists each round's ratio.
- Classes: *truncated* cuts every sample to its first 2048 ids (Model-Optimizer tokenises with
  `truncation=True, max_length=max_seq_len`; most samples are longer, so most are cut inside a
  turn); *last_turn_only* uses `MaskPolicy(last_turn_only=True)` (the scanner keeps its last
  trained run); *lenient* is `strict=False`; *packed* concatenates 8 samples per sequence; *1M
  cut* concatenates ~300 samples and cuts at ~1M ids inside an assistant turn; *numpy in* passes
  int64 arrays (numpy out); *pure* switches the C accelerator off (`CHATGRAMMAR_PURE=1`: a
  machine without a compiler).
- Every answer is checked equal to the reference pipeline (`parse_ids(...).mask(policy)`) after
  timing, and on whole samples equal to the scanner.
- The scanners walk the list one token at a time with Model-Optimizer's semantics (K2:
  `<|im_assistant|>` → `<|im_middle|>` → mark to `<|im_end|>`; K3: `<|open|>` … `<|sep|>`,
  decode the header, count depth to the matching `<|close|>`).
- Text mode times `fmt.parse(text).spans()` (a typed parse, strict) against a regex that only
  extracts the assistant bodies (no validation), first pass over fresh texts.
- ChatML: "adds" is the time a mask step adds on top of render + tokenize: for transformers the
  difference between `apply_chat_template(..., return_assistant_tokens_mask=True)` and without
  it; for us, `fmt.loss_mask(ids, tok)` alone (best of 3 over the same 50 conversations: this
  row is about the added step, not the memo).
- Compile: fresh processes (`CHATGRAMMAR_CACHE_DIR` pointing at an empty directory, then the same
  directory again); the time excludes interpreter start-up and `import chatgrammar`.
"""


# Text mode and compile, appended to the notes above.
NOTES += """
- **Text mode** (`chatgrammar/runtime/textpath.py`): for a format whose lexing is markers and
  the runs between them (the Kimis among them), one `re.split` by
  `markers | unknown-marker shape` finds every marker and every unknown marker-shaped string
  in one scan (the reference scans twice); symbols, part boundaries and header runs come from
  C-level `map` / `accumulate` / `compress`, the automaton is walked 16 symbols per
  dictionary lookup, and each item is one lookup of its key (symbol bytes + header texts).
  The Conversation it returns is *deferred*: its turns are built on first access, and until
  then `spans()` / `trained_turns()` come from per-template span plans computed once per
  policy by the same code from a built turn. About a third of what is left is the split
  itself (the text is UCS-2 here: ~1.5 ns per character); the rest is ~1 µs per item and
  ~0.3 µs per span of Python. Literal-ended headers (ChatML's role line) are a second group
  of the same split (the header as the lexer finds it) and `lstrip` is `map(str.isspace)` over
  the runs, so those formats take the same path (59 of the 67 bundled formats in all; the
  rest: an unknown-marker shape that may overlap a marker). The marker alternation is a trie,
  and markers that start unlike the rest (ChatML's `**IMPORTANT**`) get a second splitter used
  only on texts that hold them, so the common one starts with one literal character. The
  ChatML row of the text table: TRL Qwen2.5 renders of the same messages, against a regex
  that only extracts the assistant bodies.
- **Compile.** A cold load parses each spec's YAML once with libyaml (PyYAML's C parser, when
  built; errors and anything the pure-Python reader would reject go through it), then runs
  Lark's LALR analysis. A cached load reads one JSON entry per spec (keyed by its bytes; a
  spec with `extends` also records its bases' paths and hashes, checked on load), validates
  the spec with pydantic again (about half of what a cached load costs) and keeps the parse
  tables as a JSON string that is decoded, and the driver built, when the format first
  parses."""


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=200,
                    help="fresh samples per input class per round (default 200)")
    ap.add_argument("--rounds", type=int, default=3,
                    help="rounds, each on a new draw; the median ratio is kept (default 3)")
    ap.add_argument("--quick", action="store_true", help="60 samples, 2 rounds")
    ap.add_argument("--no-chatml", action="store_true", help="skip the chatml section")
    ap.add_argument("--no-compile", action="store_true", help="skip the compile section")
    ap.add_argument("--no-write", action="store_true", help="do not write docs/performance.md")
    ap.add_argument("--out", default=str(ROOT / "docs" / "performance.md"))
    ap.add_argument("--only", default=None,
                    help="comma-separated sections to run alone and print as JSON, writing "
                         "nothing: text (bench_text, both Kimi versions), compile")
    args = ap.parse_args(argv)
    if args.quick:
        args.samples, args.rounds = 60, 2
    if args.only:
        only = set(args.only.split(","))
        out: dict = {}
        if "text" in only:
            for v in ("kimi-k2", "kimi-k3", "chatml"):
                out[f"text {v}"] = bench_text(v, args.samples, args.rounds)
                print(v, "text", json.dumps(out[f"text {v}"]), flush=True)
        if "compile" in only:
            out["compile"] = bench_compile()
            print("compile", json.dumps(out["compile"]), flush=True)
        return 0
    info = machine()
    results: dict = {}
    for v in ("kimi-k2", "kimi-k3"):
        results[v] = bench_classes(v, args.samples, args.rounds)
        print(v, json.dumps({c: round(x["ratio"], 2) for c, x in results[v].items()
                             if not c.startswith("_")}), flush=True)
    results["chatml"] = None if args.no_chatml else bench_chatml(max(20, args.samples // 4), 3)
    results["chatml text"] = None if args.no_chatml else \
        bench_text("chatml", args.samples, args.rounds)
    print("chatml", results["chatml"], flush=True)
    results["compile"] = None if args.no_compile else bench_compile()
    print("compile", results["compile"], flush=True)
    info["load average (start / end)"] = f"{info.pop('load average')} / {_loadavg()}"
    text = report(results, info, args)
    print(text)
    if not args.no_write:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text, encoding="utf-8")
    return 0


def _loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


if __name__ == "__main__":
    import sys

    sys.path.insert(0, str(ROOT))
    sys.exit(main())
