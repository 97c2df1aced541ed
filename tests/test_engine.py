"""AR engine: greedy == teacher-forced argmax, batching with ragged prompts, stops, seeded sampling, errors."""
import dataclasses

import numpy as np
import pytest

import kimijax
from kimijax import Engine, EngineError
from kimijax.config import TINY
from kimijax.target import KimiTarget, random_kimi_params


def _prompts(V, lens, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, V, size=n).tolist() for n in lens]


def _teacher_forced_check(target, prompt, new):
    seq = np.array([prompt + new])
    logits = np.asarray(kimijax.forward(target, seq))[0]
    P = len(prompt)
    for i, tok in enumerate(new):
        assert int(np.argmax(logits[P - 1 + i])) == tok, f"token {i}"


def test_greedy_matches_teacher_forced_target(tiny_f32):
    eng = Engine(tiny_f32, chunk_rounds=5)
    prompts = _prompts(tiny_f32.vocab_size, [5, 9, 3])
    res = eng.generate(prompts, max_new_tokens=12, stop_ids=[])
    for p, r in zip(prompts, res):
        assert len(r.tokens) == 12 and r.finish_reason == "length"
        assert r.acceptance_lengths == [1] * 11
        _teacher_forced_check(tiny_f32, p, r.tokens)
    # batching does not change a request's output
    solo = eng.generate([prompts[1]], max_new_tokens=12, stop_ids=[])[0]
    assert solo.tokens == res[1].tokens


def test_stop_token_ends_request(tiny_f32):
    eng = Engine(tiny_f32)
    p = _prompts(tiny_f32.vocab_size, [6], seed=1)
    full = eng.generate(p, max_new_tokens=10, stop_ids=[])[0].tokens
    stop = full[3]
    first = full.index(stop)
    r = eng.generate(p, max_new_tokens=10, stop_ids=[stop])[0]
    assert r.tokens == full[: first + 1] and r.finish_reason == "stop"


def test_seeded_sampling_reproducible(tiny_f32):
    eng = Engine(tiny_f32)
    p = _prompts(tiny_f32.vocab_size, [4, 7], seed=2)
    a = eng.generate(p, max_new_tokens=16, temperature=1.0, top_p=0.9, seed=7, stop_ids=[])
    b = eng.generate(p, max_new_tokens=16, temperature=1.0, top_p=0.9, seed=7, stop_ids=[])
    c = eng.generate(p, max_new_tokens=16, temperature=1.0, top_p=0.9, seed=8, stop_ids=[])
    assert [r.tokens for r in a] == [r.tokens for r in b]
    assert [r.tokens for r in a] != [r.tokens for r in c]


def test_stream_equals_generate(tiny_f32):
    eng = Engine(tiny_f32, chunk_rounds=3)
    p = _prompts(tiny_f32.vocab_size, [5, 2], seed=3)
    chunks = list(eng.stream(p, max_new_tokens=9, stop_ids=[]))
    assert len(chunks) > 2
    joined = [sum((c[b] for c in chunks), []) for b in range(2)]
    assert joined == [r.tokens for r in eng.generate(p, max_new_tokens=9, stop_ids=[])]


def test_request_errors(tiny_f32):
    eng = Engine(tiny_f32, max_cache_len=64)
    V = tiny_f32.vocab_size
    with pytest.raises(EngineError, match="cache exhausted"):
        eng.generate([[5] * 40], max_new_tokens=30)
    with pytest.raises(EngineError, match="temperature"):
        eng.generate([[5]], temperature=-1.0)
    with pytest.raises(EngineError, match="top_p"):
        eng.generate([[5]], top_p=0.0)
    with pytest.raises(EngineError, match="empty"):
        eng.generate([[]])
    with pytest.raises(EngineError, match="outside the vocabulary"):
        eng.generate([[V + 3]])
    with pytest.raises(EngineError, match="max_new_tokens"):
        eng.generate([[5]], max_new_tokens=0)
    with pytest.raises(EngineError, match="list of prompts"):
        eng.generate([1, 2, 3])
    with pytest.raises(EngineError, match="no tokenizer"):
        eng.generate(["hello"])
    short = KimiTarget(dataclasses.replace(tiny_f32.cfg, max_position_embeddings=32), tiny_f32.params)
    with pytest.raises(EngineError, match="context is 32"):
        Engine(short).generate([[5] * 30], max_new_tokens=8)


def test_engine_config_errors(tiny_f32):
    with pytest.raises(EngineError, match="unknown method"):
        Engine(tiny_f32, method="beam")
    with pytest.raises(EngineError, match="needs a drafter"):
        Engine(tiny_f32, method="ddtree")
    with pytest.raises(EngineError, match="RoundKernels"):
        Engine(tiny_f32, round_kernels={"tree": "pallas"})
    with pytest.raises(ValueError, match="tree='cuda'"):
        kimijax.RoundKernels(tree="cuda")


def test_engines_share_programs_and_do_not_keep_targets_alive():
    """Engines with the same target and settings reuse one set of compiled programs, stored on the target: a
    dropped target (and its weights) can be freed although engines were built for it."""
    import gc
    import weakref

    cfg = dataclasses.replace(TINY, dtype="float32", num_hidden_layers=1)
    t = KimiTarget(cfg, random_kimi_params(cfg, seed=9))
    e = Engine(t)
    e.generate([[5, 6, 7]], max_new_tokens=2, stop_ids=[])
    assert Engine(t)._compiled is e._compiled
    first = e.generate([[5, 6, 7]], max_new_tokens=2, stop_ids=[])[0].tokens
    kimijax.engine.drop_programs(t)  # a later Engine compiles again, same results
    e2 = Engine(t)
    assert e2._compiled is not e._compiled and not e2._compiled
    assert e2.generate([[5, 6, 7]], max_new_tokens=2, stop_ids=[])[0].tokens == first
    ref = weakref.ref(t)
    del t, e, e2
    gc.collect()
    assert ref() is None


def _tiny_drafter(target):
    from kimijax.models.drafter import DrafterConfig, random_drafter

    c = target.cfg
    dcfg = DrafterConfig(hidden_size=c.hidden_size, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, intermediate_size=64, block_size=4,
                         mask_token_id=c.vocab_size - 2, target_layer_ids=(0, 2),
                         num_target_layers=c.num_hidden_layers, vocab_size=c.vocab_size)
    return random_drafter(dcfg, target, seed=3)


@pytest.mark.parametrize("method", ["ar", "ddtree"])
def test_continuous_batching_equals_one_by_one(tiny_f32, method):
    """max_batch < len(prompts): rows are refilled as requests finish. Every request's tokens (greedy and
    sampled: each request keeps its own RNG stream) equal what it gets alone, results keep prompt order, and
    requests of different lengths (per-prompt stop ids are not a thing; different max_new is) all finish."""
    drafter = _tiny_drafter(tiny_f32) if method != "ar" else None
    eng = Engine(tiny_f32, drafter, method=method, budget=4, chunk_rounds=4)
    prompts = _prompts(tiny_f32.vocab_size, [3, 7, 2, 5, 4], seed=11)
    # stop ids from two greedy answers, so requests end at different rounds and rows get refilled mid-run
    probe = eng.generate(prompts, max_new_tokens=12, stop_ids=[])
    stop = [probe[1].tokens[4], probe[3].tokens[8]]
    for temp in (0.0, 0.8):
        # one static batch gives request j the RNG stream j too, so its tokens are the reference
        ref = eng.generate(prompts, max_new_tokens=12, temperature=temp, seed=7, stop_ids=stop)
        got = eng.generate(prompts, max_new_tokens=12, temperature=temp, seed=7, stop_ids=stop, max_batch=2)
        assert [r.tokens for r in got] == [r.tokens for r in ref], temp
        assert [r.acceptance_lengths for r in got] == [r.acceptance_lengths for r in ref]
        assert [r.prompt_tokens for r in got] == [len(p) for p in prompts]
        if temp == 0.0:
            assert len({len(r.tokens) for r in got}) > 1  # requests did end at different times
        assert eng.last_stats["new_tokens"] == sum(len(r.tokens) for r in got)
    if method == "ar":  # greedy alone, one request per call: the same tokens again
        alone = [eng.generate([p], max_new_tokens=12, stop_ids=stop)[0].tokens for p in prompts]
        assert alone == [r.tokens for r in eng.generate(prompts, max_new_tokens=12, stop_ids=stop, max_batch=2)]
    with pytest.raises(EngineError, match="max_batch"):
        eng.generate(prompts, max_batch=0)


def test_refill_of_several_rows_at_once_pads_and_matches(tiny_f32):
    """Requests that finish in the same round free their rows together; one refill program takes the next
    prompts into all of them, padded to a power of two of rows (3 -> 4 here: the padding row is dropped) and of
    prompt tokens. Every request still gets exactly the tokens of a static batch, greedy and sampled."""
    eng = Engine(tiny_f32, chunk_rounds=3)
    prompts = _prompts(tiny_f32.vocab_size, [3, 7, 2, 5, 9, 4, 6], seed=13)
    sizes, refill = [], eng._refill
    eng._refill = lambda state, rows, *a: sizes.append(len(rows)) or refill(state, rows, *a)
    for temp in (0.0, 0.8):
        ref = eng.generate(prompts, max_new_tokens=5, temperature=temp, seed=2, stop_ids=[])
        got = eng.generate(prompts, max_new_tokens=5, temperature=temp, seed=2, stop_ids=[], max_batch=4)
        assert [r.tokens for r in got] == [r.tokens for r in ref], temp
    assert sizes == [3, 3]  # the first 4 requests end together; 3 prompts are left for their rows
    assert len([k for k in eng._compiled if k[0] == "refill"]) == 1


def test_refill_min_gathers_freed_rows_and_tail_runs_through(tiny_f32):
    """refill_min=k: the device loop returns only once k rows are free (or fewer prompts wait), so each refill
    program takes several rows; once no prompt waits, one chunk runs every row to its end. Tokens equal a
    static batch whatever k is."""
    eng = Engine(tiny_f32, chunk_rounds=64)  # chunks end only on freed rows, never on the round cap
    prompts = _prompts(tiny_f32.vocab_size, [3, 7, 2, 5, 9, 4, 6, 3, 5, 8], seed=19)
    counts = [2, 5, 3, 9, 4, 7, 6, 2, 8, 3]  # every request ends at its own round
    ref = eng.generate(prompts, max_new_tokens=counts, temperature=0.8, seed=4, stop_ids=[])
    sizes, refill = [], eng._refill
    eng._refill = lambda state, rows, *a: sizes.append(len(rows)) or refill(state, rows, *a)
    for k in (1, 3):
        sizes.clear()
        got = eng.generate(prompts, max_new_tokens=counts, temperature=0.8, seed=4, stop_ids=[], max_batch=4,
                           refill_min=k)
        assert [r.tokens for r in got] == [r.tokens for r in ref], k
        waiting = [6 - sum(sizes[:i]) for i in range(len(sizes))]
        assert all(n >= min(k, w) for n, w in zip(sizes, waiting)), (k, sizes)
        assert sum(sizes) == 6 and eng.last_stats["refills"] == len(sizes)
        assert eng.last_stats["chunks"] == len(sizes) + 1  # one chunk after the last refill runs to the end
    assert max(sizes) >= 3
    for bad in (0, 1.5, True):
        with pytest.raises(EngineError, match="refill_min"):
            eng.generate(prompts, max_batch=4, refill_min=bad)


@pytest.mark.parametrize("method", ["ar", "ddtree"])
def test_shrink_moves_live_rows_and_matches(tiny_f32, method):
    """shrink=True: once at most half the rows run, they move to a batch of the next power of two (7 rows ->
    4 -> 2 -> 1 here). Every request keeps exactly its tokens, acceptance lengths and (MoE) expert counts of
    the static batch, greedy and sampled; the batch rounds are the same."""
    eng = Engine(tiny_f32, _tiny_drafter(tiny_f32) if method == "ddtree" else None, method=method, budget=3,
                 chunk_rounds=64)
    prompts = _prompts(tiny_f32.vocab_size, [3, 7, 2, 5, 9, 4, 6], seed=23)
    counts = [3, 14, 5, 21, 7, 11, 9]  # every request ends at its own round
    for temp in (0.0, 0.8):
        ref = eng.generate(prompts, max_new_tokens=counts, temperature=temp, seed=5, stop_ids=[])
        ref_stats = dict(eng.last_stats)
        got = eng.generate(prompts, max_new_tokens=counts, temperature=temp, seed=5, stop_ids=[], shrink=True)
        assert [r.tokens for r in got] == [r.tokens for r in ref], temp
        assert [r.acceptance_lengths for r in got] == [r.acceptance_lengths for r in ref]
        assert [r.prompt_tokens for r in got] == [len(p) for p in prompts]
        assert eng.last_stats["rounds"] == ref_stats["rounds"]
        assert eng.last_stats["shrinks"] >= 2
        if method == "ddtree":
            np.testing.assert_allclose(eng.last_stats["distinct_experts_per_layer"],
                                       ref_stats["distinct_experts_per_layer"])
    assert len([k for k in eng._compiled if k[0] == "chunk"]) >= 4  # 7 rows (stop_on_done off and on), 4, 2, ...
    with pytest.raises(EngineError, match="shrink"):
        eng.generate(prompts, max_batch=2, shrink=True)


def test_max_new_tokens_per_request(tiny_f32):
    """max_new_tokens may differ per prompt: each request stops at its own count (static batch and refilled
    rows alike) with the same tokens as a run where all get the largest count; bad values raise clearly."""
    eng = Engine(tiny_f32, chunk_rounds=4)
    prompts = _prompts(tiny_f32.vocab_size, [3, 7, 2, 5, 4], seed=17)
    counts = [2, 9, 5, 1, 7]
    full = eng.generate(prompts, max_new_tokens=9, stop_ids=[])
    for kw in ({}, {"max_batch": 2}):
        got = eng.generate(prompts, max_new_tokens=counts, stop_ids=[], **kw)
        assert [r.tokens for r in got] == [f.tokens[:n] for f, n in zip(full, counts)], kw
        assert all(r.finish_reason == "length" for r in got)
    for bad, msg in (([3, 4], "one per prompt"), ([3, 0, 1, 1, 1], ">= 1"), (2.5, "whole numbers")):
        with pytest.raises(EngineError, match=msg):
            eng.generate(prompts, max_new_tokens=bad)
    with pytest.raises(EngineError, match="temperature must be one value or one per prompt"):
        eng.generate(prompts, temperature=[0.5, 0.7])


def test_refilled_decoding_compiles_nothing_once_warm(tiny_f32):
    """A warm engine serves a refilled run whose requests end at new lengths without compiling anything but
    a refill program for a new count of rows freed at once (a power of two, so at most log2(C) + 1 of them):
    a finished row's outputs are read on the host (slicing the device array by each row's length compiled a
    program per length, ~0.1 s each on a GPU: refilled decoding ran 10x slower than static batches)."""
    import jax

    eng = Engine(tiny_f32, chunk_rounds=4)
    prompts = _prompts(tiny_f32.vocab_size, [3, 7, 2, 5, 4, 6], seed=5)
    probe = eng.generate(prompts, max_new_tokens=16, stop_ids=[])
    eng.generate(prompts, max_new_tokens=16, stop_ids=[probe[0].tokens[3]], max_batch=2)  # warm-up
    before = set(eng._compiled)
    compiles = []
    listen = lambda event, secs, **kw: compiles.append(event) if event.endswith("backend_compile_duration") else 0
    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        got = eng.generate(prompts, max_new_tokens=16, stop_ids=[probe[2].tokens[5], probe[4].tokens[9]],
                           max_batch=2)
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert len({len(r.tokens) for r in got}) > 1
    new = [k for k in eng._compiled if k not in before]
    assert {k[0] for k in new} <= {"refill", "zero_cache"}
    assert len(compiles) == len(new)  # nothing compiled outside the engine's own (timed) programs
