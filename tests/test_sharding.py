"""Sharding on 8 simulated CPU devices: every layout computes what one device computes (logits, greedy DDTree
output), tensors land on the right shards, layouts that do not divide the model fail clearly, a checkpoint
loads straight onto its shards, the MoE dispatch variants agree, the vocab-parallel top-K builds the same
tree, and the experiments CLI runs."""
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from kimijax import Engine
from kimijax.config import TINY
from kimijax.loading import SafetensorsDir, load_target, save_hf_checkpoint
from kimijax.models.drafter import random_drafter
from kimijax.spec import ddtree
from kimijax.target import KimiTarget, random_kimi_params
from sharding import ShardingError, make_mesh, param_shardings, parse_layout
from sharding.experiments import small_drafter_config, tiny8_config
from sharding.hlo import collectives
from sharding.vocab import topk_logprobs

pytestmark = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (simulated) devices: "
                                "XLA_FLAGS=--xla_force_host_platform_device_count=8 before jax starts")

LAYOUTS = ["tp8", "ep8", "ep4", "tp4ep2", "tp2ep4"]


@pytest.fixture(scope="module")
def ref():
    """tiny8 (8 heads, 16 experts, expert hidden 256) cut to 2 layers (dense + MoE), float32, one device."""
    cfg = dataclasses.replace(tiny8_config("float32"), num_hidden_layers=2)
    target = KimiTarget(cfg, random_kimi_params(cfg, seed=3))
    drafter = random_drafter(small_drafter_config(cfg, block_size=4), target, seed=1)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, cfg.vocab_size - 1, size=n).tolist() for n in (7, 3, 12, 5)]
    tokens = rng.integers(3, cfg.vocab_size - 1, size=(2, 8))
    logits = np.asarray(target.forward(tokens))
    greedy = Engine(target, drafter, method="ddtree", budget=4).generate(prompts, max_new_tokens=8, stop_ids=[])
    return dict(cfg=cfg, target=target, drafter=drafter, prompts=prompts, tokens=tokens, logits=logits,
                greedy=[r.tokens for r in greedy])


def _on(ref, layout, **kw):
    mesh = make_mesh(layout)
    return mesh, ref["target"].on_mesh(mesh, layout, **kw)


# ------------------------------------------------------------------ meshes and rules (cheap)
def test_layout_names():
    n = len(jax.devices())
    assert parse_layout("tp8").sizes(n) == {"data": 1, "expert": 1, "tensor": 8}
    assert parse_layout("ep8").sizes(n) == {"data": 1, "expert": 8, "tensor": 1}
    assert parse_layout("ep4").sizes(n) == {"data": 2, "expert": 4, "tensor": 1}  # 4-way EP x 2-way DP
    assert parse_layout("tp4ep2").sizes(n) == {"data": 1, "expert": 2, "tensor": 4}
    assert parse_layout("ep2tp2dp2").sizes(n) == {"data": 2, "expert": 2, "tensor": 2}
    assert parse_layout("tp2").sizes(4) == {"data": 2, "expert": 1, "tensor": 2}  # any device count
    mesh = make_mesh("tp4ep2")
    assert mesh.axis_names == ("data", "expert", "tensor") and mesh.devices.shape == (1, 2, 4)
    with pytest.raises(ShardingError, match="needs a multiple of 3 devices"):
        make_mesh("ep3")
    with pytest.raises(ShardingError, match="needs 16 devices"):
        make_mesh("dp2tp8")
    with pytest.raises(ShardingError, match="cannot parse"):
        make_mesh("tensor8")


def test_non_dividing_layout_raises_clearly():
    with pytest.raises(ShardingError, match=r"layers_\d+/mlp/\w+: dimension 0 \('expert', size 8\) is not "
                                            r"divisible by mesh axis 'expert' \(3\)"):
        param_shardings(TINY, make_mesh("ep3", jax.devices()[:3]))  # 8 experts on a 3-way axis
    with pytest.raises(ShardingError, match=r"self_attn/\w+: dimension 0 \('heads', size 4\).*'tensor' \(8\)"):
        param_shardings(TINY, make_mesh("tp8"))  # 4 heads on an 8-way axis
    with pytest.raises(ShardingError, match="layout 'ep8' means"):
        param_shardings(TINY, make_mesh("tp8"), layout="ep8")


def test_tensors_land_on_their_shards(ref):
    params = ref["target"].params
    _, t = _on(ref, "ep8")
    w = t.params["layers_1"]["mlp"]["gate_packed"]  # [16 experts, F, D/8]: 2 experts per device
    assert w.sharding.spec == P("expert")
    full = np.asarray(params["layers_1"]["mlp"]["gate_packed"])
    for s in w.addressable_shards:
        i = t.mesh.devices.reshape(-1).tolist().index(s.device)
        assert s.index[0] == slice(2 * i, 2 * i + 2) and s.data.shape == (2,) + full.shape[1:]
        np.testing.assert_array_equal(np.asarray(s.data), full[2 * i: 2 * i + 2])
    assert t.params["layers_1"]["mlp"]["gate"].sharding.spec == P()  # the router stays replicated
    assert t.params["lm_head"].sharding.spec == P("expert")  # vocab-parallel

    _, t = _on(ref, "tp4ep2")
    kvb = t.params["layers_0"]["self_attn"]["kv_b_proj"]  # [H=8, N+V, K]: 2 heads per tensor rank
    assert kvb.sharding.spec == P("tensor")
    full = np.asarray(params["layers_0"]["self_attn"]["kv_b_proj"])
    for s in kvb.addressable_shards:
        np.testing.assert_array_equal(np.asarray(s.data), full[s.index])
        assert s.data.shape[0] == 2
    down = t.params["layers_1"]["mlp"]["down_packed"]  # [E, D, F/8]: experts over expert, F over tensor
    assert down.sharding.spec == P("expert", None, "tensor")
    assert down.addressable_shards[0].data.shape == (8, 64, 256 // 8 // 4)
    assert t.params["lm_head"].sharding.spec == P(("expert", "tensor"))
    # the latent cache: batch over data, replicated over expert/tensor
    _, t = _on(ref, "ep4")
    c = t.init_cache(4, 16)[0]
    assert c.sharding.spec == P("data") and c.addressable_shards[0].data.shape == (2, 16, t.cfg.latent_dim)


# ------------------------------------------------------------------ numerics
@pytest.mark.parametrize("layout", LAYOUTS)
def test_logits_match_single_device(ref, layout):
    _, t = _on(ref, layout)
    out = t.forward(ref["tokens"])
    np.testing.assert_allclose(np.asarray(out), ref["logits"], atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("layout,dispatch", [("ep8", "a2a"), ("tp2ep4", "ragged"), ("ep4", "ragged")])
def test_moe_dispatch_variants_match(ref, layout, dispatch):
    _, t = _on(ref, layout, dispatch=dispatch)
    np.testing.assert_allclose(np.asarray(t.forward(ref["tokens"])), ref["logits"], atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("layout", ["tp8", "ep4", "tp4ep2"])  # ep8: through the experiments CLI below
def test_greedy_ddtree_matches_single_device(ref, layout):
    mesh, t = _on(ref, layout)
    d = ref["drafter"]
    d = d.on_mesh(mesh)
    eng = Engine(t, d, method="ddtree", budget=4, chunk_rounds=2)  # several chunks: the state goes round again
    res = eng.generate(ref["prompts"], max_new_tokens=8, stop_ids=[])
    assert [r.tokens for r in res] == ref["greedy"]
    # continuous batching: refilled rows keep the mesh's shardings
    res = eng.generate(ref["prompts"], max_new_tokens=8, stop_ids=[], max_batch=2)
    assert [r.tokens for r in res] == ref["greedy"]


@pytest.mark.parametrize("layout", ["tp4ep2"])
@pytest.mark.parametrize("chunk", [0, 16])  # 16: each shard's 64 ids in sliced top-K (the GPU path for few rows)
def test_vocab_parallel_topk_gives_the_same_tree(layout, chunk, monkeypatch):
    monkeypatch.setattr(ddtree, "default_topk_chunk", lambda rows: chunk)
    mesh = make_mesh(layout)
    logits = jax.random.normal(jax.random.PRNGKey(0), (4, 3, 512)) * 3
    logits = logits.at[0, 0, 500].set(logits[0, 0, 3])  # an exact tie across vocab shards
    want_v, want_i = jax.lax.top_k(jax.nn.log_softmax(logits, -1), 8)
    x = jax.device_put(logits, NamedSharding(mesh, P(None, None, ("expert", "tensor"))))
    f = jax.jit(lambda x: topk_logprobs(x, 8, mesh))
    v, i = f(x)
    np.testing.assert_array_equal(np.asarray(i), np.asarray(want_i))
    np.testing.assert_allclose(np.asarray(v), np.asarray(want_v), atol=1e-5)
    want = jax.jit(jax.vmap(lambda lg: ddtree.build_tree(lg, 8)))(logits)
    got = jax.jit(jax.vmap(lambda a, b: ddtree.build_tree_from_topk(a, b, 8)))(v, i)
    for field in ("tokens", "parents", "depths", "ancestor_mask"):
        np.testing.assert_array_equal(np.asarray(getattr(got, field)), np.asarray(getattr(want, field)))
    # no full-vocab gather: the only collectives move [B, L] sums and the [B, L, shards * K] candidates
    c = collectives(f.lower(x).compile().as_text())
    assert max(o["result_bytes"] for o in c["ops"]) <= 4 * 3 * 8 * 8 * 4


# ------------------------------------------------------------------ loading
def test_sharded_loading_reads_only_local_slices(ref, tmp_path, monkeypatch):
    cfg, params = ref["cfg"], ref["target"].params
    save_hf_checkpoint(cfg, params, tmp_path / "ck", shard_bytes=200_000)
    reads = []
    orig = SafetensorsDir.read

    def spy(self, name, first=None):
        reads.append((name, first))
        return orig(self, name, first)

    monkeypatch.setattr(SafetensorsDir, "read", spy)
    mesh = make_mesh("tp2ep4")
    t = load_target(tmp_path / "ck", mesh=mesh, layout="tp2ep4", progress=False, dtype="float32")
    assert t.mesh is mesh and t.expert_fn is not None
    want = param_shardings(cfg, mesh)
    for (path, a), s in zip(jax.tree_util.tree_flatten_with_path(t.params)[0], jax.tree_util.tree_leaves(want)):
        assert a.sharding == s, path
    monkeypatch.setattr(SafetensorsDir, "read", orig)
    single = load_target(tmp_path / "ck", progress=False, dtype="float32")  # the checkpoint holds bf16 floats
    flat_ref = dict(jax.tree_util.tree_flatten_with_path(single.params)[0])
    for path, a in jax.tree_util.tree_flatten_with_path(t.params)[0]:
        np.testing.assert_array_equal(np.asarray(a), np.asarray(flat_ref[path]))
    # every routed-expert read is one expert's half (F split 2-way over tensor), never the whole tensor
    expert_reads = [(n, f) for n, f in reads if ".experts." in n and "weight_shape" not in n]
    assert expert_reads and all(f is not None for _, f in expert_reads)
    # each expert tensor is read once per device holding a slice of it (tp2: 2 slices), not once per device
    n0 = [f for n, f in expert_reads if n.endswith("layers.1.mlp.experts.0.gate_proj.weight_packed")]
    assert len(n0) == 2 and {f[0].start for f in n0} == {0, 128}
    np.testing.assert_allclose(np.asarray(t.forward(ref["tokens"])), np.asarray(single.forward(ref["tokens"])),
                               atol=2e-4, rtol=1e-4)


# ------------------------------------------------------------------ HLO accounting and the CLI
def test_hlo_collective_accounting():
    mesh = make_mesh("ep8")

    def f(x, flag):
        y = jax.shard_map(lambda a: jax.lax.psum(a, "expert"), mesh=mesh, in_specs=P(None, "expert"),
                          out_specs=P())(x)  # all-reduce of [64, 8] f32 = 2048 B
        z = jax.lax.cond(flag, lambda: jax.shard_map(lambda a: jax.lax.all_gather(a, "expert", tiled=True),
                                                     mesh=mesh, in_specs=P("expert"), out_specs=P(),
                                                     check_vma=False)(x), lambda: x)
        return y, z

    c = collectives(jax.jit(f).lower(jnp.ones((64, 64), jnp.float32), True).compile().as_text())
    ar = [o for o in c["ops"] if o["kind"] == "all-reduce"]
    ag = [o for o in c["ops"] if o["kind"] == "all-gather"]
    assert [(o["operand_bytes"], o["conditional"]) for o in ar] == [(2048, False)]
    assert ag and all(o["conditional"] for o in ag) and ag[0]["result_bytes"] == 64 * 64 * 4
    assert c["executed_operand_bytes"] == 2048


def test_experiments_cli(tmp_path, capsys):
    from sharding.experiments import main
    out = tmp_path / "r.json"
    main(["--layouts", "single,ep8", "--model", "tiny8", "--layers", "2", "--method", "ddtree", "--budget", "4",
          "--batch", "2", "--prompt-len", "8", "--steps", "4", "--repeats", "1", "--out", str(out)])
    text = capsys.readouterr().out
    assert "step ms" in text and "ep8" in text
    res = json.loads(out.read_text())["results"]
    assert [(r["layout"], r["devices"]) for r in res] == [("single", 1), ("ep8", 8)]
    assert res[1]["same_tokens"]  # greedy DDTree under ep8 == one device
    assert res[0]["coll_bytes"] == 0 and res[1]["coll_bytes"] > 0 and res[1]["collectives"]["all-reduce"]["count"] >= 1
    assert res[1]["weights_bytes"] < res[0]["weights_bytes"] and all(r["step_ms"] > 0 for r in res)
    assert (tmp_path / "r.png").stat().st_size > 0


def test_two_processes_share_one_mesh():
    """jax.distributed on 2 CPU processes x 4 devices: each loads only its shards; logits equal one process's."""
    from sharding.multihost import check
    assert check("ep8", nproc=2, local_devices=4, timeout=240) < 1e-4


@pytest.mark.parametrize("layout", ["tp2ep4", "ep8"])
def test_kernel_expert_layout_on_a_mesh(layout):
    """Experts converted to the Pallas MoE's layout on the mesh: the transposed scales get their own specs
    (F over "tensor" on their last axis) and the model computes what the checkpoint layout computes."""
    from kimijax.target import resolve_expert_layout

    cfg = dataclasses.replace(tiny8_config("float32"), hidden_size=128, num_hidden_layers=2)
    single = KimiTarget(cfg, random_kimi_params(cfg, seed=5))
    tokens = np.random.default_rng(1).integers(3, cfg.vocab_size - 1, size=(2, 8))
    mesh = make_mesh(layout)
    t = dataclasses.replace(single.on_mesh(mesh, layout), expert_layout="kernel")
    mlp = t.params["layers_1"]["mlp"]
    assert "gate_planar" in mlp and "gate_packed" not in mlp
    tp = parse_layout(layout).sizes(8)["tensor"]
    want = P("expert", None, "tensor") if tp > 1 else P("expert")
    assert mlp["gate_scale_t"].sharding.spec == want
    np.testing.assert_allclose(np.asarray(t.forward(tokens)), np.asarray(single.forward(tokens)),
                               atol=2e-4, rtol=1e-4)
    # onto another mesh that fits the kernel layout: resharded as it is, no conversion
    import kimijax.target as kt

    def no_conversion(*a, **k):
        raise AssertionError("on_mesh converted a kernel-layout target that the new mesh fits")
    saved, kt.convert_expert_layout = kt.convert_expert_layout, no_conversion
    try:
        other = t.on_mesh(make_mesh("ep8" if layout != "ep8" else "tp2ep4"))
    finally:
        kt.convert_expert_layout = saved
    assert other.expert_layout == "kernel" and "gate_planar" in other.params["layers_1"]["mlp"]
    np.testing.assert_allclose(np.asarray(other.forward(tokens)), np.asarray(single.forward(tokens)),
                               atol=2e-4, rtol=1e-4)
    # back through on_mesh (via the checkpoint layout) onto a mesh whose F shards are too small for it
    assert resolve_expert_layout(cfg, "interpret", make_mesh("tp4ep2")) == "checkpoint"  # 256 / 4 = 64 rows
    t4 = t.on_mesh(make_mesh("tp4ep2"), "tp4ep2")
    assert t4.expert_layout == "checkpoint" and "gate_packed" in t4.params["layers_1"]["mlp"]


def test_mgpu_expert_layout_on_a_mesh():
    """The Mosaic MoE's layout on a mesh: F's row blocks / input groups split over "tensor", experts over
    "expert"; the model (the XLA reference reading that layout, psum'ed over both axes) computes what one
    device does, and moving to another mesh that fits reshards without converting."""
    cfg = dataclasses.replace(tiny8_config("float32"), hidden_size=128, num_hidden_layers=2)
    single = KimiTarget(cfg, random_kimi_params(cfg, seed=5))
    tokens = np.random.default_rng(1).integers(3, cfg.vocab_size - 1, size=(2, 8))
    t = dataclasses.replace(single.on_mesh(make_mesh("tp2ep4"), "tp2ep4"), expert_layout="mgpu")
    mlp = t.params["layers_1"]["mlp"]
    assert "gu_q" in mlp and "gate_packed" not in mlp
    assert mlp["gu_q"].sharding.spec == P("expert", "tensor")
    assert mlp["dn_s"].sharding.spec == P("expert", None, "tensor")
    np.testing.assert_allclose(np.asarray(t.forward(tokens)), np.asarray(single.forward(tokens)), atol=2e-4, rtol=1e-4)
    other = t.on_mesh(make_mesh("tp4ep2"))  # 256 / 4 = 64 rows per F shard: one block each
    assert other.expert_layout == "mgpu"
    assert other.params["layers_1"]["mlp"]["gu_q"].sharding.spec == P("expert", "tensor")
    np.testing.assert_allclose(np.asarray(other.forward(tokens)), np.asarray(single.forward(tokens)),
                               atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("layout", ["tp8", "tp4ep2"])
def test_drafter_fc_split_over_tensor(ref, layout):
    # on_mesh splits fc's input over "tensor" and the context projection is one psum: rows equal the
    # single-device drafter's (f32 model: up to summation order), fc bytes per device 1/tp
    from sharding.drafter_fc import fc_axis
    mesh = make_mesh(layout)
    d = ref["drafter"]
    dm = d.on_mesh(mesh)
    fc = dm.params["fc"]
    assert fc_axis(mesh, fc.shape[1]) == "tensor"
    tp = mesh.shape["tensor"]
    assert {s.data.nbytes for s in fc.addressable_shards} == {fc.nbytes // tp}
    rng = np.random.default_rng(3)
    feats = jnp.asarray(rng.normal(size=(d.cfg.num_features, 2, 5, d.cfg.hidden_size)), d.dtype)
    pos = jnp.broadcast_to(jnp.arange(5, dtype=jnp.int32), (2, 5))
    want = d.context_kv(d.params, feats, pos)
    got = jax.jit(dm.context_kv)(dm.params, feats, pos)
    for w, g in zip(want, got):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("layout", ["tp8", "tp4ep2", "dp2tp4"])
def test_tree_attention_runs_each_devices_heads(layout, monkeypatch):
    # A Pallas kernel is a custom call GSPMD cannot split (on a GPU it would all-gather q and run every head on
    # every device): sharding.attention_tp runs it under shard_map, each device on its H / tp heads
    from pallas_kernels import tree_attention as ta
    from sharding import attention_tp
    from sharding.mesh import mesh_sizes

    seen = []

    def spy(q, *a, **kw):
        seen.append(q.shape)
        return ta.tree_attention(q, *a, **kw)

    monkeypatch.setattr(attention_tp, "tree_attention", spy)
    mesh = make_mesh(layout)
    rng = np.random.default_rng(5)
    B, T, H, L, K, R = 4, 5, 8, 40, 16, 8
    q = jnp.asarray(rng.normal(size=(B, T, H, K + R)), jnp.float32)
    cache = jnp.asarray(rng.normal(size=(B, L, K + R)), jnp.float32)
    lengths = jnp.asarray([3, 20, 35, 0], jnp.int32)
    tree = jnp.asarray((np.tril(np.ones((T, T), bool)) & (rng.random((B, T, T)) < 0.7)) | np.eye(T, dtype=bool))
    fn = attention_tp.make_attention_fn(mesh)
    out, lse = jax.jit(lambda *a: fn(*a, 0.3, K, "interpret"))(q, cache, lengths, tree)
    ref_out, ref_lse = ta.tree_attention_ref(q, cache, lengths, tree, 0.3, K)
    sizes = mesh_sizes(mesh)
    assert seen and all(s == (B // sizes["data"], T, H // sizes["tensor"], K + R) for s in seen), (seen, sizes)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref_out), atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), atol=2e-5, rtol=1e-5)
    assert out.sharding.spec[2] == "tensor"


def test_tree_attention_heads_must_divide():
    from sharding.attention_tp import make_attention_fn

    fn = make_attention_fn(make_mesh("tp8"))
    q = jnp.zeros((1, 2, 6, 24), jnp.float32)  # 6 heads on an 8-way tensor axis
    with pytest.raises(ShardingError, match="6 attention heads"):
        fn(q, jnp.zeros((1, 8, 24)), jnp.zeros((1,), jnp.int32), jnp.ones((1, 2, 2), bool), 0.3, 16, "xla")
