"""kimijax.spec.accept: the acceptance walk, emitted tokens, stop handling, and sampling losslessness."""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from kimijax.sampling import processed_logprobs
from kimijax.spec import accept, ddtree
from stats import chi2_pvalue


def brute_walk(tokens, parents, valid, choices):
    """Reference walk: from the root, move to the child whose token is the current node's choice."""
    path, cur = [0], 0
    while True:
        kids = [i for i in range(1, len(tokens)) if valid[i] and parents[i] == cur and tokens[i] == choices[cur]]
        assert len(kids) <= 1
        if not kids:
            return path, int(choices[cur])
        cur = kids[0]
        path.append(cur)


@functools.lru_cache(maxsize=None)
def _builder(budget):
    return jax.jit(jax.vmap(lambda lg: ddtree.build_tree(lg, budget)))


_walk_b = jax.jit(jax.vmap(accept.walk))


def test_walk_matches_brute_force():
    rng = np.random.default_rng(0)
    B, L, V, budget = 32, 5, 6, 24
    tree = _builder(budget)(jnp.asarray(rng.integers(-1, 2, size=(B, L, V)), jnp.float32))
    tok, par, val = (np.asarray(x) for x in (tree.tokens, tree.parents, tree.valid))
    # Choices that follow some child most of the time, so paths of every length occur.
    choices = rng.integers(0, V, size=(B, budget + 1))
    for b in range(B):
        for i in range(budget + 1):
            kids = [j for j in range(1, budget + 1) if val[b, j] and par[b, j] == i]
            if kids and rng.random() < 0.8:
                choices[b, i] = tok[b, rng.choice(kids)]
    path, n, bonus = (np.asarray(x) for x in _walk_b(tree, jnp.asarray(choices, jnp.int32)))
    assert path.shape == (B, L + 1)
    lengths = []
    for b in range(B):
        want_path, want_bonus = brute_walk(tok[b], par[b], val[b], choices[b])
        assert n[b] == len(want_path) and bonus[b] == want_bonus
        np.testing.assert_array_equal(path[b], want_path + [-1] * (L + 1 - len(want_path)))
        lengths.append(len(want_path))
    assert min(lengths) < 3 and max(lengths) >= 4


# A synthetic deterministic target: next-token logits depend on the last two tokens only.
V_TF, L_TF, BUDGET_TF = 12, 4, 12
TABLE_TF = np.random.default_rng(1).normal(size=(V_TF * V_TF, V_TF)).astype(np.float32)


def target_logits(prefix):
    return TABLE_TF[prefix[-2] * V_TF + prefix[-1]]


def per_node_target_logits(tree, seq):
    """Row i = target logits after node i's prefix (committed seq, whose last token is the root/bonus)."""
    tokens, parents, valid = (np.asarray(x) for x in (tree.tokens, tree.parents, tree.valid))
    rows = np.zeros((len(tokens), V_TF), np.float32)
    for i in range(len(tokens)):
        if not valid[i]:
            continue
        branch, j = [], i
        while j > 0:
            branch.append(int(tokens[j]))
            j = parents[j]
        rows[i] = target_logits(seq + branch[::-1])
    return rows


@jax.jit
def _greedy_accept(tree, logits_NV, stop_ids):
    choices = accept.node_choices(jax.random.key(0), logits_NV, 0.0, 0, 1.0)
    path, n, bonus = accept.walk(tree, choices)
    return accept.emitted_tokens(tree, path, n, bonus, stop_ids), n


def test_greedy_rounds_equal_teacher_forced_target():
    rng = np.random.default_rng(2)
    build_one = jax.jit(lambda lg: ddtree.build_tree(lg, BUDGET_TF))
    chain_one = jax.jit(ddtree.chain_tree)
    no_stop = jnp.full((2,), -1, jnp.int32)
    for use_chain in (False, True):
        seq = [3, 7]  # prompt; its last token plays the bonus of the first round
        taus = []
        for _ in range(12):
            # Draft logits that usually, not always, favour the target's greedy continuation.
            greedy, ctx = [], list(seq)
            for _ in range(L_TF):
                ctx.append(int(np.argmax(target_logits(ctx))))
                greedy.append(ctx[-1])
            draft = rng.normal(size=(L_TF, V_TF)).astype(np.float32)
            draft[np.arange(L_TF), greedy] += rng.choice([0.0, 1.5, 4.0], size=L_TF)
            tree = (chain_one if use_chain else build_one)(jnp.asarray(draft))
            em, n = _greedy_accept(tree, jnp.asarray(per_node_target_logits(tree, seq)), no_stop)
            count = int(em.count)
            assert count == int(n) and not bool(em.stopped)
            out = np.asarray(em.tokens)
            assert np.all(out[count:] == -1)
            for tok in out[:count]:  # every emitted token is the target's argmax given the committed prefix
                assert tok == int(np.argmax(target_logits(seq)))
                seq.append(int(tok))
            taus.append(count)
        assert max(taus) >= 3, taus  # the tree was actually used
    # Chain or tree, greedy speculation reproduces plain greedy decoding.
    ar = [3, 7]
    while len(ar) < len(seq):
        ar.append(int(np.argmax(target_logits(ar))))
    assert ar[:len(seq)] == seq


def test_stop_tokens_and_max_emit_truncate():
    # A chain L=4 whose every draft is accepted: emitted = d1 d2 d3 d4 bonus.
    L = 4
    draft = np.full((L, 8), -5.0, np.float32)
    draft[np.arange(L), [5, 1, 6, 2]] = 5.0
    tree = ddtree.chain_tree(jnp.asarray(draft))
    choices = jnp.array([5, 1, 6, 2, 4], jnp.int32)  # root's choice = d1, ..., node 4's choice = bonus 4
    path, n, bonus = accept.walk(tree, choices)
    assert int(n) == 5 and int(bonus) == 4
    np.testing.assert_array_equal(path, [0, 1, 2, 3, 4])

    emit = jax.jit(accept.emitted_tokens)
    em = emit(tree, path, n, bonus, jnp.array([-1, -1], jnp.int32), None)
    np.testing.assert_array_equal(em.tokens, [5, 1, 6, 2, 4])
    assert int(em.count) == 5 and not bool(em.stopped)
    em = emit(tree, path, n, bonus, jnp.array([6, 2], jnp.int32), None)  # first stop wins: 6 at position 2
    np.testing.assert_array_equal(em.tokens, [5, 1, 6, -1, -1])
    assert int(em.count) == 3 and bool(em.stopped)
    em = emit(tree, path, n, bonus, jnp.array([4, -1], jnp.int32), None)  # stop on the bonus itself
    assert int(em.count) == 5 and bool(em.stopped)
    em = emit(tree, path, n, bonus, jnp.array([2, -1], jnp.int32), jnp.int32(2))  # cap before the stop token
    np.testing.assert_array_equal(em.tokens, [5, 1, -1, -1, -1])
    assert int(em.count) == 2 and not bool(em.stopped)
    # Nothing accepted: only the bonus (= root's choice) is emitted, and it can be a stop token.
    path, n, bonus = accept.walk(tree, jnp.array([7, 0, 0, 0, 0], jnp.int32))
    assert int(n) == 1 and int(bonus) == 7
    em = emit(tree, path, n, bonus, jnp.array([7, -1], jnp.int32), None)
    np.testing.assert_array_equal(em.tokens, [7, -1, -1, -1, -1])
    assert int(em.count) == 1 and bool(em.stopped)


def test_batched_node_choices_match_per_request():
    rng = np.random.default_rng(3)
    B, N1, V = 3, 5, 7
    logits = jnp.asarray(rng.normal(size=(B, N1, V)), jnp.float32)
    keys = jax.random.split(jax.random.key(4), B)
    t, k, p = jnp.array([0.0, 1.0, 0.8]), jnp.array([0, 0, 3], jnp.int32), jnp.array([1.0, 0.9, 1.0])
    per_req = jax.jit(jax.vmap(accept.node_choices))(keys, logits, t, k, p)
    batched = jax.jit(accept.node_choices_batched)(keys, logits, t, k, p)
    np.testing.assert_array_equal(per_req, batched)
    np.testing.assert_array_equal(per_req[0], jnp.argmax(logits[0], -1))


# Sampling losslessness on a tiny vocabulary: the target's conditional depends on the last token only.
V_S, L_S, BUDGET_S, ROOT_S = 5, 3, 10, 0


@jax.jit
def _two_token_sampler(keys, tree, table_VV, temperature, top_p):
    """First two tokens emitted after ROOT_S by speculative rounds (a second round when the first emits only
    its bonus), one sample per key. Sampling parameters are traced: one compile serves both settings."""

    def round_(key, root_tok):
        last = jnp.where(jnp.arange(BUDGET_S + 1) == 0, root_tok, jnp.maximum(tree.tokens, 0))
        choices = accept.node_choices(key, table_VV[last], temperature, 0, top_p)
        path, n, bonus = accept.walk(tree, choices)
        return accept.emitted_tokens(tree, path, n, bonus)

    def one(key):
        # Two rounds as a scan (one copy of the round in the program); the root of round 2 is round 1's
        # first emitted token, which is what a bonus-only round 1 leaves as the next root.
        def body(root_tok, k):
            em = round_(k, root_tok)
            return em.tokens[0], (em.tokens[:2], em.count)

        _, (toks_R2, count_R) = jax.lax.scan(body, jnp.int32(ROOT_S), jax.random.split(key))
        x2 = jnp.where(count_R[0] >= 2, toks_R2[0, 1], toks_R2[1, 0])
        return toks_R2[0, 0], x2, count_R[0]

    return jax.vmap(one)(keys)


def test_sampling_walk_is_lossless():
    rng = np.random.default_rng(7)
    table = jnp.asarray(rng.normal(size=(V_S, V_S)) * 1.5, jnp.float32)
    # A deliberately mismatched draft: random logits unrelated to the target.
    tree = jax.jit(lambda lg: ddtree.build_tree(lg, BUDGET_S))(jnp.asarray(rng.normal(size=(L_S, V_S)), jnp.float32))
    S = 20000
    keys = jax.random.split(jax.random.key(8), S)
    for temperature, top_p in [(1.0, 1.0), (0.7, 0.9)]:
        out = _two_token_sampler(keys, tree, table, jnp.float32(temperature), jnp.float32(top_p))
        x1, x2, count = (np.asarray(a) for a in out)
        assert np.mean(count) > 1.3  # paths through the tree do get accepted
        q = np.exp(np.asarray(jax.jit(processed_logprobs)(table, temperature, 0, top_p), np.float64))  # q[a, b] = p(b | a)
        joint = q[ROOT_S][:, None] * q  # p(x1, x2 | root)
        observed = np.zeros((V_S, V_S))
        np.add.at(observed, (x1, x2), 1)
        pv = chi2_pvalue(observed.ravel(), joint.ravel() * S,
                         impossible="emitted a token pair the target can never produce")
        assert pv > 0.01, (temperature, top_p, pv)
