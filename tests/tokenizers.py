"""Offline builders for the real tokenizers the tests use (cached: each is built once per process).

Every builder reads only files under ``tests/data/tokenizers`` (provenance:
``tests/data/README.md``) and never touches the network. The returned objects are shared between callers: treat them as
read-only (``copy.deepcopy`` one before changing its attributes).

- :func:`qwen_fast_tokenizer` / :func:`qwen_tiktoken_encoding`: Qwen2/2.5/3 byte-level BPE from
  ``qwen.tiktoken`` with the added tokens at their real ids (:data:`QWEN_ADDED_TOKENS`).
- :func:`mistral_tokenizer`: Mistral SentencePiece v3 / v7, fast (transformers' ``LlamaTokenizer``,
  converted from the ``.model`` file) or slow (transformers' ``SentencePieceBackend``).
- :func:`phi3_tokenizer`: Phi-3 (SPM, 32064 tokens) from the vocab-only GGUF, through
  transformers' own GGUF loader (``gguf_file=``; needs the ``gguf`` package).
"""
from __future__ import annotations

import os
import re
import shutil
import tempfile
from functools import lru_cache
from pathlib import Path
from typing import Any

DATA = Path(__file__).resolve().parent / "data"
TOKENIZERS = DATA / "tokenizers"

QWEN_TIKTOKEN = TOKENIZERS / "Qwen-Qwen2.5" / "qwen.tiktoken"
MISTRAL_MODELS = {
    "v3": (TOKENIZERS / "mistralai-Mistral-7B-Instruct-v0.3"
           / "mistral_instruct_tokenizer_240323.model.v3"),
    "v7": (TOKENIZERS / "mistralai-Mistral-Large-Instruct-2411"
           / "mistral_instruct_tokenizer_241114.model.v7"),
}
PHI3_DIR = TOKENIZERS / "microsoft-Phi-3-mini-4k-instruct"
PHI3_GGUF = "ggml-vocab-phi-3.gguf"

# Qwen2's pre-tokenizer Split regex (tokenizer.json of Qwen2/2.5/3, and Qwen's tiktoken PAT_STR):
# like GPT-4's cl100k pattern but digits are split one by one (\p{N}, not \p{N}{1,3}).
QWEN_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
QWEN_BASE_VOCAB = 151_643  # ranks in qwen.tiktoken: ids 0..151642

# (id, content, special) — the ``added_tokens_decoder`` of Qwen's tokenizer_config.json.
# Source: Qwen2.5-*-Instruct and Qwen3-* tokenizer_config.json (ids 151643-151664 are shared by
# both; Qwen3 appends 151665-151668). Cross-checked against a Qwen3 tokenizer_config.json /
# tokenizer.json found with the project's code-search tool, and against
# tests/data/templates/SOURCES.md ("Qwen-Qwen2.5/qwen.tiktoken" row). ``special`` is the file's
# flag: the tool-call, FIM, repo/file and think markers are added tokens that are NOT special
# (they are still matched as single tokens in text, but survive skip_special_tokens).
QWEN_ADDED_TOKENS: tuple[tuple[int, str, bool], ...] = (
    (151643, "<|endoftext|>", True),
    (151644, "<|im_start|>", True),
    (151645, "<|im_end|>", True),
    (151646, "<|object_ref_start|>", True),
    (151647, "<|object_ref_end|>", True),
    (151648, "<|box_start|>", True),
    (151649, "<|box_end|>", True),
    (151650, "<|quad_start|>", True),
    (151651, "<|quad_end|>", True),
    (151652, "<|vision_start|>", True),
    (151653, "<|vision_end|>", True),
    (151654, "<|vision_pad|>", True),
    (151655, "<|image_pad|>", True),
    (151656, "<|video_pad|>", True),
    (151657, "<tool_call>", False),
    (151658, "</tool_call>", False),
    (151659, "<|fim_prefix|>", False),
    (151660, "<|fim_middle|>", False),
    (151661, "<|fim_suffix|>", False),
    (151662, "<|fim_pad|>", False),
    (151663, "<|repo_name|>", False),
    (151664, "<|file_sep|>", False),
    # Qwen3 additions
    (151665, "<tool_response>", False),
    (151666, "</tool_response>", False),
    (151667, "<think>", False),
    (151668, "</think>", False),
)
QWEN_IDS = {content: token_id for token_id, content, _ in QWEN_ADDED_TOKENS}
# Qwen2.5/Qwen3 tokenizer_config.json: bos_token null, eos "<|im_end|>", pad "<|endoftext|>", and
# additional_special_tokens = the special added tokens from <|im_start|> to <|video_pad|>.
QWEN_SPECIAL_TOKENS = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
QWEN_EXTRA_SPECIAL_TOKENS = [content for _, content, special in QWEN_ADDED_TOKENS
                             if special and content != "<|endoftext|>"]


@lru_cache(maxsize=None)
def qwen_ranks() -> dict:
    """Qwen2.5's 151,643 BPE ranks (piece -> rank, in rank order): the one copy every test
    tiktoken encoding over them shares (read-only).

    Read as ``tiktoken.load.load_tiktoken_bpe`` reads the file (one base64 piece and its rank
    per line), decoding with ``binascii`` directly: the same dict in a third of the time. It
    was read three more times per module (tests/fuzz_tokenizers.py, kimi_tokenizers.py and
    :func:`qwen_tiktoken_encoding` each through ``load_tiktoken_bpe``): ~35 MB and ~1 CPU-s
    each.

    Example:
        >>> len(qwen_ranks())
        151643
    """
    import binascii

    ranks = {}
    for line in QWEN_TIKTOKEN.read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[binascii.a2b_base64(token)] = int(rank)
    assert len(ranks) == QWEN_BASE_VOCAB
    return ranks


# Built backends kept as their serialisation (tokenizers' JSON, a few MB each), keyed by
# content: the vocabulary file's bytes and what was added to it. Plain dicts, not lru_caches,
# so that tests/conftest.py's release between modules (which drops every built tokenizer, tens
# to hundreds of MB each) keeps them: the next module rebuilds the object from the JSON (about
# a third of the cost: Qwen's conversion from tiktoken ranks takes ~4 CPU-s, Phi-3's GGUF
# loader ~4 CPU-s, their rebuild ~1.4 and ~0.3) instead of converting the vocabulary again.
_SERIALISED: dict[tuple, tuple[type, str, dict]] = {}


def _content_key(*paths: Path, extra: Any = ()) -> tuple:
    import hashlib

    return tuple(hashlib.sha256(p.read_bytes()).hexdigest() for p in paths) + (repr(extra),)


def _rebuilt(key: tuple, build) -> Any:
    """The transformers fast tokenizer ``build()`` makes, rebuilt from its kept serialisation
    when this process has built it before: the same class and constructor arguments, the
    backend from its JSON (what ``copy.deepcopy`` of the tokenizer does)."""
    hit = _SERIALISED.get(key)
    if hit is None:
        tok = build()
        _SERIALISED[key] = (type(tok), tok.backend_tokenizer.to_str(), dict(tok.init_kwargs))
        return tok
    from tokenizers import Tokenizer

    cls, state, kwargs = hit
    return cls(tokenizer_object=Tokenizer.from_str(state), **kwargs)


@lru_cache(maxsize=None)
def qwen_fast_tokenizer() -> Any:
    """Qwen2/2.5/3's tokenizer as a transformers ``PreTrainedTokenizerFast``, built offline.

    The BPE comes from ``qwen.tiktoken`` through transformers' ``TikTokenConverter`` with Qwen2's
    split regex; like Qwen's tokenizer.json it normalises to NFC; the added tokens of
    :data:`QWEN_ADDED_TOKENS` get their real ids. No chat template is set (pass ``chat_template=``
    to ``apply_chat_template``). Converting takes about 4 CPU-s, once per process; later builds
    (after tests/conftest.py released it) start from the kept serialisation (:func:`_rebuilt`).

    Returns:
        The tokenizer (shared, treat as read-only).

    Raises:
        AssertionError: an added token did not land on its real id.

    Example:
        >>> tok = qwen_fast_tokenizer()
        >>> tok.encode("<|im_start|>user\\n", add_special_tokens=False)[0]
        151644
    """
    key = _content_key(QWEN_TIKTOKEN, extra=("qwen-fast", QWEN_PATTERN, QWEN_ADDED_TOKENS))
    tok = _rebuilt(key, _convert_qwen)
    for token_id, content, _ in QWEN_ADDED_TOKENS:
        assert tok.convert_tokens_to_ids(content) == token_id, content
    return tok


def _convert_qwen() -> Any:
    from tokenizers import AddedToken, normalizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    backend = TikTokenConverter(vocab_file=str(QWEN_TIKTOKEN), pattern=QWEN_PATTERN).converted()
    backend.normalizer = normalizers.NFC()
    assert backend.get_vocab_size() == QWEN_BASE_VOCAB
    # Added one at a time, in id order: each new token takes the next free id.
    for token_id, content, special in QWEN_ADDED_TOKENS:
        token = AddedToken(content, normalized=False, special=special)
        if special:
            backend.add_special_tokens([token])
        else:
            backend.add_tokens([token])
        assert backend.token_to_id(content) == token_id, (content, backend.token_to_id(content))
    return PreTrainedTokenizerFast(tokenizer_object=backend,
                                   extra_special_tokens=list(QWEN_EXTRA_SPECIAL_TOKENS),
                                   **QWEN_SPECIAL_TOKENS)


@lru_cache(maxsize=None)
def qwen_tiktoken_encoding() -> Any:
    """The same Qwen vocabulary as a bare ``tiktoken.Encoding`` (ranks + the added tokens).

    tiktoken has a single notion of "special": every entry of :data:`QWEN_ADDED_TOKENS` is one,
    so encode rendered chats with ``allowed_special="all"``. Unlike the transformers tokenizer it
    does not normalise to NFC (identical ids for NFC input, which the test texts are).

    Returns:
        The ``tiktoken.Encoding`` named ``"qwen2.5"`` (shared).

    Example:
        >>> enc = qwen_tiktoken_encoding()
        >>> enc.encode("<|im_end|>", allowed_special="all")
        [151645]
    """
    import tiktoken

    return tiktoken.Encoding(
        name="qwen2.5",
        pat_str=QWEN_PATTERN,
        mergeable_ranks=qwen_ranks(),
        special_tokens=dict(QWEN_IDS),
    )


@lru_cache(maxsize=None)
def qwen25_encoding() -> Any:
    """Qwen2.5's vocabulary without Qwen3's additions (ids up to 151664): ``<think>``,
    ``</think>``, ``<tool_response>`` are plain text there, so id mode must find soft markers
    in decoded text.

    Returns:
        A ``tiktoken.Encoding`` (shared, treat as read-only).
    """
    import tiktoken

    base = qwen_tiktoken_encoding()
    specials = {c: i for i, c, _ in QWEN_ADDED_TOKENS if i <= 151664}
    return tiktoken.Encoding(name="qwen2.5-no-qwen3-additions", pat_str=QWEN_PATTERN,
                             mergeable_ranks=base._mergeable_ranks, special_tokens=specials)


_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@lru_cache(maxsize=None)
def _slow_sentencepiece_class() -> type:
    from transformers.tokenization_utils_sentencepiece import SentencePieceBackend

    class SlowSentencePieceTokenizer(SentencePieceBackend):
        """transformers' generic slow SentencePiece tokenizer with an exact ``decode``.

        The base class joins pieces and strips the result, so byte-fallback pieces come back as
        the literal text ``<0x0A>`` and edge spaces are lost; the slow ``LlamaTokenizer`` of
        transformers 4.x decoded them properly. Decoding here is the exact inverse of encoding:
        ``▁`` is a space, ``<0xNN>`` pieces are raw bytes, special tokens are kept verbatim.
        """

        def convert_tokens_to_string(self, tokens: list[str]) -> str:
            buf = bytearray()
            for token in tokens:
                match = _BYTE_PIECE.fullmatch(token)
                if match:
                    buf.append(int(match.group(1), 16))
                else:
                    buf += token.replace("\u2581", " ").encode("utf-8")
            return buf.decode("utf-8", errors="replace")

    return SlowSentencePieceTokenizer


def _spm_control_pieces(model_file: Path) -> list[str]:
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(model_file))
    return [sp.id_to_piece(i) for i in range(sp.get_piece_size()) if sp.is_control(i)]


@lru_cache(maxsize=None)
def mistral_tokenizer(version: str = "v3", *, fast: bool = True) -> Any:
    """A Mistral SentencePiece tokenizer (v3: Mistral-7B-Instruct-v0.3; v7: Mistral-Large-2411).

    ``fast=True``: transformers' ``LlamaTokenizer`` (tokenizers backend) converted from the
    ``.model`` file, which registers the model's control pieces (``<s>``, ``</s>``, ``[INST]``,
    ``[/INST]``, ``[TOOL_CALLS]``, ... ``[control_N]``) as special added tokens at their
    SentencePiece ids, as Mistral's own tokenizer.json does. ``fast=False``: transformers' slow
    ``SentencePieceBackend`` (a ``PreTrainedTokenizer`` on ``sentencepiece``; no offsets, no
    ``char_to_token``) with the same control pieces declared as special tokens, ``legacy=False``
    (no SentencePiece dummy prefix) and an exact ``decode`` (see ``SlowSentencePieceTokenizer``).

    The two agree on ids for chat text that starts with a special token (``<s>``), with one
    exception: SentencePiece's own BPE and the converted tokenizers BPE can split whitespace
    runs differently (an indented code line ``"    return"``: fast ``▁▁▁▁ return``, slow
    ``▁▁▁ ▁return``). Text not starting with a special token also differs: the fast tokenizer
    prepends ``▁`` to it, the slow one does not. Neither adds BOS by itself in these builds;
    encode rendered chats with ``add_special_tokens=False``.

    Args:
        version: ``"v3"`` or ``"v7"``.
        fast: which implementation (see above).

    Returns:
        The tokenizer (shared, treat as read-only).

    Raises:
        KeyError: unknown version.

    Example:
        >>> mistral_tokenizer("v3").convert_tokens_to_ids(["[INST]", "[/INST]", "</s>"])
        [3, 4, 2]
    """
    model_file = MISTRAL_MODELS[version]
    specials = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    if fast:
        from transformers import LlamaTokenizer

        # from_pretrained finds the SentencePiece model by its conventional file name only.
        with tempfile.TemporaryDirectory(prefix="cg-mistral-") as tmp:
            shutil.copyfile(model_file, os.path.join(tmp, "tokenizer.model"))
            return LlamaTokenizer.from_pretrained(tmp, **specials)
    controls = [p for p in _spm_control_pieces(model_file) if p not in specials.values()]
    return _slow_sentencepiece_class()(
        vocab_file=str(model_file), extra_special_tokens=controls, legacy=False,
        clean_up_tokenization_spaces=False, **specials,
    )


@lru_cache(maxsize=None)
def phi3_tokenizer() -> Any:
    """Phi-3-mini's tokenizer, loaded by transformers from the vocab-only GGUF (``gguf_file=``).

    Reproduces llama.cpp's own tokenizer test vectors (``ggml-vocab-phi-3.gguf.inp/.out``) and
    maps ``<|user|>``, ``<|assistant|>``, ``<|system|>``, ``<|end|>``, ``<|endoftext|>`` to
    single ids (32010, 32001, 32006, 32007, 32000). The GGUF also carries Phi-3's chat template
    (``tok.chat_template``).

    Returns:
        A transformers fast tokenizer (shared, treat as read-only).

    Example:
        >>> phi3_tokenizer().convert_tokens_to_ids("<|end|>")
        32007
    """
    from transformers import AutoTokenizer

    # (transformers' GGUF loader takes ~4 CPU-s; a later build in this process starts from the
    # kept serialisation, :func:`_rebuilt`)
    return _rebuilt(_content_key(PHI3_DIR / PHI3_GGUF, extra="phi3-gguf"),
                    lambda: AutoTokenizer.from_pretrained(str(PHI3_DIR), gguf_file=PHI3_GGUF))


def phi3_test_vectors() -> list[tuple[str, list[int]]]:
    """llama.cpp's Phi-3 tokenizer test vectors: ``(text, expected ids)`` pairs.

    Returns:
        The pairs, in file order (inputs separated by ``\\n__ggml_vocab_test__\\n``, one line
        of space-separated ids per input; no BOS).

    Example:
        >>> len(phi3_test_vectors()) > 10
        True
    """
    inputs = (PHI3_DIR / f"{PHI3_GGUF}.inp").read_text(encoding="utf-8").split(
        "\n__ggml_vocab_test__\n")
    outputs = (PHI3_DIR / f"{PHI3_GGUF}.out").read_text(encoding="utf-8").split("\n")
    return [(text, [int(v) for v in ids.split()]) for text, ids in zip(inputs, outputs)]
