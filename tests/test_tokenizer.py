"""Tests for kimijax.tokenizer (CPU only, no network, tiny tokenizer written into tmp dirs)."""

from __future__ import annotations

import base64
import json

import pytest
import tiktoken
import tiktoken.load

from kimijax.tokenizer import (
    K2_DEFAULT_SYSTEM,
    KIMI_SPECIAL_OFFSETS,
    NUM_SPECIAL_IDS,
    PAT_STR,
    KimiTokenizer,
    TokenizerError,
    _split_whitespaces_or_nonwhitespaces,
    load_bpe_ranks,
    pre_tokenize,
    render_k2_chat,
)
from kimijax.tokenizer_tiny import write_tiny_tokenizer

VOCAB = 1024
NB = VOCAB - NUM_SPECIAL_IDS  # num_base_tokens of the default tiny tokenizer


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return write_tiny_tokenizer(tmp_path_factory.mktemp("tok"), VOCAB)


@pytest.fixture(scope="module")
def tok(tiny_dir):
    return KimiTokenizer.from_dir(tiny_dir)


# ---- vocabulary / files --------------------------------------------------------------------


def test_tiny_layout(tok, tiny_dir):
    assert tok.num_base_tokens == NB
    assert tok.vocab_size == VOCAB == NB + 258
    assert len(tok.special_tokens) == 258
    for name, off in KIMI_SPECIAL_OFFSETS.items():
        assert tok.special_tokens[name] == NB + off == tok.id_of(name)
    assert tok.bos_id == NB and tok.eos_id == NB + 1 and tok.pad_id == NB + 255
    assert tok.unk_id == NB + 254
    assert tok.stop_ids == [NB + 1, NB + 2]  # [EOS], <|im_end|>
    # unnamed ids get reserved names carrying the absolute id; the last 2 ids are the "+2"
    for i in (NB + 5, NB + 8, NB + 100, NB + 256, NB + 257):
        assert tok.special_tokens[f"<|reserved_token_{i}|>"] == i
    # the file parses the same with tiktoken's own loader
    ranks = load_bpe_ranks(tiny_dir / "tiktoken.model")
    assert sorted(ranks.values()) == list(range(NB))
    assert all(bytes([b]) in ranks for b in range(256))


def test_load_matches_tiktoken_loader(tiny_dir, monkeypatch):
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", "")  # no cache write
    ref = tiktoken.load.load_tiktoken_bpe(str(tiny_dir / "tiktoken.model"))
    assert load_bpe_ranks(tiny_dir / "tiktoken.model") == ref


def test_common_words_are_single_tokens(tok):
    for w in ["The", " the", " model", " token", " and", " that"]:
        assert len(tok.encode(w)) == 1, w
    ids = tok.encode("The quick brown fox jumps over the lazy dog.")
    assert len(ids) <= 12


def test_vocab_size_checks(tmp_path):
    with pytest.raises(ValueError, match="vocab_size must be >= 514"):
        write_tiny_tokenizer(tmp_path / "a", 512)
    with pytest.raises(ValueError):
        write_tiny_tokenizer(tmp_path / "b", 1024, num_base_tokens=800)
    t = KimiTokenizer.from_dir(write_tiny_tokenizer(tmp_path / "c", 514))  # bytes only
    assert t.num_base_tokens == 256 and t.vocab_size == 514
    assert t.decode(t.encode("héllo 世界")) == "héllo 世界"
    t = KimiTokenizer.from_dir(write_tiny_tokenizer(tmp_path / "d", 2048, num_base_tokens=600))
    assert t.num_base_tokens == 600 and t.vocab_size == 858 and t.bos_id == 600
    # more ids than the corpus can teach: filled deterministically, still a valid vocab
    t = KimiTokenizer.from_dir(write_tiny_tokenizer(tmp_path / "e", 3000))
    assert t.num_base_tokens == 3000 - 258


# ---- encode / decode -----------------------------------------------------------------------

TEXTS = [
    "",
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "你好，世界！我们今天学习中文。",
    "中文和English混合Mixed在一起",
    "digits 1 22 333 4444 123456789 3.14159 -42",
    "punct: !?...;:--()[]{}<>@#$%^&*_+=|\\/~`'\"",
    "line1\nline2\r\n\n\ttabbed    spaces   \n  ",
    "emoji 🎉🚀😀 and 👩‍👩‍👧 family",
    "don't I'M they'll WE'VE she'd it's",
    "Ünïcödé ñ façade naïve Ελληνικά русский עברית العربية हिन्दी 日本語のテキスト 한국어",
    "def f(x):\n    return x ** 2  # comment\n",
    "<|im_end|> literal <|im_user|>",
    " leading and trailing spaces  ",
    "\u200bzero\u00a0width\u2028sep",
]


@pytest.mark.parametrize("text", TEXTS)
def test_roundtrip(tok, text):
    ids = tok.encode(text, allow_special=False)
    assert all(0 <= i < tok.num_base_tokens for i in ids)
    assert tok.decode(ids) == text
    ids2 = tok.encode(text)
    assert tok.decode(ids2) == text
    assert tok.decode_bytes(ids2) == text.encode("utf-8")


def test_matches_plain_tiktoken(tok, tiny_dir):
    ref = tiktoken.Encoding(
        name="ref",
        pat_str=PAT_STR,
        mergeable_ranks=load_bpe_ranks(tiny_dir / "tiktoken.model"),
        special_tokens=tok.special_tokens,
    )
    for text in TEXTS:
        assert tok.encode(text) == ref.encode(text, allowed_special="all")
        assert tok.encode(text, allow_special=False) == ref.encode_ordinary(text)


def test_decode_errors(tok):
    bad = tok.encode("é")  # two byte tokens
    assert len(bad) == 2
    assert tok.decode(bad[:1]) == "\ufffd"
    with pytest.raises(ValueError):
        tok.decode([tok.vocab_size + 5])


# ---- pre-tokenization ----------------------------------------------------------------------

PRE_CASES = [
    ("123456", ["123", "456"]),
    ("1234567", ["123", "456", "7"]),
    ("abc中文def", ["abc", "中文", "def"]),
    ("Hello世界", ["Hello", "世界"]),
    ("don't", ["don't"]),
    ("I DON'T", ["I", " DON'T"]),
    ("Hello world", ["Hello", " world"]),
    ("camelCase", ["camel", "Case"]),
    ("HTTPServer", ["HTTPServer"]),
    ("x = 1;\n\ny", ["x", " =", " ", "1", ";\n\n", "y"]),
    ("a  b", ["a", " ", " b"]),
    ("end \n", ["end", " \n"]),
    ("你好，世界", ["你好", "，", "世界"]),
]


@pytest.mark.parametrize("text,expected", PRE_CASES)
def test_pre_tokenize(text, expected):
    assert pre_tokenize(text) == expected
    assert "".join(pre_tokenize(text)) == text


def test_pre_tokenize_matches_tiktoken():
    """Ground truth: tiktoken (Rust regex with `&&`). Build a vocab holding every piece of our
    split as a whole token; tiktoken returns a whole-piece token only when its own split yields
    exactly that piece, so equal token lists mean equal splits."""
    text = "\n".join(TEXTS + [t for t, _ in PRE_CASES])
    pieces = pre_tokenize(text)
    ranks = {bytes([b]): b for b in range(256)}
    for p in pieces:
        ranks.setdefault(p.encode("utf-8"), len(ranks))
    enc = tiktoken.Encoding(name="split", pat_str=PAT_STR, mergeable_ranks=ranks, special_tokens={})
    got = [enc.decode_single_token_bytes(i) for i in enc.encode_ordinary(text)]
    assert got == [p.encode("utf-8") for p in pieces]


def test_tokens_never_cross_pieces(tok):
    text = "Hello世界 123456 don't\n\n  the model"
    piece_bounds, pos = set(), 0
    for p in pre_tokenize(text):
        pos += len(p.encode("utf-8"))
        piece_bounds.add(pos)
    tok_bounds, pos = set(), 0
    for i in tok.encode(text):
        pos += len(tok.token_bytes(i))
        tok_bounds.add(pos)
    assert piece_bounds <= tok_bounds  # every piece boundary is a token boundary


# ---- special tokens ------------------------------------------------------------------------


def test_special_tokens_in_text(tok):
    im_end = tok.id_of("<|im_end|>")
    assert tok.encode("<|im_end|>") == [im_end]
    plain = tok.encode("<|im_end|>", allow_special=False)
    assert im_end not in plain and len(plain) > 1
    assert not any(tok.is_special(i) for i in plain)
    assert tok.decode(plain) == "<|im_end|>"
    ids = tok.encode("hi<|im_user|>user<|im_middle|>x<|im_end|>")
    assert tok.id_of("<|im_user|>") in ids and tok.id_of("<|im_middle|>") in ids
    assert tok.decode(ids) == "hi<|im_user|>user<|im_middle|>x<|im_end|>"
    r = f"<|reserved_token_{NB + 5}|>"
    assert tok.encode(r) == [NB + 5] and tok.decode([NB + 5]) == r
    assert tok.decode([tok.bos_id, tok.eos_id]) == "[BOS][EOS]"
    assert tok.id_of(" the") == tok.encode(" the")[0]
    with pytest.raises(KeyError):
        tok.id_of("<|nope|>")


def test_config_eos_and_missing_names(tmp_path):
    d = write_tiny_tokenizer(tmp_path / "t", 600)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["eos_token"] = {"content": "<|im_end|>"}  # AddedToken-dict form
    cfg["added_tokens_decoder"]["9999"] = {"content": "<|out_of_range|>"}  # ignored, like remote
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    t = KimiTokenizer.from_dir(d)
    nb = t.num_base_tokens
    assert t.eos_id == nb + 2
    assert t.stop_ids == [nb + 2, nb + 1]
    assert "<|out_of_range|>" not in t.special_tokens
    (d / "tokenizer_config.json").unlink()
    t = KimiTokenizer.from_dir(d)  # no config: every special id reserved
    assert t.bos_id is None and t.stop_ids == []
    assert t.special_tokens[f"<|reserved_token_{nb}|>"] == nb


def test_long_input_chunking(tok):
    pieces = list(_split_whitespaces_or_nonwhitespaces("aaaaa  bb   ", 2))
    assert pieces == ["aa", "aa", "a  bb  ", " "]
    assert "".join(pieces) == "aaaaa  bb   "
    assert list(_split_whitespaces_or_nonwhitespaces("", 3)) == [""]
    text = "x" * 60_000 + " " * 30_000 + "the end"
    ids = tok.encode(text)
    assert tok.decode(ids) == text


# ---- chat template -------------------------------------------------------------------------

SYS_USER = [
    {"role": "system", "content": "You are helpful."},
    {"role": "user", "content": "Hi there"},
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
TOOL_CONV = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "functions.get_weather:0",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "sunny, 21C"},
]


def test_chat_system_user(tok):
    s = tok.apply_chat_template(SYS_USER)
    assert s == (
        "<|im_system|>system<|im_middle|>You are helpful.<|im_end|>"
        "<|im_user|>user<|im_middle|>Hi there<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|>"
    )
    s2 = tok.apply_chat_template(
        SYS_USER + [{"role": "assistant", "content": "Hello!"}], add_generation_prompt=False
    )
    assert s2.endswith("<|im_assistant|>assistant<|im_middle|>Hello!<|im_end|>")


def test_chat_tools(tok):
    s = tok.apply_chat_template(TOOL_CONV, tools=TOOLS)
    assert s == (
        "<|im_system|>tool_declare<|im_middle|>"
        '[{"type":"function","function":{"name":"get_weather","description":"Get weather",'
        '"parameters":{"type":"object","properties":{"city":{"type":"string"}}}}}]<|im_end|>'
        "<|im_user|>user<|im_middle|>Weather in Paris?<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|><|tool_calls_section_begin|>"
        '<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris"}'
        "<|tool_call_end|><|tool_calls_section_end|><|im_end|>"
        "<|im_system|>tool<|im_middle|>## Return of functions.get_weather:0\nsunny, 21C<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|>"
    )


def test_chat_default_system(tok, tiny_dir):
    user = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(user).startswith("<|im_user|>")  # K2.5/K2.6: no default
    k2 = tok.apply_chat_template(user, default_system=K2_DEFAULT_SYSTEM)
    assert k2.startswith(f"<|im_system|>system<|im_middle|>{K2_DEFAULT_SYSTEM}<|im_end|><|im_user|>")
    assert tok.apply_chat_template(SYS_USER, default_system=K2_DEFAULT_SYSTEM) == (
        tok.apply_chat_template(SYS_USER)
    )
    t = KimiTokenizer.from_dir(tiny_dir, default_system=K2_DEFAULT_SYSTEM)
    assert t.apply_chat_template(user) == k2
    # tools come before the injected default system turn
    s = render_k2_chat(user, tools=TOOLS, default_system=K2_DEFAULT_SYSTEM)
    assert s.index("tool_declare") < s.index(K2_DEFAULT_SYSTEM)


def test_chat_content_parts_and_names(tok):
    msgs = [{"role": "user", "name": "bob", "content": [{"type": "text", "text": "a"}, "b"]}]
    assert tok.apply_chat_template(msgs, add_generation_prompt=False) == (
        "<|im_user|>bob<|im_middle|>ab<|im_end|>"
    )
    with pytest.raises(ValueError):
        tok.apply_chat_template([{"role": "user", "content": [{"type": "image_url"}]}])


def test_encode_chat(tok):
    ids = tok.encode_chat(SYS_USER)
    assert ids[0] == tok.id_of("<|im_system|>")
    gen = [tok.id_of("<|im_assistant|>"), *tok.encode("assistant"), tok.id_of("<|im_middle|>")]
    assert ids[-len(gen):] == gen
    assert ids.count(tok.id_of("<|im_end|>")) == 2
    assert tok.decode(ids) == tok.apply_chat_template(SYS_USER)


# A K2-style jinja template (HF conventions: trim_blocks, lstrip_blocks, tojson with kwargs).
K2_JINJA = """\
{%- if tools -%}
<|im_system|>tool_declare<|im_middle|>{{ tools | tojson(separators=(',', ':')) }}<|im_end|>
{%- endif -%}
{%- for message in messages -%}
  {%- set role_name = message.get('name') or message['role'] -%}
  {%- if message['role'] == 'user' -%}
    <|im_user|>{{ role_name }}<|im_middle|>
  {%- elif message['role'] == 'assistant' -%}
    <|im_assistant|>{{ role_name }}<|im_middle|>
  {%- else -%}
    <|im_system|>{{ role_name }}<|im_middle|>
  {%- endif -%}
  {%- if message['role'] == 'assistant' and message.get('tool_calls') -%}
    {%- if message['content'] -%}{{ message['content'] }}{%- endif -%}
    <|tool_calls_section_begin|>
    {%- for tc in message['tool_calls'] -%}
      <|tool_call_begin|>{{ tc['id'] }}<|tool_call_argument_begin|>{{ tc['function']['arguments'] }}<|tool_call_end|>
    {%- endfor -%}
    <|tool_calls_section_end|>
  {%- elif message['role'] == 'tool' -%}
## Return of {{ message['tool_call_id'] }}
{{ message['content'] }}
  {%- else -%}
    {{ message['content'] }}
  {%- endif -%}
  <|im_end|>
{%- endfor -%}
{%- if add_generation_prompt -%}
  <|im_assistant|>assistant<|im_middle|>{% if thinking is defined and not thinking %}<think></think>{% endif %}
{%- endif -%}
"""


def test_chat_jinja_template(tmp_path, tok):
    d = write_tiny_tokenizer(tmp_path / "j", VOCAB, chat_template=K2_JINJA)
    t = KimiTokenizer.from_dir(d)
    assert t.chat_template == K2_JINJA
    for msgs, tools, gen in [(SYS_USER, None, True), (TOOL_CONV, TOOLS, True), (SYS_USER, None, False)]:
        want = render_k2_chat(msgs, gen, tools)
        assert t.apply_chat_template(msgs, gen, tools) == want
        assert t.apply_chat_template(msgs, gen, tools, builtin=True) == want
    # template kwargs reach the template
    assert t.apply_chat_template(SYS_USER, thinking=False).endswith("<|im_middle|><think></think>")
    # the template may also come from tokenizer_config.json
    (d / "chat_template.jinja").unlink()
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert KimiTokenizer.from_dir(d).apply_chat_template(SYS_USER) == "[You are helpful.][Hi there]"


# ---- errors --------------------------------------------------------------------------------


def _vocab_lines():
    return [base64.b64encode(bytes([b])).decode() + f" {b}" for b in range(256)]


@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda L: L[:2] + ["!!!notbase64 2"] + L[3:], r"tiktoken\.model:3: bad base64"),
        (lambda L: L[:2] + ["QQ== 2 extra"] + L[3:], r"tiktoken\.model:3: expected"),
        (lambda L: L[:2] + ["QQ== two"] + L[3:], r"tiktoken\.model:3: bad rank"),
        (lambda L: L + ["QUI= 5"], r"tiktoken\.model:257: duplicate rank 5"),
        (lambda L: L + ["QQ== 256"], r"tiktoken\.model:257: duplicate token"),
        (lambda L: L + ["QUI= 300"], r"rank 256 is missing"),
        (lambda L: L[:10] + L[11:] + ["QUI= 10"], r"single-byte tokens; 1 missing"),
        (lambda L: [], r"empty tokenizer vocabulary"),
    ],
)
def test_corrupt_vocab(tmp_path, mutate, match):
    (tmp_path / "tiktoken.model").write_text("\n".join(mutate(_vocab_lines())) + "\n")
    with pytest.raises(TokenizerError, match=match):
        KimiTokenizer.from_dir(tmp_path)


def test_missing_files(tmp_path):
    with pytest.raises(TokenizerError, match="tiktoken.model: tokenizer vocabulary file not found"):
        KimiTokenizer.from_dir(tmp_path)
    with pytest.raises(TokenizerError, match="not a tokenizer directory"):
        KimiTokenizer.from_dir(tmp_path / "nope")
    assert issubclass(TokenizerError, ValueError)
    (tmp_path / "tiktoken.model").write_text("\n".join(_vocab_lines()) + "\n")
    assert KimiTokenizer.from_dir(tmp_path).num_base_tokens == 256  # blank lines / no config ok
    (tmp_path / "tokenizer_config.json").write_text('{"bos_token": "[BOS]",\n oops}')
    with pytest.raises(TokenizerError, match=r"tokenizer_config\.json:2: invalid JSON"):
        KimiTokenizer.from_dir(tmp_path)
