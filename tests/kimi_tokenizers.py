"""Kimi tokenizers for the tests, offline: tiktoken Encodings with Kimi's real special ids.

Kimi's own BPE ranks (``tiktoken.model``) are not available offline; the base vocabulary here is
Qwen's byte-level BPE ranks (tests/data/tokenizers/Qwen-Qwen2.5/qwen.tiktoken, 151,643 ranks) —
what matters for the engine is that specials sit at Kimi's real ids past the base vocabulary and
that message text is ordinary BPE. Special ids (Kimi-K2 ``tokenizer_config.json``
``added_tokens_decoder``; K3's from the issue / its reference encoder):

- K2: ``[BOS]`` 163584, ``[EOS]`` 163585, ``<|im_end|>`` 163586, ``<|im_user|>`` 163587,
  ``<|im_assistant|>`` 163588, ``<|start_header_id|>`` 163590, ``<|end_header_id|>`` 163591,
  ``[EOT]`` 163593, ``<|im_system|>`` 163594, tool-call markers 163595–163599,
  ``<|im_middle|>`` 163601, media markers 163602–163605, ``<think>`` 163606, ``</think>`` 163607;
  every other id of 163584..163839 is ``<|reserved_token_N|>``.
- K3: ``<|end_of_msg|>`` 163586, ``<|open|>`` 163587, ``<|close|>`` 163588, ``<|sep|>`` 163589;
  a real K3 tokenizer also registers K2's ``<|im_*|>`` strings as added ids past the base
  vocabulary (163840+): :func:`kimi_k3_encoding` ``(with_k2_strings=True)``.

:func:`render_and_encode` encodes template text with specials allowed and message text with
none, so a ``<|close|>`` typed in user text stays ordinary ids (what a real pipeline does when it
tokenises messages separately, and what id mode must get right).
"""
from __future__ import annotations

import copy
import re
from functools import lru_cache
from pathlib import Path

DATA = Path(__file__).resolve().parent / "data"
QWEN_TIKTOKEN = DATA / "tokenizers" / "Qwen-Qwen2.5" / "qwen.tiktoken"
TEMPLATES = DATA / "templates"

# Kimi's pre-tokenizer is GPT-4-like; exact splitting is irrelevant to the engine.
PAT_STR = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"""
           r""" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")

K2_SPECIALS = {
    "[BOS]": 163584, "[EOS]": 163585, "<|im_end|>": 163586, "<|im_user|>": 163587,
    "<|im_assistant|>": 163588, "<|start_header_id|>": 163590, "<|end_header_id|>": 163591,
    "[EOT]": 163593, "<|im_system|>": 163594, "<|tool_calls_section_begin|>": 163595,
    "<|tool_calls_section_end|>": 163596, "<|tool_call_begin|>": 163597,
    "<|tool_call_argument_begin|>": 163598, "<|tool_call_end|>": 163599,
    "<|im_middle|>": 163601, "<|media_start|>": 163602, "<|media_content|>": 163603,
    "<|media_end|>": 163604, "<|media_pad|>": 163605, "<think>": 163606, "</think>": 163607,
}
K3_SPECIALS = {"<|end_of_msg|>": 163586, "<|open|>": 163587, "<|close|>": 163588,
               "<|sep|>": 163589}
K2_STRINGS_IN_K3 = ["<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>",
                    "<|im_middle|>", "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>",
                    "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"]


def _ranks() -> dict:
    from tests.tokenizers import qwen_ranks

    return qwen_ranks()  # (the one shared copy, read-only)


def _with_reserved(specials: dict[str, int]) -> dict[str, int]:
    used = set(specials.values())
    out = dict(specials)
    for i in range(163584, 163840):
        if i not in used:
            out[f"<|reserved_token_{i}|>"] = i
    return out


@lru_cache(maxsize=None)
def kimi_k2_encoding():
    """tiktoken Encoding with Kimi-K2's special ids (shared; read-only)."""
    import tiktoken
    return tiktoken.Encoding(name="kimi-k2-test", pat_str=PAT_STR, mergeable_ranks=_ranks(),
                             special_tokens=_with_reserved(K2_SPECIALS))


@lru_cache(maxsize=None)
def kimi_k3_encoding(with_k2_strings: bool = False):
    """tiktoken Encoding with Kimi-K3's special ids; optionally K2's strings at 163840+."""
    import tiktoken
    specials = _with_reserved(K3_SPECIALS)
    if with_k2_strings:
        for i, s in enumerate(K2_STRINGS_IN_K3):
            specials[s] = 163840 + i
    return tiktoken.Encoding(name=f"kimi-k3-test{'-k2' if with_k2_strings else ''}",
                             pat_str=PAT_STR, mergeable_ranks=_ranks(), special_tokens=specials)


def template(name: str) -> str:
    return (TEMPLATES / name).read_text(encoding="utf-8")


_SENT = re.compile("\ue000(\\d+)\ue001")


def render_and_encode(enc, template_src: str, messages: list[dict], **kwargs) -> tuple[str, list[int]]:
    """Render ``messages`` with a real template (exactly as transformers) and tokenise it:
    template text with specials allowed, message text (content, reasoning) with none.

    Returns:
        (rendered text, ids); ``enc.decode(ids) == text``.
    """
    from chatgrammar.conformance.render import render_chat

    text = render_chat(template_src, messages, **kwargs)
    originals: list[str] = []

    def sub(v: str) -> str:
        originals.append(v)
        return f"\ue000{len(originals) - 1}\ue001"

    masked = copy.deepcopy(messages)
    for m in masked:
        for key in ("content", "reasoning_content"):
            if isinstance(m.get(key), str) and m[key]:
                m[key] = sub(m[key])
    with_sent = render_chat(template_src, masked, **kwargs)
    ids: list[int] = []
    pos = 0
    rebuilt = []
    for mt in _SENT.finditer(with_sent):
        part = with_sent[pos:mt.start()]
        ids += enc.encode(part, allowed_special="all")
        msg = originals[int(mt.group(1))]
        ids += enc.encode(msg, allowed_special=set(), disallowed_special=())
        rebuilt += [part, msg]
        pos = mt.end()
    ids += enc.encode(with_sent[pos:], allowed_special="all")
    rebuilt.append(with_sent[pos:])
    assert "".join(rebuilt) == text, "template transforms message text; cannot split the render"
    assert enc.decode(ids) == text
    return text, ids



# Minimal faithful equivalent of Kimi's remote-code tokenizer (moonshotai/Kimi-K2-Instruct,
# Kimi-Linear and Kimi-K3 ``tokenization_kimi.py``): same constructor and defaults (the default
# ``additional_special_tokens`` list K2's <|im_*|> strings), 256 special ids from
# ``len(mergeable_ranks)`` on named from ``added_tokens_decoder`` or ``<|reserved_token_N|>``, the
# tiktoken ``model``, the byte-level ``encoder``/``decoder`` tables, ``get_vocab`` returning only
# ``encoder`` (so specials missing from the tiktoken model are appended by transformers from
# 163840 on), ``encode``/``decode`` through tiktoken when called without keyword arguments.
# Left out: chunking of very long inputs, K3's segment-wise ``apply_chat_template``.
TOKENIZATION_KIMI = r'''
import os
from pathlib import Path
from shutil import copyfile
from typing import Dict, List, Optional, Union

import tiktoken
from tiktoken.load import load_tiktoken_bpe
from transformers import PreTrainedTokenizer
from transformers.convert_slow_tokenizer import bytes_to_unicode

VOCAB_FILES_NAMES = {"vocab_file": "tiktoken.model"}


class TikTokenTokenizer(PreTrainedTokenizer):
    vocab_files_names = VOCAB_FILES_NAMES
    model_input_names = ["input_ids", "attention_mask"]
    special_tokens: Dict[str, int]
    num_reserved_special_tokens = 256
    pat_str = "|".join([
        r"""[\p{Han}]+""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ])

    def __init__(self, vocab_file, bos_token="[BOS]", eos_token="[EOS]", unk_token=None,
                 pad_token=None, additional_special_tokens: Optional[List[str]] = None,
                 added_tokens_decoder: Optional[dict] = None, **kwargs):
        assert os.path.isfile(vocab_file), vocab_file
        if additional_special_tokens is None:
            additional_special_tokens = [
                "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|start_header_id|>",
                "<|end_header_id|>", "[EOT]", "<|im_system|>", "<|im_middle|>",
            ]
        if added_tokens_decoder:
            special_tokens_mapping = {i: added_tokens_decoder[i].content
                                      for i in added_tokens_decoder}
        else:
            special_tokens_mapping = {}
        self.vocab_file = vocab_file
        mergeable_ranks = load_tiktoken_bpe(vocab_file)
        num_base_tokens = len(mergeable_ranks)
        self.special_tokens = {
            special_tokens_mapping.get(i, f"<|reserved_token_{i}|>"): i
            for i in range(num_base_tokens, num_base_tokens + self.num_reserved_special_tokens)
        }
        self.model = tiktoken.Encoding(name=Path(vocab_file).name, pat_str=self.pat_str,
                                       mergeable_ranks=mergeable_ranks,
                                       special_tokens=self.special_tokens)
        self.n_words: int = self.model.n_vocab
        self.bos_id: int = self.special_tokens[str(bos_token)]
        self.eos_id: int = self.special_tokens[str(eos_token)]
        self.pad_id: int = self.special_tokens[str(pad_token)]
        self.unk_id: int = self.special_tokens[str(unk_token)]
        self.byte_encoder = bytes_to_unicode()
        self.byte_decoder = {v: k for k, v in self.byte_encoder.items()}
        self.decoder = {}
        for i in range(self.n_words):
            self.decoder[i] = "".join(
                self.byte_encoder[ord(c)]
                for c in self.model.decode_single_token_bytes(i).decode("latin-1"))
        self.encoder = {}
        for i in range(self.n_words):
            if i in self.decoder:
                self.encoder[self.decoder[i]] = i
        super().__init__(bos_token=bos_token, eos_token=eos_token, unk_token=unk_token,
                         pad_token=pad_token, additional_special_tokens=additional_special_tokens,
                         added_tokens_decoder=added_tokens_decoder, **kwargs)
        self.all_special_ids_set = set(self.all_special_ids)

    def encode(self, text: str, allow_special_tokens: bool = True, **kwargs) -> List[int]:
        if len(kwargs) > 0:
            return super().encode(text, **kwargs)
        assert type(text) is str
        if allow_special_tokens:
            return self.model.encode(text, allowed_special="all")
        return self.model.encode(text, disallowed_special=())

    def decode(self, token_ids: Union[int, List[int]], **kwargs) -> str:
        if len(kwargs) > 0:
            return super().decode(token_ids, **kwargs)
        if type(token_ids) is int:
            token_ids = [token_ids]
        return self.model.decode(list(token_ids))

    @property
    def vocab_size(self) -> int:
        return self.n_words

    def get_vocab(self) -> Dict[str, int]:
        return self.encoder

    def _tokenize(self, text: str, **kwargs) -> List[str]:
        return [self.decoder[t] for t in self.encode(text)]

    def _convert_token_to_id(self, token: str) -> int:
        return self.encoder.get(token, self.unk_id)

    def _convert_id_to_token(self, index: int) -> str:
        return self.decoder.get(index)

    @staticmethod
    def clean_up_tokenization(out_string: str) -> str:
        return out_string

    def convert_tokens_to_string(self, tokens: List[str]) -> str:
        text = "".join(tokens)
        return bytearray([self.byte_decoder[c] for c in text]).decode("utf-8", "replace")

    def save_vocabulary(self, save_directory: str, filename_prefix: Optional[str] = None):
        out = os.path.join(save_directory, (filename_prefix + "-" if filename_prefix else "")
                           + VOCAB_FILES_NAMES["vocab_file"])
        if os.path.abspath(self.vocab_file) != os.path.abspath(out):
            copyfile(self.vocab_file, out)
        return (out,)
'''

# tokenizer_config.json of each variant. [BOS]/[EOS]/[PAD]/[UNK] are named in all of them
# (TikTokenTokenizer looks all four up). "k3+k2" keeps the constructor's default
# additional_special_tokens, which is how a real K3 tokenizer comes to carry K2's strings: they
# are not in K3's tiktoken model, so transformers appends them from 163840 on.
_NAMED = {"[BOS]": 163_584, "[EOS]": 163_585, "[PAD]": 163_838, "[UNK]": 163_839}


def tokenizer_config(variant: str) -> dict:
    named = {**_NAMED, **(K2_SPECIALS if variant == "k2" else K3_SPECIALS)}
    if variant == "none":
        named = dict(_NAMED)
    cfg = {
        "tokenizer_class": "TikTokenTokenizer",
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
        "bos_token": "[BOS]", "eos_token": "[EOS]", "pad_token": "[PAD]", "unk_token": "[UNK]",
        "added_tokens_decoder": {str(i): {"content": s, "lstrip": False, "normalized": False,
                                          "rstrip": False, "single_word": False, "special": True}
                                 for s, i in sorted(named.items(), key=lambda kv: kv[1])},
    }
    if variant == "k3":
        cfg["additional_special_tokens"] = list(K3_SPECIALS)
    elif variant == "none":
        cfg["additional_special_tokens"] = []
    return cfg


KIMI_BASE = 163_584


def write_kimi_files(d: Path) -> Path:
    """Write ``tiktoken.model`` (Qwen's ranks padded to Kimi's 163,584 with byte strings starting
    with 0xC0, which never occurs in UTF-8, so no text reaches them) and ``tokenization_kimi.py``
    (:data:`TOKENIZATION_KIMI`) into ``d``; return ``d``."""
    import base64

    from tiktoken.load import load_tiktoken_bpe

    d = Path(d)
    d.mkdir(parents=True, exist_ok=True)
    if not (d / "tiktoken.model").is_file():
        ranks = load_tiktoken_bpe(str(QWEN_TIKTOKEN))
        for i in range(len(ranks), KIMI_BASE):
            ranks[b"\xc0" + str(i).encode()] = i
        (d / "tiktoken.model").write_text(
            "".join(f"{base64.b64encode(t).decode()} {r}\n"
                    for t, r in sorted(ranks.items(), key=lambda kv: kv[1])), encoding="ascii")
    (d / "tokenization_kimi.py").write_text(TOKENIZATION_KIMI, encoding="utf-8")
    return d


_SLOW: dict = {}


def kimi_slow_tokenizer(variant: str, files: Path):
    """Kimi's slow ``TikTokenTokenizer`` (the remote code above) for ``variant`` ("k2", "k3",
    "k3+k2", "none"), from the files :func:`write_kimi_files` wrote; built once per variant and
    directory, shared (read-only)."""
    import importlib.util

    from tokenizers import AddedToken

    files = Path(files)
    key = (variant, str(files))
    if key not in _SLOW:
        mod = _SLOW.get(("module", str(files)))
        if mod is None:
            spec = importlib.util.spec_from_file_location("cg_test_tokenization_kimi",
                                                          files / "tokenization_kimi.py")
            mod = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(mod)
            _SLOW[("module", str(files))] = mod
        cfg = tokenizer_config(variant)
        kwargs = {k: cfg[k] for k in ("bos_token", "eos_token", "pad_token", "unk_token")}
        if "additional_special_tokens" in cfg:
            kwargs["additional_special_tokens"] = cfg["additional_special_tokens"]
        decoder = {int(i): AddedToken(d["content"], special=True, normalized=False)
                   for i, d in cfg["added_tokens_decoder"].items()}
        _SLOW[key] = mod.TikTokenTokenizer(str(files / "tiktoken.model"),
                                           added_tokens_decoder=decoder, **kwargs)
    return _SLOW[key]
