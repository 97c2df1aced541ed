"""Engine: batched prefill, then decode rounds inside one compiled device loop per chunk of rounds.

Per-request state lives in fixed slots (batch row b): committed length S_b (entries in the target cache),
the bonus token (committed and emitted, not yet in the cache), an output buffer, done flag and RNG key.
A round is one AR step (method "ar") or one draft-tree-verify-commit round (methods "dflash", "ddtree",
see kimijax/spec/round.py). `lax.while_loop` runs up to `chunk_rounds` rounds on device; the host only
sees finished chunks (that is also the streaming granularity). With `generate(..., max_batch=C)` a chunk ends
as soon as a request finishes and one refill program prefills the next prompts into the freed rows
(continuous batching).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kimijax.sampling import check_sampling_params, sample_tokens
from kimijax.spec.kernels import RoundKernels

MAX_STOP_IDS = 8
# on a target: (drafter id, settings) -> (drafter, jitted prefill, compiled programs); "zero_cache" -> its jitted cache
_PROGRAMS_ATTR = "_kimijax_engine_programs"


def drop_programs(target) -> None:
    """Forget the compiled programs that engines keep on `target` (a later Engine compiles them again): frees
    their device code in a long-lived process that has moved on to other shapes or settings."""
    target.__dict__.pop(_PROGRAMS_ATTR, None)


class EngineError(ValueError):
    """Bad request: empty or over-long prompt, invalid sampling or tree parameters, cache exhaustion."""


@dataclasses.dataclass
class GenerationResult:
    tokens: list[int]  # new token ids only (a final stop token included)
    finish_reason: str  # "stop" | "length"
    prompt_tokens: int
    acceptance_lengths: list[int]  # tokens committed per round (AR: all 1)
    text: str | None = None
    rounds: int = 0


class DecodeState(dict):
    """Pytree of per-request device state (a dict so jit/while_loop carry it as is)."""


jax.tree_util.register_pytree_node(
    DecodeState, lambda d: (tuple(d[k] for k in sorted(d)), tuple(sorted(d))),
    lambda keys, vals: DecodeState(zip(keys, vals)))


_SHARED_KEYS = ("round", "stop_ids")  # DecodeState entries shared by all rows (every other one is per row)


def _bucket(n: int, minimum: int = 8) -> int:
    b = minimum
    while b < n:
        b *= 2
    return b


def row_sample(keys_B, logits_BV, temperature_B, top_k_B, top_p_B):
    """One sample per row with the row's own key (independent of batch composition)."""
    return sample_tokens(keys_B, logits_BV, temperature_B, top_k_B, top_p_B)


def row_keys(st):
    """This round's key per request: its own stream, indexed by how many tokens it has emitted."""
    return jax.vmap(jax.random.fold_in)(st["keys"], st["n_out"])


def is_stop(tokens, stop_ids_S):
    return jnp.any(tokens[..., None] == stop_ids_S, axis=-1)


class Engine:
    """Generate with a target alone (method "ar") or speculatively with a DFlash drafter ("dflash", "ddtree").
    round_kernels: opt-in kernels for the round's tree and commit stages (experiments; XLA by default)."""

    def __init__(self, target, drafter=None, method: str = "ar", budget: int = 8, topk_cap: int | None = None,
                 draft_window: int | None = None, chunk_rounds: int = 32, max_cache_len: int | None = None,
                 round_kernels: RoundKernels = RoundKernels()):
        if method not in ("ar", "dflash", "ddtree"):
            raise EngineError(f"unknown method {method!r}: choose ar, dflash or ddtree")
        if method != "ar" and drafter is None:
            raise EngineError(f"method {method!r} needs a drafter (load one with kimijax.load_drafter)")
        if method == "ddtree" and not 1 <= budget <= 128:
            raise EngineError(f"tree budget must be in 1..128, got {budget}")
        if topk_cap is not None and topk_cap < 1:
            raise EngineError(f"topk_cap must be >= 1, got {topk_cap}")
        if draft_window is not None and draft_window < 1:
            raise EngineError(f"draft_window must be >= 1, got {draft_window}")
        if chunk_rounds < 1:
            raise EngineError("chunk_rounds must be >= 1")
        self.target, self.drafter, self.method = target, drafter, method
        self.budget, self.topk_cap, self.draft_window = budget, topk_cap, draft_window
        self.chunk_rounds, self.max_cache_len = chunk_rounds, max_cache_len
        self.round = None
        if not isinstance(round_kernels, RoundKernels):
            raise EngineError(f"round_kernels must be a kimijax.RoundKernels, got {type(round_kernels).__name__}")
        if method != "ar":
            from kimijax.spec.round import SpecRound
            self.round = SpecRound(target, drafter, method, budget, topk_cap, draft_window, round_kernels)
        # Programs are shared by engines with the same target, drafter and settings, so a new Engine
        # (or a new generate call) reuses what is already compiled. They live on the target (not in a module
        # global), so dropping the target frees its weights and programs together.
        programs = target.__dict__.setdefault(_PROGRAMS_ATTR, {})
        key = (id(drafter), method, budget, topk_cap, draft_window, round_kernels if method != "ar" else None)
        if key not in programs or programs[key][0] is not drafter:
            programs[key] = (drafter, jax.jit(self._prefill_fn, donate_argnums=(1,)), {})
        _, self._prefill, self._compiled = programs[key]
        self.last_stats: dict[str, Any] = {}
        self.last_compile_s = 0.0

    # ------------------------------------------------------------ sizes
    @property
    def tokens_per_round(self) -> int:
        """Most tokens one round can commit (cache slack needed past max_new_tokens)."""
        return 1 if self.round is None else self.round.max_commit

    @property
    def verify_width(self) -> int:
        return 1 if self.round is None else self.round.width

    # ------------------------------------------------------------ device programs
    def _prefill_fn(self, params, caches, tokens_BT, lens_B, keys_B, temp_B, topk_B, topp_B, dparams):
        capture = () if self.round is None else self.round.capture_layers
        logits_BV, caches, cap = self.target.prefill(params, caches, tokens_BT, lens_B, capture)
        first_B = row_sample(jax.vmap(jax.random.fold_in)(keys_B, jnp.zeros_like(lens_B)), logits_BV, temp_B,
                             topk_B, topp_B)
        L = jax.tree_util.tree_leaves(caches)[0].shape[1]
        extra = {} if self.round is None else self.round.init_state(dparams, cap, lens_B, L)
        return first_B, caches, extra

    def _chunk_fn(self, params, state, dparams, min_freed, n_rounds: int, stop_on_done: bool = False):
        """Up to n_rounds rounds on device, stopping early when every request is done (stop_on_done: also as
        soon as min_freed requests have finished in this chunk, so the host can give their rows to the next
        prompts; min_freed is traced, so changing it compiles nothing)."""
        done0 = state["done"]

        def cond(st):
            go = (st["round"] < n_rounds) & ~jnp.all(st["done"])
            freed = jnp.sum((st["done"] & ~done0).astype(jnp.int32))
            return go & (freed < min_freed) if stop_on_done else go

        def body(st):
            st = DecodeState(st)
            if self.round is None:
                st = self._ar_round(params, st)
            else:
                st = self.round(params, dparams, st)
            st["round"] = st["round"] + 1
            return st

        state = DecodeState(state)
        state["round"] = jnp.zeros((), jnp.int32)
        return jax.lax.while_loop(cond, body, state)

    def _ar_round(self, params, st):
        B = st["lengths"].shape[0]
        logits, caches, _ = self.target.verify(params, st["caches"], st["bonus"][:, None], st["lengths"][:, None],
                                               st["lengths"], jnp.ones((B, 1, 1), bool))
        tok = row_sample(row_keys(st), logits[:, 0], st["temperature"], st["top_k"], st["top_p"])
        live = ~st["done"]
        st["caches"] = caches
        st["lengths"] = st["lengths"] + live.astype(jnp.int32)
        return commit_tokens(st, tok[:, None], live.astype(jnp.int32))

    # ------------------------------------------------------------ host side
    def _encode(self, prompts) -> list[list[int]]:
        if isinstance(prompts, (str, bytes)) or (prompts and isinstance(prompts[0], int)):
            raise EngineError("generate() takes a list of prompts (strings or lists of token ids)")
        out = []
        for i, p in enumerate(prompts):
            if isinstance(p, str):
                tok = getattr(self.target, "tokenizer", None)
                if tok is None:
                    raise EngineError("this target has no tokenizer: pass prompts as lists of token ids")
                p = tok.encode(p)
            p = [int(t) for t in p]
            if not p:
                raise EngineError(f"prompt {i} is empty")
            bad = [t for t in p if not 0 <= t < self.target.vocab_size]
            if bad:
                raise EngineError(f"prompt {i} has token id {bad[0]} outside the vocabulary [0, {self.target.vocab_size})")
            out.append(p)
        if not out:
            raise EngineError("no prompts given")
        return out

    def start(self, prompts, max_new_tokens: int | Sequence[int] = 64, temperature=0.0, top_p=1.0, top_k=0,
              seed: int = 0, stop_ids: Sequence[int] | None = None, *, cache_len: int | None = None,
              request_ids: Sequence[int] | None = None, out_new_tokens: int | None = None):
        """Prefill a batch; returns the host-side request record and the device state. max_new_tokens and the
        sampling parameters are one value or one per prompt. cache_len fixes the cache length (default: the
        smallest power of two >= 64 that fits); out_new_tokens sizes the output buffers (default: the largest
        max_new_tokens; refilled rows need room for later requests); request_ids number the requests' RNG
        streams (default 0..B-1), so a request samples the same tokens in whatever batch row it runs."""
        toks = self._encode(prompts)
        B = len(toks)
        temp, tp, tk, new_B = _sampling_rows(B, temperature, top_p, top_k, max_new_tokens)
        lens = np.array([len(t) for t in toks], np.int32)
        for i, n in enumerate(lens):
            self._check_request(i, int(n), int(new_B[i]))
        i, need = self._largest_need(lens, new_B)
        L = _bucket(need, 64) if cache_len is None else cache_len
        if self.max_cache_len is not None:
            L = min(L, self.max_cache_len)
        if need > L:
            which = f"max_cache_len is {self.max_cache_len}" if L == self.max_cache_len else f"cache_len is {L}"
            raise EngineError(f"cache exhausted: prompt {i} ({lens[i]} tokens) + max_new_tokens ({new_B[i]}) + "
                              f"tree slack ({need - lens[i] - new_B[i]}) needs {need} cache slots, {which}")
        tokens_BT = _prompt_array(toks, B)
        stops = list(self.target.stop_ids if stop_ids is None else stop_ids)
        if len(stops) > MAX_STOP_IDS:
            raise EngineError(f"at most {MAX_STOP_IDS} stop ids are supported, got {len(stops)}")
        stops_S = np.full((MAX_STOP_IDS,), -1, np.int32)
        stops_S[: len(stops)] = stops
        ids = np.arange(B, dtype=np.int32) if request_ids is None else np.asarray(request_ids, np.int32)
        key_args = (jax.random.PRNGKey(seed), ids)
        keys_B = self._program(_request_keys_jit, "request_keys", key_args)(*key_args)
        params = self.target.params
        dparams = None if self.drafter is None else self.drafter.params
        caches = self._zero_cache(B, L)
        # device_put, not jnp.asarray: the latter compiles a small copy program per new shape
        tokens_BT, lens_B, temp, tk, tp = jax.device_put((tokens_BT, lens, temp, tk, tp))
        args = (params, caches, tokens_BT, lens_B, keys_B, temp, tk, tp, dparams)
        first_B, caches, extra = self._program(self._prefill, "prefill", args)(*args)
        room = int(new_B.max()) if out_new_tokens is None else out_new_tokens
        sizes = (_bucket(room + self.tokens_per_round, 8), _bucket(room + 1, 8))
        rows_args = (first_B, stops_S, jax.device_put(new_B))
        rows = self._program(_output_rows_jit, "output_rows", rows_args, sizes)(*rows_args)
        state = _request_state(caches, lens_B, first_B, keys_B, temp, tk, tp, rows, extra)
        record = dict(B=B, lens=lens, max_new=new_B)
        return record, self._on_mesh(state)

    def _zero_cache(self, B: int, L: int):
        """The target's empty cache as one program: eagerly, each layer's zeros is its own dispatch, 6-9 ms for
        SmolLM2's 30 layers at B=1 on an H100, half of what a refilled row's start costs
        (scripts/profile_refill.py, 2026-12-05). A mesh target places each layer itself (eager)."""
        if getattr(self.target, "mesh", None) is not None:
            return self.target.init_cache(B, L)
        programs = self.target.__dict__.setdefault(_PROGRAMS_ATTR, {})
        if "zero_cache" not in programs:
            programs["zero_cache"] = jax.jit(self.target.init_cache, static_argnums=(0, 1))
        return self._program(programs["zero_cache"], "zero_cache", (), (B, L))()

    def _on_mesh(self, state):
        """On a mesh every state leaf the prefill left on one device goes onto the mesh, replicated, so the chunk
        program can be compiled to give back exactly the shardings it takes (see _chunk_program)."""
        mesh = getattr(self.target, "mesh", None)
        if mesh is None:
            return state
        rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        return jax.tree_util.tree_map(
            lambda x: x if isinstance(x.sharding, jax.sharding.NamedSharding) else jax.device_put(x, rep), state)

    def cache_need(self, prompt_len: int, max_new_tokens: int) -> int:
        """Cache slots a request needs: prompt + new tokens + one round's tree and commit slack."""
        return prompt_len + max_new_tokens + self.verify_width + self.tokens_per_round

    def _largest_need(self, lens, new) -> tuple[int, int]:
        """The request needing the most cache slots, and how many."""
        i = int(np.argmax(np.asarray(lens) + np.asarray(new)))
        return i, self.cache_need(int(lens[i]), int(new[i]))

    def _program(self, jitted, name: str, args, static=()):
        """The compiled program of `jitted` for these arguments' shapes (compiled once per shape; the compile
        time is added to last_compile_s, so callers can keep it out of their decode timings)."""
        src = tuple(None if a is self.target.params else a for a in args)  # the weights' shapes never change
        sig = jax.tree_util.tree_map(lambda x: (np.shape(x), np.result_type(x)), src)
        key = (name, jitted, jax.tree_util.tree_structure(sig), tuple(jax.tree_util.tree_leaves(sig)), static)
        if key not in self._compiled:
            t0 = time.perf_counter()
            self._compiled[key] = jitted.lower(*args, *static).compile()
            self.last_compile_s += time.perf_counter() - t0
        return self._compiled[key]

    def _keeping_shardings(self, name: str, fn, state, **jit_kw):
        """`fn` jitted to give back the state with exactly the shardings it takes (left to propagation, a
        mesh's replicated rows can come back split over "data", and the next call of a compiled program would
        refuse them); one per sharding, shared like the compiled programs."""
        shard = jax.tree_util.tree_map(lambda x: x.sharding, state)
        leaves, tree = jax.tree_util.tree_flatten(shard)
        key = (name, tree, tuple(leaves))
        if key not in self._compiled:
            self._compiled[key] = jax.jit(fn, out_shardings=shard, **jit_kw)
        return self._compiled[key]

    def _chunk_program(self, state, dparams, stop_on_done: bool = False):
        """The compiled chunk program for this state's shapes and shardings (compiled once, timed separately)."""
        jitted = self._keeping_shardings("chunk_jit", self._chunk_fn, state, static_argnums=(4, 5),
                                         donate_argnums=(1,))
        args = (self.target.params, state, dparams, np.int32(1))
        return self._program(jitted, "chunk", args, (self.chunk_rounds, stop_on_done))

    def _refill_fn(self, params, state, caches_K, tokens_KT, lens_K, rows_K, ids_K, temp_K, topk_K, topp_K, key,
                   dparams, max_new_K):
        """Prefill K new requests and write them into rows rows_K of the batch state (rows >= B are padding
        and dropped): keys, prefill, fresh output rows and the row copies in one program."""
        keys_K = _request_keys(key, ids_K)
        first_K, caches_K, extra = self._prefill_fn(params, caches_K, tokens_KT, lens_K, keys_K, temp_K, topk_K,
                                                    topp_K, dparams)
        rows = _output_rows(first_K, state["stop_ids"], max_new_K, state["out"].shape[1], state["acc_hist"].shape[1])
        new = _request_state(caches_K, lens_K, first_K, keys_K, temp_K, topk_K, topp_K, rows, extra)
        out = DecodeState(state)
        for k in state:
            if k not in _SHARED_KEYS:
                out[k] = jax.tree_util.tree_map(
                    lambda big, small: big.at[rows_K].set(small.astype(big.dtype), mode="drop"), state[k], new[k])
        return out

    def _refill(self, state, rows, toks, ids, temp, topk, topp, key, max_new, L: int):
        """Rows `rows` of the batch state take the prompts `toks` (request ids `ids`). Padded to a power of two
        of requests and of prompt tokens, so a run compiles a few refill programs, not one per count and length;
        before this was one program (2026-12-06) a refilled row cost ~23 ms on an H100 (a dozen dispatches)."""
        B, n = state["lengths"].shape[0], len(rows)
        K = _bucket(n, 1)
        tokens_KT = _prompt_array(toks, K)
        pad = lambda v, fill, dt: np.concatenate([np.asarray(v, dt), np.full(K - n, fill, dt)])
        dparams = None if self.drafter is None else self.drafter.params
        args = (self.target.params, state, self._zero_cache(K, L), tokens_KT, pad(list(map(len, toks)), 1, np.int32),
                pad(rows, B, np.int32), pad(ids, 0, np.int32), pad(temp, 0, np.float32), pad(topk, 0, np.int32),
                pad(topp, 1, np.float32), key, dparams, pad(max_new, 1, np.int32))
        jitted = self._keeping_shardings("refill_jit", self._refill_fn, state, donate_argnums=(1,))
        return self._program(jitted, "refill", args)(*args)

    def stream(self, prompts, **kw) -> Iterator[list[list[int]]]:
        """Yield, after each device chunk, the new tokens of every request since the previous chunk."""
        record, state = self.start(prompts, **kw)
        seen = np.zeros(record["B"], np.int64)
        dparams = None if self.drafter is None else self.drafter.params
        run = self._chunk_program(state, dparams)
        while True:
            n_out = np.asarray(state["n_out"])
            out = np.asarray(state["out"])
            yield [out[b, seen[b]: n_out[b]].tolist() for b in range(record["B"])]
            seen = n_out.copy()
            if bool(np.all(np.asarray(state["done"]))):
                break
            state = run(self.target.params, state, dparams, np.int32(1))

    def generate(self, prompts, max_new_tokens: int | Sequence[int] = 64, temperature=0.0, top_p=1.0, top_k=0,
                 seed: int = 0, stop_ids: Sequence[int] | None = None,
                 max_batch: int | None = None, refill_min: int = 1, shrink: bool = False) -> list[GenerationResult]:
        """Generate for a list of prompts. `last_stats` gets timings (compile time excluded from prefill and
        decode). max_new_tokens and the sampling parameters are one value or one per prompt. max_batch: at most
        this many requests on the device at once; a finished request's row takes the next prompt (continuous
        batching), instead of the whole batch waiting for its longest request. refill_min: with max_batch, the
        device loop returns to the host once this many rows are free (or fewer prompts wait), so one refill
        program serves several rows (each return costs a host round trip and a prefill launch). shrink: once
        at most half of a batch's rows are still running, they move to a batch of the next power of two, so
        the finished rows stop costing compute (one more chunk program per batch size; not on a mesh)."""
        if max_batch is not None and max_batch < 1:
            raise EngineError(f"max_batch must be >= 1, got {max_batch}")
        if isinstance(refill_min, bool) or not isinstance(refill_min, (int, np.integer)) or refill_min < 1:
            raise EngineError(f"refill_min must be an integer >= 1, got {refill_min!r}")
        if shrink and getattr(self.target, "mesh", None) is not None:
            raise EngineError("shrink is not supported for a target on a mesh (batch rows are sharded there)")
        if max_batch is not None and len(prompts) > max_batch:
            if shrink:
                raise EngineError("shrink applies to one batch; with max_batch the free rows take new prompts")
            return self._generate_refill(prompts, max_batch, max_new_tokens, temperature, top_p, top_k, seed, stop_ids,
                                         int(refill_min))
        self.last_compile_s = 0.0
        t0 = time.perf_counter()
        record, state = self.start(prompts, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                                   top_k=top_k, seed=seed, stop_ids=stop_ids)
        jax.block_until_ready(state["out"])
        t1, c1 = time.perf_counter(), self.last_compile_s
        dparams = None if self.drafter is None else self.drafter.params
        run = self._chunk_program(state, dparams, stop_on_done=shrink)
        t2, c2 = time.perf_counter(), self.last_compile_s
        stops = set(int(s) for s in np.asarray(state["stop_ids"]) if s >= 0)
        B = record["B"]
        row_req = np.arange(B)  # batch row -> request (-1: a padding row)
        results, experts = [None] * B, [None] * B

        def collect(host, rows):  # finished requests' results (and MoE stats) from these batch rows
            for b in rows:
                j = int(row_req[b])
                results[j] = self._row_result(host, b, int(record["lens"][j]), stops)
                if "experts" in host:  # mean over rounds, per MoE layer
                    experts[j] = (host["experts"][b] / max(int(host["n_rounds"][b]), 1)).tolist()

        n_chunks, rounds, n_shrinks = 0, 0, 0
        done = np.asarray(state["done"])
        while not done.all():
            rows = done.shape[0]
            # shrink: stop as soon as the live rows fit in half the batch (min_freed is traced: no recompile)
            k = int((~done).sum()) - rows // 2 if shrink and rows > 1 else 1
            state = run(self.target.params, state, dparams, np.int32(k))
            n_chunks += 1
            rounds += int(state["round"])
            done = np.asarray(state["done"])
            if shrink and not done.all() and int((~done).sum()) <= rows // 2:
                host = _host_rows(state)
                collect(host, np.flatnonzero(host["done"] & (row_req >= 0)))
                state, row_req = self._shrink(state, host["done"], row_req)
                run = self._chunk_program(state, dparams, stop_on_done=True)
                done = np.asarray(state["done"])
                n_shrinks += 1
        jax.block_until_ready(state["out"])
        t3 = time.perf_counter()
        collect(_host_rows(state), np.flatnonzero(row_req >= 0))
        self._set_stats(results, prefill_s=t1 - t0 - c1, decode_s=t3 - t2 - (self.last_compile_s - c2),
                        chunks=n_chunks, rounds=rounds, **({"shrinks": n_shrinks} if shrink else {}))
        if experts[0] is not None:
            self.last_stats["distinct_experts_per_layer"] = experts
        return results

    def _shrink(self, state, done_B, row_req):
        """The live rows (in order) into a batch of the next power of two, padded with copies of a finished
        row (done, so they change nothing). -> (state, row_req of the new batch)."""
        live = np.flatnonzero(~done_B)
        n = _bucket(len(live), 1)
        idx = np.concatenate([live, np.full(n - len(live), np.flatnonzero(done_B)[0])]).astype(np.int32)
        row_req = np.where(np.arange(n) < len(live), row_req[idx], -1)
        args = (state, jax.device_put(idx))
        return self._program(_take_rows_jit, "take_rows", args)(*args), row_req

    def _generate_refill(self, prompts, C: int, max_new_tokens, temperature, top_p, top_k, seed, stop_ids,
                         refill_min: int = 1):
        """generate() with C rows for len(prompts) > C requests: every request has its own RNG stream
        (request_ids) and all share one cache length, so one chunk program serves the whole run; a chunk
        stops once min(refill_min, prompts waiting) requests have finished, the host collects them and prefills
        the next prompts into their rows. With no prompt waiting, chunks run on until every row is done."""
        toks = self._encode(prompts)
        N = len(toks)
        temp, tp, tk, new = _sampling_rows(N, temperature, top_p, top_k, max_new_tokens)
        for j in range(N):  # every request's errors before any work
            self._check_request(j, len(toks[j]), int(new[j]))
        kw = dict(seed=seed, stop_ids=stop_ids, out_new_tokens=int(new.max()),
                  cache_len=_bucket(self._largest_need([len(t) for t in toks], new)[1], 64))
        pick = lambda js: dict(temperature=temp[js], top_p=tp[js], top_k=tk[js], max_new_tokens=new[js],
                               request_ids=js, **kw)
        self.last_compile_s = 0.0
        t0 = time.perf_counter()
        first = list(range(C))
        _, state = self.start([toks[j] for j in first], **pick(first))
        jax.block_until_ready(state["out"])
        t1, c1 = time.perf_counter(), self.last_compile_s
        dparams = None if self.drafter is None else self.drafter.params
        run = self._chunk_program(state, dparams, stop_on_done=True)
        t2, c2 = time.perf_counter(), self.last_compile_s
        stops = set(int(s) for s in np.asarray(state["stop_ids"]) if s >= 0)
        row_req, nxt, results, n_chunks, rounds, n_refills = first, C, [None] * N, 0, 0, 0
        key = jax.device_put(jax.random.PRNGKey(seed))
        while any(j is not None for j in row_req):
            waiting = N - nxt  # no prompt waiting: nothing to refill, so no reason to stop early
            state = run(self.target.params, state, dparams, np.int32(min(refill_min, waiting) if waiting else C + 1))
            n_chunks += 1
            rounds += int(state["round"])
            host = _host_rows(state)
            free = [int(b) for b in np.flatnonzero(host["done"]) if row_req[b] is not None]
            for b in free:
                results[row_req[b]] = self._row_result(host, b, len(toks[row_req[b]]), stops)
                row_req[b] = None
            take = free[: N - nxt]
            if take:  # every row freed by this chunk takes its next prompt in one program
                n_refills += 1
                js = list(range(nxt, nxt + len(take)))
                state = self._refill(state, take, [toks[j] for j in js], js, temp[js], tk[js], tp[js], key,
                                     new[js], kw["cache_len"])
                for b, j in zip(take, js):
                    row_req[b] = j
                nxt += len(take)
        t3 = time.perf_counter()
        self._set_stats(results, prefill_s=t1 - t0 - c1, decode_s=t3 - t2 - (self.last_compile_s - c2),
                        chunks=n_chunks, rounds=rounds, refills=n_refills)
        return results

    def _check_request(self, i: int, n: int, max_new_tokens: int):
        ctx = self.target.max_context
        if n + max_new_tokens > ctx:
            raise EngineError(f"prompt {i} has {n} tokens; with max_new_tokens={max_new_tokens} it needs "
                              f"{n + max_new_tokens} positions but the model's context is {ctx}")

    def _set_stats(self, results, **kw):
        n_new = sum(len(r.tokens) for r in results)
        acc = [a for r in results for a in r.acceptance_lengths]
        self.last_stats = dict(kw, compile_s=self.last_compile_s, new_tokens=n_new,
                               decode_tokens_per_s=(n_new - len(results)) / max(kw["decode_s"], 1e-9),
                               mean_acceptance=float(np.mean(acc)) if acc else float("nan"))

    def _row_result(self, host, b: int, prompt_len: int, stops: set) -> GenerationResult:
        n_out, n_rounds = int(host["n_out"][b]), int(host["n_rounds"][b])
        toks = host["out"][b, :n_out].tolist()
        acc = host["acc_hist"][b, :n_rounds].tolist()
        reason = "stop" if toks and toks[-1] in stops else "length"
        tok = getattr(self.target, "tokenizer", None)
        text = None if tok is None else tok.decode([t for t in toks if t not in stops])
        return GenerationResult(toks, reason, prompt_len, acc, text, n_rounds)


def _per_prompt(name: str, value, n: int, dtype) -> np.ndarray:
    """A parameter given as one value or one per prompt, as n values."""
    v = np.asarray(value)
    if v.ndim > 1 or (v.ndim == 1 and len(v) != n):
        raise EngineError(f"{name} must be one value or one per prompt ({n}), got shape {v.shape}")
    if np.dtype(dtype).kind == "i" and v.dtype.kind not in "iu" and not (
            v.dtype.kind == "f" and np.all(v == np.round(v))):
        raise EngineError(f"{name} must be whole numbers, got {value!r}")
    return np.broadcast_to(v.astype(dtype), (n,)).copy()


def _sampling_rows(n: int, temperature, top_p, top_k, max_new_tokens):
    """Per-request temperature, top_p, top_k and max_new_tokens (each one value or one per prompt), checked."""
    temp, tp = _per_prompt("temperature", temperature, n, np.float32), _per_prompt("top_p", top_p, n, np.float32)
    tk, new = _per_prompt("top_k", top_k, n, np.int32), _per_prompt("max_new_tokens", max_new_tokens, n, np.int32)
    try:
        check_sampling_params(temp, tk, tp)
    except ValueError as e:
        raise EngineError(str(e)) from None
    if np.any(new < 1):
        raise EngineError(f"max_new_tokens must be >= 1, got {int(new.min())}")
    return temp, tp, tk, new


def _prompt_array(toks, rows: int) -> np.ndarray:
    """Prompts as a zero-padded [rows, T] array, T a power of two (a few prefill shapes, not one per length)."""
    out = np.zeros((rows, _bucket(max(map(len, toks)))), np.int32)
    for i, t in enumerate(toks):
        out[i, : len(t)] = t
    return out


def _request_state(caches, lens, first, keys, temp, top_k, top_p, rows, extra) -> DecodeState:
    """Fresh requests' device state, as start() and a refill build it."""
    return DecodeState(caches=caches, lengths=lens, bonus=first, keys=keys, temperature=temp, top_k=top_k,
                       top_p=top_p, **rows, **extra)


def _request_keys(key, ids_B):
    """Request i's RNG key: the same in whatever batch row or call it runs."""
    return jax.vmap(lambda i: jax.random.fold_in(key, i))(ids_B)


def _output_rows(first_B, stop_ids_S, max_new_B, M: int, R: int):
    """Fresh requests' output state: the first token emitted, done if that is a stop or max_new is 1. One
    program rather than a dozen eager ops."""
    B = first_B.shape[0]
    return dict(out=jnp.full((B, M), -1, jnp.int32).at[:, 0].set(first_B), n_out=jnp.ones((B,), jnp.int32),
                done=is_stop(first_B, stop_ids_S) | (max_new_B <= 1), stop_ids=stop_ids_S,
                max_new=max_new_B.astype(jnp.int32), acc_hist=jnp.zeros((B, R), jnp.int32),
                n_rounds=jnp.zeros((B,), jnp.int32), round=jnp.zeros((), jnp.int32))


def _take_rows(state, idx):
    """Rows idx of every per-request leaf (the round counter and stop ids are shared)."""
    return DecodeState({k: v if k in _SHARED_KEYS else jax.tree_util.tree_map(lambda x: x[idx], v)
                        for k, v in state.items()})


_take_rows_jit = jax.jit(_take_rows)
_request_keys_jit = jax.jit(_request_keys)
_output_rows_jit = jax.jit(_output_rows, static_argnums=(3, 4))


def _host_rows(state) -> dict:
    """The per-row outputs as host numpy arrays, fetched whole: slicing a device array with a row's own length
    (`out[b, :n]`) compiles a program per distinct length, ~0.1 s each on a GPU, which made refilled decoding
    ~10x slower than static batches (H100, 2026-12-05)."""
    return jax.device_get({k: state[k] for k in ("done", "out", "n_out", "n_rounds", "acc_hist", "experts")
                           if k in state})


def commit_tokens(st, new_BP, n_B):
    """Append n_B[b] tokens new_BP[b, :n] to request b's output, honouring stop ids and max_new.

    The last appended token becomes the new bonus. Records the round's commit count in the histogram."""
    B, P = new_BP.shape
    j_P = jnp.arange(P, dtype=jnp.int32)
    room_B = st["max_new"] - st["n_out"]
    valid_BP = (j_P[None] < jnp.minimum(n_B, room_B)[:, None]) & ~st["done"][:, None]
    stop_BP = is_stop(new_BP, st["stop_ids"]) & valid_BP
    # keep tokens up to and including the first stop token
    first_stop_B = jnp.where(jnp.any(stop_BP, 1), jnp.argmax(stop_BP, 1), P)
    keep_BP = valid_BP & (j_P[None] <= first_stop_B[:, None])
    k_B = jnp.sum(keep_BP, axis=1).astype(jnp.int32)
    M = st["out"].shape[1]
    idx_BP = jnp.where(keep_BP, st["n_out"][:, None] + j_P[None], M)  # out of range -> dropped
    st["out"] = st["out"].at[jnp.arange(B)[:, None], idx_BP].set(new_BP, mode="drop")
    last_B = jnp.take_along_axis(new_BP, jnp.maximum(k_B - 1, 0)[:, None], axis=1)[:, 0]
    live_B = ~st["done"]
    st["bonus"] = jnp.where(live_B & (k_B > 0), last_B, st["bonus"])
    st["acc_hist"] = st["acc_hist"].at[jnp.arange(B), st["n_rounds"]].set(
        jnp.where(live_B, k_B, 0), mode="drop")
    st["n_rounds"] = st["n_rounds"] + live_B.astype(jnp.int32)
    st["n_out"] = st["n_out"] + k_B
    st["done"] = st["done"] | jnp.any(stop_BP & keep_BP, 1) | (st["n_out"] >= st["max_new"])
    return st
