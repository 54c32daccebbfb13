"""Offline tokenizers for the deepseek-v3, harmony, glm4 and minimax-m2 tests.

None of these families' own vocabularies is available offline, so each tokenizer is a
``tiktoken.Encoding`` over Qwen's byte-level BPE ranks (tests/data/tokenizers/Qwen-Qwen2.5/
qwen.tiktoken, 151,643 ranks, with Qwen's split pattern) carrying the family's special tokens at
their real ids. What the engine needs from a tokenizer is exactly that: markers as single special
ids, message text as ordinary BPE pieces (merged tokens, multi-byte characters split across
tokens), and ``decode`` / ``decode_with_offsets``.

Real special ids, and where they come from:

- gpt-oss (``o200k_harmony``): tiktoken's own ``o200k_harmony`` definition
  (``tiktoken_ext/openai_public.py``, installed): ``<|startoftext|>`` 199998, ``<|endoftext|>``
  199999, ``<|return|>`` 200002, ``<|constrain|>`` 200003, ``<|channel|>`` 200005,
  ``<|start|>`` 200006, ``<|end|>`` 200007, ``<|message|>`` 200008, ``<|call|>`` 200012.
- DeepSeek-V3 / R1 / V3.1 (``tokenizer_config.json`` ``added_tokens_decoder``): BOS 0, EOS 1,
  ``<｜▁pad▁｜>`` 2, ``<think>`` 128798, ``</think>`` 128799, ``<｜User｜>`` 128803,
  ``<｜Assistant｜>`` 128804, ``<|EOT|>`` 128805, tool markers 128806–128814 (calls begin/end,
  call begin/end, outputs begin/end, output begin/end, sep). The think and tool-call ids are
  confirmed by the DummyTokenizer of FastDeploy's DeepSeek tool-parser tests.
- GLM-4.5 (``tokenizer_config.json``): ``<|endoftext|>`` 151329, ``[gMASK]`` 151331, ``<sop>``
  151333, ``<|system|>`` 151335, ``<|user|>`` 151336, ``<|assistant|>`` 151337,
  ``<|observation|>`` 151338, ``<think>`` 151350, ``</think>`` 151351, ``<tool_call>`` 151352,
  ``</tool_call>`` 151353.
- MiniMax-M2 (``tokenizer.json`` added tokens, as mirrored by torchspec's MiniMax parser tests):
  ``]!p~[`` 200000, ``]~b]`` 200019, ``[e~[`` 200020, ``]!d~[`` 200021, ``]~!b[`` 200034,
  ``<think>`` 200050, ``</think>`` 200051, ``<minimax:tool_call>`` 200052,
  ``</minimax:tool_call>`` 200053.

Every special token keeps its real id. Where real ids fall inside Qwen's rank range (DeepSeek's
and GLM's do), the ordinary ranks are renumbered around them: rank r gets the r-th id that is
not a special id. The renumbering is monotone, so BPE merges happen in the same order and every
text tokenises exactly as with Qwen's ranks (only the ids of ordinary tokens change).
gpt-oss's and MiniMax's ids lie past Qwen's 151,643 ranks: nothing moves there.
"""
from __future__ import annotations

from functools import lru_cache


REAL_IDS: dict[str, dict[str, int]] = {
    "harmony": {
        "<|startoftext|>": 199998, "<|endoftext|>": 199999, "<|reserved_200000|>": 200000,
        "<|reserved_200001|>": 200001, "<|return|>": 200002, "<|constrain|>": 200003,
        "<|reserved_200004|>": 200004, "<|channel|>": 200005, "<|start|>": 200006,
        "<|end|>": 200007, "<|message|>": 200008, "<|reserved_200009|>": 200009,
        "<|reserved_200010|>": 200010, "<|reserved_200011|>": 200011, "<|call|>": 200012,
    },
    "deepseek-v3": {
        "<｜begin▁of▁sentence｜>": 0, "<｜end▁of▁sentence｜>": 1, "<｜▁pad▁｜>": 2,
        "<think>": 128798, "</think>": 128799, "<｜User｜>": 128803, "<｜Assistant｜>": 128804,
        "<|EOT|>": 128805, "<｜tool▁calls▁begin｜>": 128806, "<｜tool▁calls▁end｜>": 128807,
        "<｜tool▁call▁begin｜>": 128808, "<｜tool▁call▁end｜>": 128809,
        "<｜tool▁outputs▁begin｜>": 128810, "<｜tool▁outputs▁end｜>": 128811,
        "<｜tool▁output▁begin｜>": 128812, "<｜tool▁output▁end｜>": 128813,
        "<｜tool▁sep｜>": 128814,
    },
    "glm4": {
        "<|endoftext|>": 151329, "[gMASK]": 151331, "<sop>": 151333, "<|system|>": 151335,
        "<|user|>": 151336, "<|assistant|>": 151337, "<|observation|>": 151338,
        "<think>": 151350, "</think>": 151351, "<tool_call>": 151352, "</tool_call>": 151353,
    },
    "minimax-m2": {
        "]!p~[": 200000, "]~b]": 200019, "[e~[": 200020, "]!d~[": 200021, "]~!b[": 200034,
        "<think>": 200050, "</think>": 200051, "<minimax:tool_call>": 200052,
        "</minimax:tool_call>": 200053,
    },
}

# What transformers passes a template as special-token variables (tokenizer_config.json).
SPECIAL_TOKENS: dict[str, dict[str, str]] = {
    "harmony": {"bos_token": "<|startoftext|>", "eos_token": "<|return|>",
                "pad_token": "<|endoftext|>"},
    "deepseek-v3": {"bos_token": "<｜begin▁of▁sentence｜>", "eos_token": "<｜end▁of▁sentence｜>"},
    "glm4": {"eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"},
    "minimax-m2": {"bos_token": "]~!b[", "eos_token": "[e~[", "unk_token": "]!d~["},
}


@lru_cache(maxsize=4)  # each holds Qwen's ranks (~35 MB)
def encoding_for(family: str):
    """The ``tiktoken.Encoding`` of a family (shared; treat as read-only).

    Args:
        family: ``"harmony"``, ``"deepseek-v3"``, ``"glm4"`` or ``"minimax-m2"``.

    Returns:
        Qwen's BPE ranks (renumbered around the specials) plus the family's special tokens at
        their real ids.
        Encode rendered chats with ``allowed_special="all"``.

    Example:
        >>> encoding_for("harmony").encode("<|start|>", allowed_special="all")
        [200006]
    """
    from tests.format_kit import renumbered_encoding

    specials = dict(REAL_IDS[family])
    assert len(set(specials.values())) == len(specials)
    return renumbered_encoding.__wrapped__(f"{family}-test", tuple(specials.items()))
