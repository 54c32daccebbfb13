"""Tokenizer adapters: one small interface over the tokenizers trainers actually use.

Accepted:
- transformers tokenizers, fast and slow (including remote-code slow ones such as Kimi's
  tiktoken-backed ``TikTokenTokenizer``);
- a bare ``tiktoken.Encoding``;
- any object with ``convert_tokens_to_ids(str) -> int`` and ``decode(list[int]) -> str``
  (the *minimal protocol*).

A marker counts only where the tokenizer maps its text to ONE special/added id; ordinary
ids that happen to spell a marker are text. Nothing here imports transformers or tiktoken:
objects are recognised by duck typing.
"""
from __future__ import annotations

import itertools
import weakref
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ..errors import TokenizerLoadError  # (defined there, re-exported)


class TokenizerAdapter:
    """Uniform view of a tokenizer: marker ids, decoding, vocabulary evidence.

    Args:
        tokenizer: a transformers tokenizer, a ``tiktoken.Encoding`` or a minimal-protocol object.

    Raises:
        TypeError: the object offers neither protocol.
    """

    def __init__(self, tokenizer: Any):
        self.rebind(tokenizer)
        if self._encoding is None and not (hasattr(tokenizer, "convert_tokens_to_ids")
                                           and hasattr(tokenizer, "decode")):
            raise TypeError(
                f"unsupported tokenizer {type(tokenizer).__name__}: need a transformers "
                "tokenizer, a tiktoken.Encoding, or an object with convert_tokens_to_ids() "
                "and decode()")
        self.kind = ("tiktoken" if self._encoding is tokenizer else
                     "transformers" if hasattr(tokenizer, "get_added_vocab") else
                     "tiktoken-wrapper" if self._encoding is not None else "minimal")
        self._special_cache: dict[str, int | None] = {}
        self._soft_cache: dict[str, int | None] = {}
        self._added: dict[str, int] | None = None

    def rebind(self, tokenizer: Any) -> None:
        """Point this adapter at ``tokenizer`` (one with the same content, see
        :func:`content_key`). The adapter holds it by weak reference where it can, so no
        cache of adapters keeps a tokenizer alive."""
        self._ref, self._strong = _weak(tokenizer)
        enc = _tiktoken_encoding(tokenizer)
        self._enc_ref, self._enc_strong = (None, None) if enc is None else _weak(enc)

    @property
    def tokenizer(self) -> Any:
        """The tokenizer (raises ReferenceError once it was freed and never rebound)."""
        if self._ref is None:
            return self._strong
        t = self._ref()
        if t is None:
            raise ReferenceError("the tokenizer of this adapter was freed")
        return t

    @property
    def _encoding(self) -> Any:
        if self._enc_ref is None:
            return self._enc_strong
        return self._enc_ref()

    # ------------------------------------------------------------------ evidence
    def added_vocab(self) -> dict[str, int]:
        """Special and added tokens (text → id) as far as the tokenizer tells."""
        if self._added is None:
            out: dict[str, int] = {}
            t = self.tokenizer
            if self._encoding is not None:
                enc = self._encoding
                table = getattr(enc, "_special_tokens", None)
                if isinstance(table, dict):
                    # tiktoken's own special-token table: exact, and O(1) per token
                    out.update({k: int(v) for k, v in table.items()})
                else:
                    for s in enc.special_tokens_set:
                        # encode_single_token prefers an ordinary BPE piece spelling the same
                        # string (Qwen's ranks hold "<s>"); the special id is what encode()
                        # emits. allowed_special="all" keeps one cached special-token regex
                        # (a per-token set compiles a new regex each time: seconds per
                        # tokenizer with Kimi's 256 specials).
                        ids = enc.encode(s, allowed_special="all")
                        out[s] = ids[0] if len(ids) == 1 else enc.encode_single_token(s)
            for attr in ("special_tokens", "added_tokens_encoder"):
                d = getattr(t, attr, None)
                if isinstance(d, dict):
                    out.update({k: v for k, v in d.items() if isinstance(v, int)})
            get_added = getattr(t, "get_added_vocab", None)
            if callable(get_added):
                try:
                    out.update(get_added())
                except Exception:  # some remote-code tokenizers do not implement it
                    pass
            self._added = out
        return self._added

    def _special_ids(self) -> set[int]:
        ids = getattr(self.tokenizer, "all_special_ids", None)
        try:
            return set(ids or ())
        except TypeError:
            return set()

    def token_id(self, text: str, special: bool = True) -> int | None:
        """The single id the tokenizer gives ``text`` as a marker, or None.

        Args:
            text: the marker string.
            special: True — only special/added ids count (ordinary BPE pieces that spell the
                string are text); False (soft markers) — any single id whose decode is ``text``.
        """
        cache = self._special_cache if special else self._soft_cache
        if text in cache:
            return cache[text]
        tid = self._lookup(text, special)
        cache[text] = tid
        return tid

    def _lookup(self, text: str, special: bool) -> int | None:
        added = self.added_vocab()
        if text in added:
            return int(added[text])
        t = self.tokenizer
        if self._encoding is not None and self._encoding is t:
            if special:
                return None
            try:
                tid = self._encoding.encode_single_token(text)
            except KeyError:
                return None
            return int(tid)
        conv = getattr(t, "convert_tokens_to_ids", None)
        if conv is None:
            return None
        try:
            tid = conv(text)
        except Exception:
            return None
        if isinstance(tid, list) or tid is None or not isinstance(tid, int) or tid < 0:
            return None
        unk = getattr(t, "unk_token_id", None)
        if unk is not None and tid == unk and text != getattr(t, "unk_token", None):
            return None
        # The id must really be this string (not an unk fallback or a normalised piece).
        try:
            if self.decode([tid]) != text:
                back = getattr(t, "convert_ids_to_tokens", None)
                if back is None or back(tid) != text:
                    return None
        except Exception:
            return None
        if not special:
            return tid
        if tid in self._special_ids():
            return tid
        sp = getattr(t, "sp_model", None)
        if sp is not None:
            try:  # SentencePiece control / user-defined pieces ([INST], <|user|>, …)
                if sp.IsControl(tid) or sp.IsUserDefined(tid):
                    return tid
            except Exception:
                pass
        if self.kind == "minimal":
            # The minimal protocol cannot say "special": a single id decoding to the exact
            # marker string is accepted (documented).
            return tid
        return None

    # ------------------------------------------------------------------ decoding
    def decode(self, ids: Sequence[int]) -> str:
        """Decode ids to text without dropping special tokens or cleaning spaces.

        An id the tokenizer cannot decode (negative, beyond its vocabulary) becomes U+FFFD
        instead of raising: hostile or corrupt id sequences must not crash a parse.
        """
        ids = [int(i) for i in ids]
        try:
            return self._decode(ids)
        except _NotText:
            raise
        except Exception:  # noqa: BLE001 - tokenizers raise KeyError, OverflowError, ...
            pass
        out: list[str] = []
        run: list[int] = []
        for i in ids:
            try:
                self._decode([i])
            except _NotText:
                raise
            except Exception:  # noqa: BLE001
                if run:
                    out.append(self._decode(run))
                    run = []
                out.append("\ufffd")
            else:
                run.append(i)
        if run:
            out.append(self._decode(run))
        return "".join(out)

    def _decode(self, ids: list[int]) -> str:
        if self._encoding is not None and self._encoding is self.tokenizer:
            return self._encoding.decode(ids, errors="replace")
        t = self.tokenizer
        try:
            text = t.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        except TypeError:
            text = t.decode(ids)
        if not isinstance(text, str):  # a broken tokenizer: say so, do not crash later
            raise _NotText(f"{type(t).__name__}.decode() returned {type(text).__name__}, "
                           "not str")
        return text

    def decode_offsets(self, ids: Sequence[int]) -> tuple[str, list[int]]:
        """Decode ``ids`` and return (text, start char of each token)."""
        ids = [int(i) for i in ids]
        enc = self._encoding
        if enc is not None and enc is self.tokenizer:
            try:
                text, offsets = enc.decode_with_offsets(ids)
                return text, list(offsets)
            except Exception:
                pass
        pieces = self._stream_pieces(ids)
        if pieces is None:
            # Each token decoded after its predecessor: decoders that strip a leading space
            # (SentencePiece's "▁ok" alone is "ok") keep it once the token is not first.
            pieces, prev = [], None
            for i in ids:
                one = self.decode([i])
                if prev is not None:
                    pair, head = self.decode([prev, i]), self.decode([prev])
                    if pair.startswith(head):
                        one = pair[len(head):]
                pieces.append(one)
                prev = i
        starts, pos = [], 0
        for p in pieces:
            starts.append(pos)
            pos += len(p)
        return "".join(pieces), starts

    def _stream_pieces(self, ids: list[int]) -> list[str] | None:
        """The text each id adds, from the Rust streaming decoder of a fast tokenizer (exact:
        a token that completes a multi-byte character carries it, the ones before carry
        ""); None when the tokenizer has none."""
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is None:
            return None
        try:
            from tokenizers.decoders import DecodeStream
        except ImportError:  # tokenizers < 0.21
            return None
        stream = DecodeStream(skip_special_tokens=False)
        try:
            return [stream.step(backend, i) or "" for i in ids]
        except Exception:
            return None


class _NotText(TypeError):
    """The tokenizer's decode() broke the protocol (it must return a str)."""


def _tiktoken_encoding(tok: Any) -> Any:
    """The tiktoken.Encoding behind ``tok`` (itself, or the ``.model`` of Kimi-style wrappers)."""
    for cand in (tok, getattr(tok, "model", None), getattr(tok, "encoding", None)):
        if cand is not None and type(cand).__name__ == "Encoding" and \
                hasattr(cand, "encode_single_token") and hasattr(cand, "special_tokens_set"):
            return cand
    return None


def _weak(obj: Any) -> tuple[Any, Any]:
    """(weak reference, None), or (None, obj) for an object that cannot be weakly referenced."""
    try:
        return weakref.ref(obj), None
    except TypeError:
        return None, obj


def content_version(tokenizer: Any) -> tuple:
    """A cheap signature of what a tokenizer may gain after it was first used (added and
    special tokens, vocabulary size): when it changes, :func:`content_key` is recomputed.
    Costs a few attribute reads (it runs on every ``loss_mask`` call)."""
    if type(tokenizer).__name__ == "Encoding":
        return (len(getattr(tokenizer, "_special_tokens", ()) or ()),
                getattr(tokenizer, "max_token_value", None))
    out: list = []
    try:
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None:
            out.append(backend.get_vocab_size(with_added_tokens=True))
        added = getattr(tokenizer, "_added_tokens_decoder", None)
        if isinstance(added, dict):
            out.append(len(added))
        enc = getattr(tokenizer, "model", None)
        if enc is not None and type(enc).__name__ == "Encoding":
            out.append(len(getattr(enc, "_special_tokens", ()) or ()))
    except Exception:  # noqa: BLE001 - remote-code tokenizers: best effort
        pass
    return tuple(out)


_OBJ_KEYS = itertools.count()


_CONTENT_KEYS: "weakref.WeakKeyDictionary[Any, tuple[tuple, tuple]]" = \
    weakref.WeakKeyDictionary()


def content_key(tokenizer: Any) -> tuple:
    """What a tokenizer's lexer and memo depend on, as a hashable key: its vocabulary (ranks or
    pieces) and its added/special tokens. Two objects with the same content share one key;
    a tokenizer that gains special tokens gets a new one. Valid within one process (it uses
    Python's salted hashes). A minimal-protocol object, whose vocabulary cannot be read, gets
    a key of its own.

    The key is kept per tokenizer object (weakly: it keeps no tokenizer alive) while its
    :func:`content_version` is unchanged, as the per-tokenizer state is: hashing a 150k-piece
    vocabulary costs tens of milliseconds, paid again by every format that first meets the
    same tokenizer (and after every ``_states`` reset) without it.

    Raises:
        TypeError: the object is no tokenizer (see :class:`TokenizerAdapter`).
    """
    ver = content_version(tokenizer)
    try:
        hit = _CONTENT_KEYS.get(tokenizer)
    except TypeError:  # not weakly referenceable / not hashable: computed each time
        return _content_key(tokenizer)
    if hit is not None and hit[0] == ver:
        return hit[1]
    key = _content_key(tokenizer)
    if key[0] != "object":  # (a minimal-protocol object keeps a key of its own per call)
        _CONTENT_KEYS[tokenizer] = (ver, key)
    return key


def vocab_key(tokenizer: Any) -> tuple:
    """:func:`content_key` without the added and special tokens: what identifies the
    tokenizer's vocabulary (its ranks or pieces), shared by every tokenizer object over the
    same one whatever tokens were added to it (e.g. one tiktoken ranks file under each
    format's markers). Same validity as :func:`content_key`.

    Raises:
        TypeError: the object is no tokenizer (see :class:`TokenizerAdapter`).
    """
    key = content_key(tokenizer)
    return key if key[0] == "object" else key[:-2]


def _content_key(tokenizer: Any) -> tuple:
    a = TokenizerAdapter(tokenizer)
    enc = a._encoding
    parts: list = [a.kind]
    vocab = None  # the vocabulary's digest (_vocab_digest)
    if enc is not None and enc is tokenizer:
        ranks = getattr(enc, "_mergeable_ranks", None)
        if isinstance(ranks, dict):
            vocab = _vocab_digest(ranks)
        parts += [getattr(enc, "_pat_str", None)]
    else:
        get_vocab = getattr(tokenizer, "get_vocab", None)
        if callable(get_vocab):
            try:
                got = get_vocab()
                vocab = _vocab_digest(got if isinstance(got, dict) else dict(got.items()))
            except Exception:  # noqa: BLE001
                vocab = None
        if vocab is None and enc is not None:
            ranks = getattr(enc, "_mergeable_ranks", None)
            if isinstance(ranks, dict):
                vocab = _vocab_digest(ranks)
    if vocab is None:
        return ("object", next(_OBJ_KEYS))
    parts += [type(tokenizer).__qualname__, *vocab,
              hash(frozenset(a.added_vocab().items())), hash(frozenset(a._special_ids()))]
    return tuple(parts)


def _vocab_digest(vocab: dict) -> tuple:
    """(how, hash, size) of a vocabulary (piece -> id): equal for equal contents, whatever
    the dict's order (valid within one process: Python's salted hashes).

    Where the ids are 0..n-1, each once (every tiktoken ranks file, most vocabularies), the
    pieces in id order are the whole content: hashed as one tuple (bytes and str objects
    keep their hash), a fifth of the cost of the set of (piece, id) pairs (~50 ms for 150k
    pieces, paid by every new tokenizer object). Any other vocabulary (ids not exactly
    0..n-1, or not all integers): the set of pairs."""
    n = len(vocab)
    if n > 1:
        ids = np.array(list(vocab.values()))
        if ids.ndim == 1 and ids.dtype.kind in "iu" and len(ids) == n:
            if np.array_equal(ids, np.arange(n)):  # (the dict is in id order)
                return ("by id", hash(tuple(vocab)), n)
            if int(ids.min()) >= 0 and int(ids.max()) < n:
                seen = np.zeros(n, dtype=bool)
                seen[ids] = True
                if seen.all():  # n ids in [0, n), none missing: each once
                    pieces = np.empty(n, dtype=object)
                    pieces[ids] = list(vocab)
                    return ("by id", hash(tuple(pieces.tolist())), n)
    return ("pairs", hash(frozenset(vocab.items())), n)


_ADAPTERS: "weakref.WeakKeyDictionary[Any, tuple[tuple, TokenizerAdapter]]" = \
    weakref.WeakKeyDictionary()


def adapt(tokenizer: Any) -> TokenizerAdapter:
    """Cached :class:`TokenizerAdapter` for a tokenizer object, built anew when the tokenizer's
    content changed since (:func:`content_version`: added/special tokens, vocabulary size), so
    its marker lookups never go stale. A tokenizer that cannot be weakly referenced gets a
    fresh adapter each call (never a cache keyed by ``id()``, which is reused after a free)."""
    if isinstance(tokenizer, TokenizerAdapter):
        return tokenizer
    ver = content_version(tokenizer)
    try:
        hit = _ADAPTERS.get(tokenizer)
    except TypeError:  # not weak-referenceable / not hashable
        return TokenizerAdapter(tokenizer)
    if hit is not None and hit[0] == ver:
        return hit[1]
    a = TokenizerAdapter(tokenizer)
    _ADAPTERS[tokenizer] = (ver, a)
    return a


def load_tokenizer(name_or_path: str, *, trust_remote_code: bool = False) -> Any:
    """Load a transformers tokenizer offline (never the network).

    Args:
        name_or_path: a local tokenizer directory (a ``tokenizer_config.json`` /
            ``tokenizer.json`` file stands for its directory), or a name in the local cache.
        trust_remote_code: let a tokenizer that ships its own code run it.

    Returns:
        The tokenizer.

    Raises:
        TokenizerLoadError: transformers missing, path missing, remote code not allowed, or
            any load failure (one line).
    """
    try:
        from transformers import AutoTokenizer
        from transformers.utils import logging as hf_logging
    except ImportError:
        raise TokenizerLoadError("loading a tokenizer needs transformers: "
                                 "pip install 'chatgrammar[transformers]'") from None
    p = Path(name_or_path).expanduser()
    looks_like_path = (p.exists() or name_or_path.startswith((".", "/", "~"))
                       or name_or_path.count("/") > 1 or "\\" in name_or_path)
    if looks_like_path and not p.exists():
        raise TokenizerLoadError(f"no such tokenizer directory: {name_or_path}")
    if p.is_file():
        if p.name in ("tokenizer_config.json", "tokenizer.json", "chat_template.jinja"):
            p = p.parent
        else:
            raise TokenizerLoadError(f"expected a tokenizer directory, got the file {p}")
    target = str(p) if p.exists() else name_or_path
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # keep stderr to our one line
    try:
        return AutoTokenizer.from_pretrained(target, trust_remote_code=trust_remote_code,
                                             local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - every failure is one line
        msg = (str(exc).strip() or type(exc).__name__).splitlines()[0]
        if not trust_remote_code and ("trust_remote_code" in str(exc)
                                      or "custom code" in str(exc)):
            raise TokenizerLoadError(f"the tokenizer at {target} ships its own code; rerun "
                                     "with --trust-remote-code to allow it to run") from None
        raise TokenizerLoadError(f"cannot load tokenizer {target!r} offline: "
                                 f"{type(exc).__name__}: {msg}") from None
    finally:
        hf_logging.set_verbosity(verbosity)
