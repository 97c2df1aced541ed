"""Kimi K2.x tokenizer: tiktoken byte-level BPE + Kimi special tokens + K2 chat format.

Ground truth is Moonshot's remote code (`tokenization_kimi.py`, class `TikTokenTokenizer`):

* `tiktoken.model`: one `base64(token_bytes) rank` line per base token (163584 for K2.x, ids
  0..163583). We parse it ourselves (same format as `tiktoken.load.load_tiktoken_bpe`), so no
  cache file is written, nothing touches the network, and a bad line is reported by number.
* Special ids `num_base .. num_base + 256 + 1` (258 ids) are registered under the names of
  `tokenizer_config.json` `added_tokens_decoder`, otherwise as `<|reserved_token_{id}|>`.
  NOTE: for the real K2.x checkpoints this makes ids 163840 and 163841 valid *tokenizer* ids
  although the embedding has only 163840 rows (`[PAD]` = 163839 is its last row), exactly as in
  the remote code; text never produces them unless it literally contains their reserved names.
* Pre-tokenization uses Kimi's `pat_str` (`PAT_STR`), which needs character-class intersection
  (`&&[^\\p{Han}]`); tiktoken's Rust regex compiles it. `pre_tokenize()` mirrors the split with the
  `regex` module in V1 mode (V0 does not understand `&&`) for diagnostics.
* Inputs longer than 400k characters, or with runs of more than 25k whitespace / non-whitespace
  characters, are cut into pieces before encoding, like the remote code.

Chat: `apply_chat_template` renders the checkpoint's `chat_template.jinja` (or a `chat_template`
string in `tokenizer_config.json`) with a HF-compatible jinja2 environment when there is one, and
otherwise a built-in K2-Instruct format (see `render_k2_chat`).

`kimijax.tokenizer_tiny.write_tiny_tokenizer(path, vocab_size)` writes a small valid Kimi-style tokenizer dir
(256 byte tokens + merges learned from built-in English text + the Kimi special table at the real offsets).
"""

from __future__ import annotations

import base64
import binascii
import json
import os
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import tiktoken

__all__ = [
    "KimiTokenizer",
    "TokenizerError",
    "PAT_STR",
    "NUM_RESERVED_SPECIAL_TOKENS",
    "NUM_SPECIAL_IDS",
    "KIMI_SPECIAL_OFFSETS",
    "K2_DEFAULT_SYSTEM",
    "pre_tokenize",
    "render_k2_chat",
    "load_bpe_ranks",
]


class TokenizerError(ValueError):
    """A tokenizer file is missing or malformed (the message names the file, and the line)."""


# --------------------------------------------------------------------------------------------
# Constants
# --------------------------------------------------------------------------------------------

#: Kimi's pre-tokenization pattern (8 alternatives; `&&` is character-class intersection).
PAT_STR = "|".join(
    [
        r"[\p{Han}]+",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
        r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
        r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"\p{N}{1,3}",
        r" ?[^\s\p{L}\p{N}]+[\r\n]*",
        r"\s*[\r\n]+",
        r"\s+(?!\S)",
        r"\s+",
    ]
)

NUM_RESERVED_SPECIAL_TOKENS = 256
#: The remote code registers `num_reserved_special_tokens + 2` special ids.
NUM_SPECIAL_IDS = NUM_RESERVED_SPECIAL_TOKENS + 2

#: The remote code's chunking limits (characters).
TIKTOKEN_MAX_ENCODE_CHARS = 400_000
MAX_NO_WHITESPACES_CHARS = 25_000

#: Named special tokens of K2.x as offsets from num_base_tokens (163584 + k in the real table).
#: K2.5/K2.6 add the media and think tokens (offsets 18..23).
KIMI_SPECIAL_OFFSETS: dict[str, int] = {
    "[BOS]": 0,
    "[EOS]": 1,
    "<|im_end|>": 2,
    "<|im_user|>": 3,
    "<|im_assistant|>": 4,
    "<|start_header_id|>": 6,
    "<|end_header_id|>": 7,
    "[EOT]": 9,
    "<|im_system|>": 10,
    "<|tool_calls_section_begin|>": 11,
    "<|tool_calls_section_end|>": 12,
    "<|tool_call_begin|>": 13,
    "<|tool_call_argument_begin|>": 14,
    "<|tool_call_end|>": 15,
    "<|im_middle|>": 17,
    "<|media_begin|>": 18,
    "<|media_content|>": 19,
    "<|media_end|>": 20,
    "<|media_pad|>": 21,
    "<think>": 22,
    "</think>": 23,
    "[UNK]": 254,
    "[PAD]": 255,
}

#: Default system prompt that K2-Instruct / K2-Thinking templates inject (K2.5/K2.6 do not).
K2_DEFAULT_SYSTEM = "You are Kimi, an AI assistant created by Moonshot AI."

IM_SYSTEM, IM_USER, IM_ASSISTANT = "<|im_system|>", "<|im_user|>", "<|im_assistant|>"
IM_MIDDLE, IM_END = "<|im_middle|>", "<|im_end|>"

_VOCAB_FILE = "tiktoken.model"
_CONFIG_FILE = "tokenizer_config.json"
_TEMPLATE_FILE = "chat_template.jinja"

_PRETOKENIZE_RE = None


def pre_tokenize(text: str) -> list[str]:
    """Split `text` into the pieces Kimi's `PAT_STR` produces (BPE never merges across them).

    Uses the `regex` module in V1 mode (set operations). tiktoken's Rust engine is the ground
    truth for encoding; this is for inspection and tests.
    """
    global _PRETOKENIZE_RE
    if _PRETOKENIZE_RE is None:
        import regex

        _PRETOKENIZE_RE = regex.compile(PAT_STR, regex.V1)
    return _PRETOKENIZE_RE.findall(text)


# --------------------------------------------------------------------------------------------
# File loading
# --------------------------------------------------------------------------------------------


def load_bpe_ranks(path: str | os.PathLike) -> dict[bytes, int]:
    """Parse a tiktoken BPE file (`base64(token) rank` per line; blank lines skipped).

    Same result as `tiktoken.load.load_tiktoken_bpe` for a valid file, but offline, cache-free and
    strict: ranks must be exactly 0..n-1 with no duplicate token or rank, and all 256 single
    bytes must be present (byte-level BPE needs them). Raises TokenizerError naming file + line.
    """
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise TokenizerError(f"{path}: tokenizer vocabulary file not found") from None
    except OSError as e:
        raise TokenizerError(f"{path}: cannot read tokenizer vocabulary: {e}") from e
    ranks: dict[bytes, int] = {}
    seen_ranks: dict[int, int] = {}
    for lineno, line in enumerate(data.splitlines(), start=1):
        if not line.strip():
            continue
        parts = line.split()
        if len(parts) != 2:
            raise TokenizerError(
                f"{path}:{lineno}: expected 'base64_token rank', got {line[:80]!r}"
            )
        b64, rank_s = parts
        try:
            token = base64.b64decode(b64, validate=True)
        except (binascii.Error, ValueError) as e:
            raise TokenizerError(f"{path}:{lineno}: bad base64 token {b64[:60]!r}: {e}") from None
        try:
            rank = int(rank_s)
        except ValueError:
            raise TokenizerError(f"{path}:{lineno}: bad rank {rank_s[:40]!r}") from None
        if rank < 0:
            raise TokenizerError(f"{path}:{lineno}: negative rank {rank}")
        if not token:
            raise TokenizerError(f"{path}:{lineno}: empty token")
        if token in ranks:
            raise TokenizerError(
                f"{path}:{lineno}: duplicate token {token!r} (already rank {ranks[token]})"
            )
        if rank in seen_ranks:
            raise TokenizerError(
                f"{path}:{lineno}: duplicate rank {rank} (already on line {seen_ranks[rank]})"
            )
        ranks[token] = rank
        seen_ranks[rank] = lineno
    if not ranks:
        raise TokenizerError(f"{path}: empty tokenizer vocabulary")
    n = len(ranks)
    if max(seen_ranks) != n - 1:
        missing = next(i for i in range(n) if i not in seen_ranks)
        raise TokenizerError(
            f"{path}: ranks must be 0..{n - 1} without gaps; rank {missing} is missing "
            f"(max rank {max(seen_ranks)})"
        )
    missing_bytes = [b for b in range(256) if bytes([b]) not in ranks]
    if missing_bytes:
        raise TokenizerError(
            f"{path}: byte-level BPE needs all 256 single-byte tokens; "
            f"{len(missing_bytes)} missing (first: {bytes([missing_bytes[0]])!r})"
        )
    return ranks


def _read_json(path: Path) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
    except json.JSONDecodeError as e:
        raise TokenizerError(f"{path}:{e.lineno}: invalid JSON: {e.msg}") from None
    except OSError as e:
        raise TokenizerError(f"{path}: cannot read: {e}") from e
    if not isinstance(obj, dict):
        raise TokenizerError(f"{path}: expected a JSON object at top level")
    return obj


def _token_name(v: Any) -> str | None:
    """`bos_token` etc. are a string or an AddedToken dict {"content": ...}."""
    if isinstance(v, str):
        return v
    if isinstance(v, Mapping) and isinstance(v.get("content"), str):
        return v["content"]
    return None


def _split_whitespaces_or_nonwhitespaces(s: str, max_len: int) -> Iterator[str]:
    """Cut `s` so no piece holds a run of more than `max_len` whitespace / non-whitespace chars.

    Same cut points as the remote code's helper of the same name.
    """
    run_len = 0
    run_is_space = s[0].isspace() if s else False
    start = 0
    for i, ch in enumerate(s):
        is_space = ch.isspace()
        if run_is_space ^ is_space:
            run_len = 1
            run_is_space = is_space
        else:
            run_len += 1
            if run_len > max_len:
                yield s[start:i]
                start = i
                run_len = 1
    yield s[start:]


# --------------------------------------------------------------------------------------------
# Chat template
# --------------------------------------------------------------------------------------------


def _content_text(content: Any, role: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, (list, tuple)):
        out = []
        for part in content:
            if isinstance(part, str):
                out.append(part)
            elif isinstance(part, Mapping) and part.get("type", "text") == "text":
                out.append(str(part.get("text", "")))
            else:
                kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                raise ValueError(
                    f"{role} message has a {kind!r} content part; the built-in K2 chat format "
                    "renders text only (use a checkpoint with chat_template.jinja for media)"
                )
        return "".join(out)
    raise ValueError(f"{role} message content must be str, list or None, got {type(content)}")


def render_k2_chat(
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool = True,
    tools: Sequence[Mapping[str, Any]] | None = None,
    default_system: str | None = None,
) -> str:
    """The K2-Instruct chat format, turns back to back with no separators.

    * tools (non-empty): leading `<|im_system|>tool_declare<|im_middle|>{compact JSON}<|im_end|>`
    * default_system (K2-Instruct / K2-Thinking use K2_DEFAULT_SYSTEM; K2.5/K2.6 none): a
      `<|im_system|>system<|im_middle|>{default_system}<|im_end|>` turn when messages is
      non-empty and does not start with a system message.
    * each message: `{open}{name}<|im_middle|>{body}<|im_end|>` where open is `<|im_user|>`
      for user, `<|im_assistant|>` for assistant, `<|im_system|>` otherwise (system, tool, ...),
      and name is `message["name"]` if set, else the role.
    * assistant tool_calls: body = content + `<|tool_calls_section_begin|>` +
      `<|tool_call_begin|>{id}<|tool_call_argument_begin|>{arguments}<|tool_call_end|>`... +
      `<|tool_calls_section_end|>` (arguments verbatim if a string, else JSON).
    * tool: body = `## Return of {tool_call_id}\\n{content}`.
    * generation prompt: `<|im_assistant|>assistant<|im_middle|>`.
    """
    out: list[str] = []
    if tools:
        tools_json = json.dumps(list(tools), separators=(",", ":"), ensure_ascii=False)
        out.append(f"{IM_SYSTEM}tool_declare{IM_MIDDLE}{tools_json}{IM_END}")
    if messages and default_system and messages[0].get("role") != "system":
        out.append(f"{IM_SYSTEM}system{IM_MIDDLE}{default_system}{IM_END}")
    for i, msg in enumerate(messages):
        if not isinstance(msg, Mapping) or "role" not in msg:
            raise ValueError(f"message {i} must be a mapping with a 'role' key, got {msg!r}")
        role = str(msg["role"])
        name = msg.get("name") or role
        opener = {"user": IM_USER, "assistant": IM_ASSISTANT}.get(role, IM_SYSTEM)
        out.append(f"{opener}{name}{IM_MIDDLE}")
        if role == "assistant" and msg.get("tool_calls"):
            if msg.get("content"):
                out.append(_content_text(msg["content"], role))
            out.append("<|tool_calls_section_begin|>")
            for tc in msg["tool_calls"]:
                fn = tc.get("function", {})
                args = fn.get("arguments", "")
                if not isinstance(args, str):
                    args = json.dumps(args, ensure_ascii=False)
                out.append(
                    f"<|tool_call_begin|>{tc.get('id', '')}<|tool_call_argument_begin|>"
                    f"{args}<|tool_call_end|>"
                )
            out.append("<|tool_calls_section_end|>")
        elif role == "tool":
            out.append(
                f"## Return of {msg.get('tool_call_id', '')}\n"
                f"{_content_text(msg.get('content'), role)}"
            )
        else:
            out.append(_content_text(msg.get("content"), role))
        out.append(IM_END)
    if add_generation_prompt:
        out.append(f"{IM_ASSISTANT}assistant{IM_MIDDLE}")
    return "".join(out)


def _compile_jinja(source: str):
    """A jinja2 template in a HF-compatible environment (trim/lstrip blocks, json tojson)."""
    import datetime

    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    def strftime_now(fmt):
        return datetime.datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(source)


# --------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------

_UNSET: Any = object()


class KimiTokenizer:
    """Kimi K2.x tokenizer (tiktoken BPE + 258 special ids + chat template).

    Build with `KimiTokenizer.from_dir(path)` (or the constructor with already-parsed parts).
    """

    def __init__(
        self,
        mergeable_ranks: dict[bytes, int],
        added_tokens: Mapping[int, str] | None = None,
        *,
        bos_token: str | None = "[BOS]",
        eos_token: str | None = "[EOS]",
        pad_token: str | None = "[PAD]",
        unk_token: str | None = "[UNK]",
        chat_template: str | None = None,
        default_system: str | None = None,
        name: str = "kimi",
    ):
        self.num_base_tokens = len(mergeable_ranks)
        added = {int(k): v for k, v in (added_tokens or {}).items()}
        nb = self.num_base_tokens
        # like the remote code: {added.get(i, reserved): i for i in range(nb, nb + 258)}
        self.special_tokens: dict[str, int] = {
            added.get(i, f"<|reserved_token_{i}|>"): i for i in range(nb, nb + NUM_SPECIAL_IDS)
        }
        self._enc = tiktoken.Encoding(
            name=name,
            pat_str=PAT_STR,
            mergeable_ranks=mergeable_ranks,
            special_tokens=self.special_tokens,
        )
        self._special_ids = frozenset(self.special_tokens.values())
        self.chat_template = chat_template
        self._jinja = None
        self.default_system = default_system
        self.bos_token = bos_token if bos_token in self.special_tokens else None
        self.eos_token = eos_token if eos_token in self.special_tokens else None
        self.pad_token = pad_token if pad_token in self.special_tokens else None
        self.unk_token = unk_token if unk_token in self.special_tokens else None
        stops = [self.eos_token, "[EOS]", IM_END]
        self.stop_ids: list[int] = list(
            dict.fromkeys(self.special_tokens[s] for s in stops if s in self.special_tokens)
        )

    # ---- construction ------------------------------------------------------------------

    @classmethod
    def from_dir(cls, path: str | os.PathLike, *, default_system: str | None = None) -> "KimiTokenizer":
        """Load `tiktoken.model`, `tokenizer_config.json` (optional) and `chat_template.jinja`
        (optional; else a `chat_template` string in the config; else the built-in K2 format)."""
        path = Path(path)
        if not path.is_dir():
            raise TokenizerError(f"{path}: not a tokenizer directory")
        ranks = load_bpe_ranks(path / _VOCAB_FILE)
        cfg: dict = {}
        if (path / _CONFIG_FILE).is_file():
            cfg = _read_json(path / _CONFIG_FILE)
        added: dict[int, str] = {}
        atd = cfg.get("added_tokens_decoder", {}) or {}
        if not isinstance(atd, Mapping):
            raise TokenizerError(f"{path / _CONFIG_FILE}: added_tokens_decoder must be an object")
        for k, v in atd.items():
            content = _token_name(v)
            try:
                tid = int(k)
            except ValueError:
                raise TokenizerError(
                    f"{path / _CONFIG_FILE}: added_tokens_decoder key {k!r} is not an integer id"
                ) from None
            if content is None:
                raise TokenizerError(
                    f"{path / _CONFIG_FILE}: added_tokens_decoder[{k!r}] has no 'content' string"
                )
            added[tid] = content
        template = None
        if (path / _TEMPLATE_FILE).is_file():
            template = (path / _TEMPLATE_FILE).read_text(encoding="utf-8")
        elif isinstance(cfg.get("chat_template"), str):
            template = cfg["chat_template"]
        kw = {}
        for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
            if key in cfg:
                kw[key] = _token_name(cfg[key])
        return cls(
            ranks,
            added,
            chat_template=template,
            default_system=default_system,
            name=str(path / _VOCAB_FILE),
            **kw,
        )

    # ---- vocabulary --------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Number of tokenizer ids: num_base_tokens + 258 (163842 for K2.x, whose embedding
        has 163840 rows)."""
        return self._enc.n_vocab

    @property
    def bos_id(self) -> int | None:
        return self.special_tokens[self.bos_token] if self.bos_token else None

    @property
    def eos_id(self) -> int | None:
        return self.special_tokens[self.eos_token] if self.eos_token else None

    @property
    def pad_id(self) -> int | None:
        return self.special_tokens[self.pad_token] if self.pad_token else None

    @property
    def unk_id(self) -> int | None:
        return self.special_tokens[self.unk_token] if self.unk_token else None

    def id_of(self, name: str) -> int:
        """Id of a special token name (e.g. "<|im_end|>"), or of a string that is one base token."""
        if name in self.special_tokens:
            return self.special_tokens[name]
        try:
            return self._enc.encode_single_token(name.encode("utf-8"))
        except KeyError:
            raise KeyError(f"{name!r} is neither a special token nor a single base token") from None

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_ids

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes of one id (special ids: their name in UTF-8)."""
        return self._enc.decode_single_token_bytes(token_id)

    # ---- encode / decode ---------------------------------------------------------------

    def encode(self, text: str, allow_special: bool = True) -> list[int]:
        """Text -> ids. With allow_special, rendered special-token names in the text become their
        special ids (the remote code's `allowed_special="all"`); otherwise they are plain text."""
        if not isinstance(text, str):
            raise TypeError(f"encode() wants str, got {type(text).__name__}")
        allowed = "all" if allow_special else set()
        if len(text) <= MAX_NO_WHITESPACES_CHARS:  # no run can exceed the limit: one piece
            return self._enc.encode(text, allowed_special=allowed, disallowed_special=())
        ids: list[int] = []
        for i in range(0, len(text), TIKTOKEN_MAX_ENCODE_CHARS):
            for piece in _split_whitespaces_or_nonwhitespaces(
                text[i : i + TIKTOKEN_MAX_ENCODE_CHARS], MAX_NO_WHITESPACES_CHARS
            ):
                ids.extend(self._enc.encode(piece, allowed_special=allowed, disallowed_special=()))
        return ids

    def decode_bytes(self, ids: Sequence[int]) -> bytes:
        return self._enc.decode_bytes([int(i) for i in ids])

    def decode(self, ids: Sequence[int], errors: str = "replace") -> str:
        """Ids -> text; special ids decode to their names; invalid UTF-8 per `errors`."""
        try:
            return self._enc.decode([int(i) for i in ids], errors=errors)
        except KeyError as e:
            msg = e.args[0] if e.args else e
            raise ValueError(f"{msg} (valid ids: [0, {self.vocab_size}))") from None

    # ---- chat --------------------------------------------------------------------------

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        *,
        default_system: str | None = _UNSET,
        builtin: bool = False,
        **template_kwargs: Any,
    ) -> str:
        """Render a conversation to a prompt string.

        Uses the checkpoint's jinja template when there is one (unless builtin=True); extra
        keyword arguments (e.g. `thinking=False` for K2.5/K2.6) are passed to it and, like in HF,
        ignored by templates that do not use them. The built-in K2 format (`render_k2_chat`)
        ignores them; `default_system` (default: the tokenizer's setting, None = no injection)
        applies to the built-in format only.
        """
        if self.chat_template is not None and not builtin:
            if self._jinja is None:
                self._jinja = _compile_jinja(self.chat_template)
            ctx = dict(
                messages=list(messages),
                tools=list(tools) if tools else None,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                pad_token=self.pad_token or "",
                unk_token=self.unk_token or "",
            )
            ctx.update(template_kwargs)
            return self._jinja.render(**ctx)
        if default_system is _UNSET:
            default_system = self.default_system
        return render_k2_chat(messages, add_generation_prompt, tools, default_system)

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **kwargs: Any,
    ) -> list[int]:
        """`encode(apply_chat_template(...), allow_special=True)` (no BOS is added, as in K2)."""
        text = self.apply_chat_template(messages, add_generation_prompt, tools, **kwargs)
        return self.encode(text, allow_special=True)

    def __repr__(self) -> str:
        return (
            f"KimiTokenizer(num_base_tokens={self.num_base_tokens}, vocab_size={self.vocab_size}, "
            f"bos_id={self.bos_id}, eos_id={self.eos_id}, stop_ids={self.stop_ids}, "
            f"chat_template={'jinja' if self.chat_template else 'builtin'})"
        )
