"""Byte-level BPE tokenizer (GPT-2 style, e.g. SmolLM2) built from GGUF metadata with the `tokenizers` library.

GGUF keys used: tokenizer.ggml.model ("gpt2"), tokenizer.ggml.pre (pre-tokenizer family), tokenizer.ggml.tokens
(id -> token string in GPT-2's byte-to-unicode alphabet), tokenizer.ggml.merges ("a b" strings, rank order),
tokenizer.ggml.token_type (3 = control: special tokens), tokenizer.ggml.{bos,eos,unknown,padding}_token_id,
tokenizer.ggml.add_bos_token, tokenizer.chat_template (jinja, rendered with jinja2 as HF does).

Pre-tokenization follows llama.cpp's `llm_tokenizer_bpe` per `pre` type:
  smollm / starcoder / refact / codeshell / command-r:  every digit alone, then the GPT-2 regex
  gpt2 / default:                                     the GPT-2 regex
which in `tokenizers` is [Digits(individual_digits=True),] ByteLevel(add_prefix_space=False, use_regex=True).

The method names follow KimiTokenizer (encode, decode, encode_chat, apply_chat_template, stop_ids, vocab_size).
"""

from __future__ import annotations

import datetime
import json
from typing import Any, Mapping, Sequence

TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4
_DIGIT_SPLIT_PRE = ("smollm", "starcoder", "refact", "codeshell", "command-r", "exaone", "minerva")
_PLAIN_PRE = ("gpt2", "default", "gpt-2", "mpt", "olmo", "jais")
_STOP_NAMES = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>")


class TokenizerError(ValueError):
    """Unsupported or inconsistent tokenizer metadata."""


def _compile_jinja(source: str):
    """HF's chat-template environment: sandboxed, trim_blocks + lstrip_blocks, raise_exception, tojson."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(source)


class HFTokenizer:
    """A `tokenizers.Tokenizer` plus the special ids and chat template of a GGUF (or any byte-level BPE)."""

    def __init__(self, tokens: Sequence[str], merges: Sequence[str | tuple[str, str]],
                 token_types: Sequence[int] | None = None, *, pre: str = "gpt2", bos_id: int | None = None,
                 eos_id: int | None = None, unk_id: int | None = None, pad_id: int | None = None,
                 add_bos: bool = False, chat_template: str | None = None, extra_stop_names=_STOP_NAMES):
        from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

        tokens = [str(t) for t in tokens]
        n = len(tokens)
        if n == 0:
            raise TokenizerError("tokenizer has no tokens")
        if token_types is not None and len(token_types) != n:
            raise TokenizerError(f"token_type has {len(token_types)} entries for {n} tokens")
        vocab: dict[str, int] = {}
        for i, t in enumerate(tokens):
            vocab.setdefault(t, i)  # a duplicate string keeps its first id (llama.cpp does the same)
        pairs = []
        for m in merges:
            if isinstance(m, str):
                a, sep, b = m.partition(" ")
                if not sep:
                    raise TokenizerError(f"merge {m!r} is not of the form 'left right'")
            else:
                a, b = m
            pairs.append((a, b))
        pre = (pre or "default").lower()
        if pre in _DIGIT_SPLIT_PRE:
            pt = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                          pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
        elif pre in _PLAIN_PRE:
            pt = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        else:
            raise TokenizerError(f"unsupported BPE pre-tokenizer {pre!r} (kimijax supports "
                                 f"{', '.join(_DIGIT_SPLIT_PRE + _PLAIN_PRE)})")
        tk = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
        tk.pre_tokenizer = pt
        tk.decoder = decoders.ByteLevel()
        special = [i for i, ty in enumerate(token_types or ()) if ty in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED)]
        if special:
            tk.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False) for i in special])
        for i in special:
            if tk.token_to_id(tokens[i]) != i:
                raise TokenizerError(f"special token {tokens[i]!r} maps to id {tk.token_to_id(tokens[i])}, not {i}")
        self._tk = tk
        self.tokens = tokens
        self.pre = pre
        self._special_ids = frozenset(special)
        self._vocab_size = n
        for nm, v in (("bos", bos_id), ("eos", eos_id), ("unk", unk_id), ("pad", pad_id)):
            if v is not None and not 0 <= v < n:
                raise TokenizerError(f"{nm}_token_id={v} outside the vocabulary [0, {n})")
        self._bos, self._eos, self._unk, self._pad = bos_id, eos_id, unk_id, pad_id
        self.add_bos = bool(add_bos)
        self.chat_template = chat_template
        self._jinja = None
        stops = [] if eos_id is None else [eos_id]
        for name in extra_stop_names:
            i = vocab.get(name)
            if i is not None and i in self._special_ids and i not in stops:
                stops.append(i)
        self._stop_ids = tuple(stops)

    # ---- construction from a GGUF -------------------------------------------------------

    @classmethod
    def from_gguf_fields(cls, fields: Mapping[str, Any]) -> "HFTokenizer":
        """From GGUF metadata as a plain dict (key -> python value), e.g. `gguf_loading.gguf_metadata(reader)`."""
        model = fields.get("tokenizer.ggml.model")
        if model != "gpt2":
            raise TokenizerError(f"unsupported GGUF tokenizer model {model!r} (kimijax supports 'gpt2' byte-level BPE)")
        for k in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"):
            if k not in fields:
                raise TokenizerError(f"GGUF metadata lacks {k}")

        def opt_int(k):
            v = fields.get(k)
            return None if v is None else int(v)

        return cls(fields["tokenizer.ggml.tokens"], fields["tokenizer.ggml.merges"],
                   fields.get("tokenizer.ggml.token_type"), pre=fields.get("tokenizer.ggml.pre", "default"),
                   bos_id=opt_int("tokenizer.ggml.bos_token_id"), eos_id=opt_int("tokenizer.ggml.eos_token_id"),
                   unk_id=opt_int("tokenizer.ggml.unknown_token_id"),
                   pad_id=opt_int("tokenizer.ggml.padding_token_id"),
                   add_bos=bool(fields.get("tokenizer.ggml.add_bos_token", False)),
                   chat_template=fields.get("tokenizer.chat_template"))

    @property
    def backend(self):
        """The underlying `tokenizers.Tokenizer`."""
        return self._tk

    # ---- ids ------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def bos_id(self) -> int | None:
        return self._bos

    @property
    def eos_id(self) -> int | None:
        return self._eos

    @property
    def pad_id(self) -> int | None:
        return self._pad

    @property
    def unk_id(self) -> int | None:
        return self._unk

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """Ids that end a generation: the eos id, then <|im_end|> / <|endoftext|> (when they are special tokens)."""
        return self._stop_ids

    def _name(self, i):
        return None if i is None else self.tokens[i]

    @property
    def bos_token(self) -> str | None:
        return self._name(self._bos)

    @property
    def eos_token(self) -> str | None:
        return self._name(self._eos)

    @property
    def pad_token(self) -> str | None:
        return self._name(self._pad)

    @property
    def unk_token(self) -> str | None:
        return self._name(self._unk)

    def id_of(self, name: str) -> int:
        i = self._tk.token_to_id(name)
        if i is None:
            raise TokenizerError(f"{name!r} is not a token of this tokenizer")
        return i

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_ids

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes of one id (special ids: their name in UTF-8)."""
        return self.decode_bytes([token_id])

    # ---- encode / decode ------------------------------------------------------------------

    def encode(self, text: str, allow_special: bool = True) -> list[int]:
        """Text -> ids (no BOS unless the GGUF asks for one). With allow_special, special-token names in the
        text become their ids; otherwise they are encoded as plain text."""
        if not isinstance(text, str):
            raise TypeError(f"encode() wants str, got {type(text).__name__}")
        self._tk.encode_special_tokens = not allow_special
        try:
            ids = self._tk.encode(text, add_special_tokens=False).ids
        finally:
            self._tk.encode_special_tokens = False
        if self.add_bos and self._bos is not None:
            ids = [self._bos] + ids
        return ids

    def decode(self, ids: Sequence[int], errors: str = "replace") -> str:
        """Ids -> text; special ids decode to their names; invalid UTF-8 per `errors`."""
        return self.decode_bytes(ids).decode("utf-8", errors=errors)

    def decode_bytes(self, ids: Sequence[int]) -> bytes:
        out = bytearray()
        byte_of = _unicode_to_bytes()
        for i in ids:
            i = int(i)
            if not 0 <= i < self._vocab_size:
                raise ValueError(f"token id {i} outside the vocabulary (valid ids: [0, {self._vocab_size}))")
            t = self.tokens[i]
            if i in self._special_ids:
                out += t.encode("utf-8")
            else:
                out += bytes(byte_of[ch] if ch in byte_of else 0x3F for ch in t)
        return bytes(out)

    # ---- chat -----------------------------------------------------------------------------

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                            tools: Sequence[Mapping[str, Any]] | None = None, **template_kwargs: Any) -> str:
        """Render a conversation with the GGUF's jinja chat template (as HF's apply_chat_template does)."""
        if self.chat_template is None:
            raise TokenizerError("this tokenizer has no chat template (GGUF key tokenizer.chat_template)")
        if self._jinja is None:
            self._jinja = _compile_jinja(self.chat_template)
        ctx = dict(messages=list(messages), tools=list(tools) if tools else None,
                   add_generation_prompt=add_generation_prompt, bos_token=self.bos_token or "",
                   eos_token=self.eos_token or "", pad_token=self.pad_token or "", unk_token=self.unk_token or "")
        ctx.update(template_kwargs)
        return self._jinja.render(**ctx)

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                    tools: Sequence[Mapping[str, Any]] | None = None, **kwargs: Any) -> list[int]:
        """`encode(apply_chat_template(...), allow_special=True)`."""
        return self.encode(self.apply_chat_template(messages, add_generation_prompt, tools, **kwargs),
                           allow_special=True)

    def __repr__(self) -> str:
        return (f"HFTokenizer(vocab_size={self.vocab_size}, pre={self.pre!r}, bos_id={self.bos_id}, "
                f"eos_id={self.eos_id}, stop_ids={self.stop_ids}, "
                f"chat_template={'jinja' if self.chat_template else None})")


_U2B: dict[str, int] | None = None


def _unicode_to_bytes() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode (the alphabet byte-level BPE tokens are written in)."""
    global _U2B
    if _U2B is None:
        bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
            list(range(ord("®"), ord("ÿ") + 1))
        cs = bs[:]
        n = 0
        for b in range(256):
            if b not in bs:
                bs.append(b)
                cs.append(256 + n)
                n += 1
        _U2B = {chr(c): b for b, c in zip(bs, cs)}
    return _U2B


__all__ = ["HFTokenizer", "TokenizerError"]
