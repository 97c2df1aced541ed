"""A small, valid Kimi-style tokenizer written by code (tiktoken.model, tokenizer_config.json, optional chat
template), for the embedded tiny checkpoint and the tests: byte-level BPE merges learned greedily from a built-in
text, the Kimi special tokens at their real offsets. kimijax.tokenizer reads what this writes."""

from __future__ import annotations

import base64
import heapq
import json
import os
from collections import Counter
from pathlib import Path

from kimijax.tokenizer import (_CONFIG_FILE, _TEMPLATE_FILE, _VOCAB_FILE, KIMI_SPECIAL_OFFSETS, NUM_SPECIAL_IDS,
                               pre_tokenize)


_TINY_CORPUS = """\
The quick brown fox jumps over the lazy dog. This is a small model that we use to test the
inference engine. It is not a real language model, but it has a real tokenizer: the words of
this text are learned as merges, so common words like the, and, that, with, model, token and
test become single tokens.

Hello, world! How are you today? I am fine, thank you. What is the time? It is ten past two.
We can write numbers like 1, 22, 333, 2024 and 3.14159, and the tokenizer splits long digit
runs into groups of at most three digits. You are Kimi, an AI assistant created by Moonshot AI.
The user asks a question and the assistant gives an answer. The system prompt tells the
assistant what to do. A tool call returns a result, and the assistant reads the result.

def main():
    for i in range(10):
        print("hello", i)
    return None

class Model:
    def __init__(self, config):
        self.config = config
        self.layers = [Layer(config) for _ in range(config.num_layers)]

    def forward(self, tokens, cache=None):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x, cache)
        return self.norm(x)

Attention is all you need. The transformer reads a sequence of tokens, and each layer mixes
information between the positions with attention and then applies a feed forward network.
Mixture of experts models route every token to a few of many experts. The router picks the
top experts for each token, and the outputs are combined with the router weights. Speculative
decoding uses a small draft model to propose tokens that the target model then verifies in one
forward pass. If the draft is right, we accept many tokens at once; if it is wrong, we keep the
tokens up to the first mistake and continue from there.

She said that they would come back in the morning, after the rain. They didn't know where the
road went, but they'd walked it before and they're sure it's safe. We'll see what happens when
the sun comes up over the hills and the light falls on the water of the river.
The cat sat on the mat. The dog ran in the park. The bird sang in the tree. The sky is blue and
the grass is green. People often say that time is money, but time is also life. Good morning,
good evening, good night. Please, thank you, sorry, yes, no, maybe. One, two, three, four, five,
six, seven, eight, nine, ten. Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday.
你好，世界！我们今天学习中文。这是一个小模型，用来测试推理引擎。中文和English混合在一起。
"""


def _train_merges(text: str, n_merges: int) -> list[bytes]:
    """Greedy byte-level BPE on the Kimi pre-tokens of `text`; returns up to n_merges new tokens
    in merge (= rank) order. Ties break on the smaller (left, right) byte pair."""
    words = Counter(pre_tokenize(text))
    seqs: list[list[bytes]] = []
    freqs: list[int] = []
    for w, f in words.items():
        seqs.append([bytes([b]) for b in w.encode("utf-8")])
        freqs.append(f)
    counts: Counter = Counter()
    where: dict[tuple[bytes, bytes], set[int]] = {}
    for wi, seq in enumerate(seqs):
        for p in zip(seq, seq[1:]):
            counts[p] += freqs[wi]
            where.setdefault(p, set()).add(wi)
    heap = [(-c, p) for p, c in counts.items()]
    heapq.heapify(heap)
    vocab = {bytes([b]) for b in range(256)}
    new_tokens: list[bytes] = []
    while heap and len(new_tokens) < n_merges:
        negc, pair = heapq.heappop(heap)
        if counts.get(pair, 0) != -negc or negc == 0:
            continue  # stale entry
        merged = pair[0] + pair[1]
        if merged not in vocab:
            vocab.add(merged)
            new_tokens.append(merged)
        changed: set[tuple[bytes, bytes]] = set()
        for wi in list(where.get(pair, ())):
            seq, f = seqs[wi], freqs[wi]
            for p in zip(seq, seq[1:]):
                counts[p] -= f
                changed.add(p)
            out, j = [], 0
            while j < len(seq):
                if j + 1 < len(seq) and seq[j] == pair[0] and seq[j + 1] == pair[1]:
                    out.append(merged)
                    j += 2
                else:
                    out.append(seq[j])
                    j += 1
            seqs[wi] = out
            for p in zip(out, out[1:]):
                counts[p] += f
                where.setdefault(p, set()).add(wi)
                changed.add(p)
        for p in changed:
            c = counts.get(p, 0)
            if c > 0:
                heapq.heappush(heap, (-c, p))
            else:
                counts.pop(p, None)
                where.pop(p, None)
    return new_tokens


def write_tiny_tokenizer(
    path: str | os.PathLike,
    vocab_size: int = 1024,
    *,
    num_base_tokens: int | None = None,
    text: str | None = None,
    chat_template: str | None = None,
) -> Path:
    """Write a small valid Kimi-style tokenizer dir at `path` (created if needed); returns it.

    `vocab_size` is the number of ids the model's embedding must cover. By default
    num_base_tokens = vocab_size - 258, so every tokenizer id (base + the 258 special ids) is
    < vocab_size; this needs vocab_size >= 256 + 258 = 514 (256 byte tokens are mandatory for
    byte-level BPE). (Real K2.x is different: 163840 rows = 163584 base + 256, with two reserved
    ids beyond the embedding.) An explicit num_base_tokens must lie in [256, vocab_size - 258].

    `tiktoken.model`: the 256 single bytes (rank = byte value) then num_base_tokens - 256 merges
    learned greedily from `text` (default: built-in English text, so common words become single
    tokens); if the text runs out of pairs, further tokens are concatenations of existing ones.
    `tokenizer_config.json`: the Kimi special names at num_base_tokens + the real offsets
    (`KIMI_SPECIAL_OFFSETS`; [BOS] = num_base + 0, ..., [PAD] = num_base + 255), bos [BOS],
    eos [EOS]. `chat_template.jinja` only if `chat_template` is given.
    """
    vocab_size = int(vocab_size)
    if num_base_tokens is None:
        num_base_tokens = vocab_size - NUM_SPECIAL_IDS
    num_base_tokens = int(num_base_tokens)
    if num_base_tokens < 256 or num_base_tokens + NUM_SPECIAL_IDS > vocab_size:
        raise ValueError(
            f"tiny Kimi tokenizer needs 256 byte tokens + {NUM_SPECIAL_IDS} special ids <= "
            f"vocab_size: got vocab_size={vocab_size}, num_base_tokens={num_base_tokens} "
            f"(vocab_size must be >= {256 + NUM_SPECIAL_IDS}, num_base_tokens in "
            f"[256, vocab_size - {NUM_SPECIAL_IDS}])"
        )
    tokens = [bytes([b]) for b in range(256)]
    n_merges = num_base_tokens - 256
    if n_merges:
        tokens += _train_merges(_TINY_CORPUS if text is None else text, n_merges)
    if len(tokens) < num_base_tokens:  # corpus exhausted: deterministic concatenations
        have = set(tokens)
        base = list(tokens)
        done = False
        for a in base[256:] or base:
            for b in base:
                t = a + b
                if t not in have:
                    have.add(t)
                    tokens.append(t)
                    if len(tokens) == num_base_tokens:
                        done = True
                        break
            if done:
                break
    assert len(tokens) == num_base_tokens and len(set(tokens)) == num_base_tokens

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    with open(path / _VOCAB_FILE, "wb") as f:
        for rank, tok in enumerate(tokens):
            f.write(base64.b64encode(tok) + b" " + str(rank).encode() + b"\n")
    added = {
        str(num_base_tokens + off): {
            "content": name,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for name, off in sorted(KIMI_SPECIAL_OFFSETS.items(), key=lambda kv: kv[1])
    }
    cfg = {
        "added_tokens_decoder": added,
        "additional_special_tokens": [
            n for n in KIMI_SPECIAL_OFFSETS if n not in ("[BOS]", "[EOS]", "[PAD]", "[UNK]")
        ],
        "bos_token": "[BOS]",
        "eos_token": "[EOS]",
        "pad_token": "[PAD]",
        "unk_token": "[UNK]",
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1048576,
        "tokenizer_class": "TikTokenTokenizer",
    }
    with open(path / _CONFIG_FILE, "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2, ensure_ascii=False)
        f.write("\n")
    if chat_template is not None:
        (path / _TEMPLATE_FILE).write_text(chat_template, encoding="utf-8")
    return path
