"""scripts/bench_kimi.py and its report module scripts/kimi_report.py: pure helpers, and one --smoke run end to
end on CPU (parent + main child + one XLA-flag child, then --project-from on the saved JSON)."""

import json
import os
import subprocess
import sys
import types

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..")
SCRIPT = os.path.join(ROOT, "scripts", "bench_kimi.py")
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import bench_kimi as bk  # noqa: E402
import kimi_report as kr  # noqa: E402


def test_scope_category():
    base = "jit(_chunk_fn)/while/body"
    assert bk.scope_category(f"{base}/verify/Kimi/layer_3/layers_3/self_attn/mla_absorbed/dot") == ("attention", 3)
    assert bk.scope_category(f"{base}/verify/Kimi/layer_2/layers_2/mlp/router/top_k") == ("router", 2)
    assert bk.scope_category(f"{base}/verify/Kimi/layer_2/layers_2/mlp/experts/moe_gate_up") == ("moe_routed", 2)
    assert bk.scope_category(f"{base}/verify/Kimi/layer_2/layers_2/mlp/shared_expert/x") == ("moe_shared", 2)
    assert bk.scope_category(f"{base}/verify/Kimi/layer_0/layers_0/dense_mlp/mlp/dot") == ("dense_mlp", 0)
    assert bk.scope_category(f"{base}/verify/Kimi/layer_1/layers_1/input_layernorm/mul") == ("other", 1)
    assert bk.scope_category(f"{base}/draft/DFlash.block/drafter_layer_0/layers_0/self_attn/dot") == ("drafter", None)
    assert bk.scope_category(f"{base}/verify/Kimi.logits/btd,vd->btv/dot_general") == ("lm_head", None)
    assert bk.scope_category(f"{base}/tree/vmap(ddtree_topk)/top_k") == ("tree", None)
    assert bk.scope_category(f"{base}/commit/DFlash.context_kv/x") == ("commit", None)
    assert bk.scope_category(f"{base}/Kimi/layer_4/layers_4/self_attn/x") == ("attention", 4)  # AR round


HLO = """HloModule jit__chunk_fn, entry_computation_layout={()->()}

%command_buffer (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  %fusion.1 = f32[4]{0} fusion(f32[4]{0} %p), kind=kLoop, calls=%fused_a, metadata={op_name="jit(_chunk_fn)/while/body/verify/Kimi/layer_1/layers_1/self_attn/mla_proj/dot"}
  ROOT %fusion.2 = f32[4]{0} fusion(f32[4]{0} %fusion.1), kind=kLoop, calls=%fused_b
}

%body (arg: (s32[], f32[4])) -> (s32[], f32[4]) {
  %arg = (s32[], f32[4]{0}) parameter(0)
  %gte = f32[4]{0} get-tuple-element((s32[], f32[4]{0}) %arg), index=1
  %call.1 = f32[4]{0} call(f32[4]{0} %gte), to_apply=%command_buffer
  %cc.3 = f32[4]{0} custom-call(f32[4]{0} %call.1), custom_call_target="__cublas$gemm"
  %i = s32[] get-tuple-element((s32[], f32[4]{0}) %arg), index=0
  ROOT %t = (s32[], f32[4]{0}) tuple(s32[] %i, f32[4]{0} %cc.3)
}

%cond (arg: (s32[], f32[4])) -> pred[] {
  %arg = (s32[], f32[4]{0}) parameter(0)
  %i = s32[] get-tuple-element((s32[], f32[4]{0}) %arg), index=0
  %c = s32[] constant(8)
  ROOT %lt = pred[] compare(s32[] %i, s32[] %c), direction=LT
}

ENTRY %main (a: (s32[], f32[4])) -> (s32[], f32[4]) {
  %a = (s32[], f32[4]{0}) parameter(0)
  ROOT %while.1 = (s32[], f32[4]{0}) while((s32[], f32[4]{0}) %a), condition=%cond, body=%body
}
"""


def test_command_buffer_stats():
    st = bk.command_buffer_stats(HLO)
    rb = st["round_body"]
    assert st["command_buffer_computations"] == 1
    assert (rb["ops"], rb["ops_in_cb"], rb["cb_calls"]) == (3, 2, 1)  # 2 fusions in the graph, the gemm outside
    assert st["total"]["whiles"] == 1 and st["total"]["ops"] == 4  # + the loop condition's compare
    names = bk.op_names(HLO)
    assert bk.scope_category(names["fusion.1"]) == ("attention", 1)
    assert names["fusion_1"] == names["fusion.1"]  # kernel-name spelling


def test_projection_helpers():
    assert kr._binom_max_mean(48, 0.0, 8) == 0.0
    m = kr._binom_max_mean(48, 0.25, 8)
    assert 12 < m < 20  # mean 12 per device; the busiest of 8 is above it
    cfg = dict(hidden_size=7168, first_k_dense_replace=1)
    info = dict(block_size=8, drafter_layers=6)
    tp = kr.collective_plan("tp8", "b8", 1, 9, cfg, info, 61)
    ep = kr.collective_plan("ep8", "b8", 1, 9, cfg, info, 61)
    assert sum(c for _, _, c in tp) == 2 * 61 + 1 + 13 + 1 + 2 + 1 + 2  # + 1: the drafter fc's psum
    assert sum(c for _, _, c in ep) == 60 + 1 + 1 + 2 + 1 + 2
    assert sum(c for _, _, c in kr.collective_plan("tp8", "ar", 1, 1, cfg, info, 61)) == 2 * 61 + 1 + 2
    ms, n = kr.collective_ms([("all-reduce", 0, 10)], 8, 900e9, 10.0)
    assert n == 10 and ms == pytest.approx(0.1)


def test_plan_cases_priority():
    args = types.SimpleNamespace(budgets=[4, 8, 16, 32], batches=[1, 8, 32, 128], contexts=[4096, 32768],
                                 engine_cases=None, component_cases=None, engine_batches=[1])
    first, comps, rest = bk.plan_cases(args)
    key3 = ("ar", "b8", "b16")
    assert first == [(m, 1, 4096) for m in key3]
    assert comps[:9] == [(m, B, 4096) for B in (1, 128, 8) for m in key3]
    assert rest[:3] == [(m, 8, 4096) for m in key3]
    assert len(comps) == 40 and len(first) + len(rest) == 40 and len(set(first + rest)) == 40
    args.engine_batches = [1, 8]
    first, _, rest = bk.plan_cases(args)
    assert first == [(m, B, 4096) for B in (1, 8) for m in key3] and len(first) + len(rest) == 40


def test_smoke_end_to_end(tmp_path):
    out = tmp_path / "bench_kimi.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    # the kernel layout under the XLA reference (CPU), so the checkpoint-layout comparison runs too
    r = subprocess.run([sys.executable, SCRIPT, "--smoke", "--expert-layout", "kernel", "--out", str(out)], env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    res = json.loads(out.read_text())
    assert res["slice"]["expert_layout"] == "kernel"
    (case,) = res["cases"]
    assert case["method"] == "b4" and case["round_ms"] > 0 and case["profile"]["layer_ms"], case
    assert len(case["distinct_experts_per_layer"]) == res["slice"]["moe_layers"]
    (row,) = [x for x in res["summary"] if x["method"] == "b4"]
    assert row["source"].startswith("engine profile") and row["layer_ms"] > 0 and row["floor"]["ms"] > 0
    assert row["components_round_ms"] > 0 and row["parts"]["round"]["drafter"] > 0
    (comp,) = res["components"]
    assert comp["moe_ms"] > 0 and comp["moe_checkpoint_layout_ms"] > 0 and comp["drafter_ms"] > 0
    (var,) = res["xla_flags"]["variants"]
    assert var["result"]["method"] == "ar" and var["result"]["round_ms"] > 0, var
    assert res["projection"]["label"].startswith("PROJECTION")
    proj = [p for p in res["projection"]["rows"] if p["method"] == "b4"]
    assert proj and all(p["tok_s"] > 0 for p in proj)
    assert {b["status"] for b in res["bars"]} <= {"met", "missed", "not measured"}
    assert "| case |" in r.stdout and "PROJECTION" in r.stdout
    for f in ("bench_kimi.png", "bench_kimi_hlo_main_b4.txt.gz", "bench_kimi_hlo_default.txt.gz"):
        assert (tmp_path / f).exists(), f
    # recompute the projection from the saved run with another acceptance length: no device, no measurement
    out2 = tmp_path / "again.json"
    bk.main(["--project-from", str(out), "--acceptance", "b4=1.5", "--out", str(out2)])
    res2 = json.loads(out2.read_text())
    p1 = {(p["layout"], p["link"], p["concurrency"]): p for p in proj}
    for p in res2["projection"]["rows"]:
        if p["method"] == "b4":
            q = p1[(p["layout"], p["link"], p["concurrency"])]
            assert p["round_ms"] == pytest.approx(q["round_ms"])
            assert p["tok_s"] == pytest.approx(q["tok_s"] * 1.5 / 3.0)
    # a per-layer split from components is held against the experts that component routed to, and the projection
    # scales routed-expert time to the Engine tree's own distinct experts
    res3 = json.loads(out.read_text())
    res3["cases"][0].pop("profile")
    res3["cases"][0]["distinct_experts_per_layer"] = [1.0] * res["slice"]["moe_layers"]
    (row,) = [x for x in kr.summarize(res3) if x["method"] == "b4"]
    assert row["source"] == "components" and row["distinct_batch"] == 1.0
    assert row["distinct_layer"] == row["floor"]["distinct"] == comp["distinct_experts_batch"]
    args = bk.parse_args(["--smoke"])
    scaled = [p for p in kr.project(res3, [row], args)["rows"] if "routed_expert_time_scale" in p]
    assert scaled and all(p["routed_expert_time_scale"] == pytest.approx(1.0 / comp["distinct_experts_batch"])
                          for p in scaled)


def test_permuted_copy_keeps_values_and_casts_scales():
    import jax
    import jax.numpy as jnp
    import numpy as np

    tree = {"w": jnp.arange(12, dtype=jnp.float32).reshape(3, 4), "gate_scale": jnp.full((2, 3), 0.5, jnp.float32),
            "bias": jnp.arange(5, dtype=jnp.float32)}
    out = bk._permuted_copy(jax.random.PRNGKey(1), tree, jnp.bfloat16)
    assert out["gate_scale"].dtype == jnp.bfloat16 and out["w"].dtype == jnp.float32
    for k in ("w", "bias"):  # same values (a permutation along the first and last axes), other positions
        assert sorted(np.asarray(out[k]).ravel().tolist()) == sorted(np.asarray(tree[k]).ravel().tolist())
    assert not np.array_equal(np.asarray(out["w"]), np.asarray(tree["w"]))


def test_profile_round_scopes():
    # scripts/profile_round.py: kernels grouped by stage and folded scope path
    import profile_round as pr

    base = "jit(_chunk_fn)/while/body"
    assert pr.scope_key(f"{base}/verify/Llama/layer_3/layers_3/self_attn/attn/dot_general", 4) == \
        ("verify", "verify/layer_*/self_attn/attn")
    assert pr.scope_key(f"{base}/draft/DFlash.block/drafter_layer_1/layers_1/mlp/x", 3) == \
        ("draft", "draft/DFlash.block/dlayer_*")
    assert pr.scope_key(f"{base}/tree/vmap(ddtree_frontier)/reduce", 4) == ("tree", "tree/ddtree_frontier/reduce")
    assert pr.scope_key(f"{base}/Llama/layer_0/layers_0/mlp/mlp/dot", 2)[0] == "step"  # the AR step
    evs = [("fusion.1", "jit__chunk_fn", 2000.0, "loop_fusion_1"), ("custom-call", "jit__chunk_fn", 4000.0, "topk")]
    rec = pr.attribute(evs, {"fusion.1": f"{base}/verify/Llama/layer_3/layers_3/mlp/x"}, 3, rounds=2)
    assert rec["kernels_per_round"] == 1.0 and abs(rec["kernel_ms_per_round"] - 0.003) < 1e-12
    assert rec["stages"]["verify"]["n"] == 0.5 and rec["unattributed"]["ms"] == 0.002


def test_profile_block_runs_on_cpu(capsys):
    import profile_block

    profile_block.main(["--block", "moe", "--tokens", "1,3"])
    out = capsys.readouterr().out
    assert "MoE impl interpret" in out and "N=1 tokens" in out and "N=3 tokens" in out
    profile_block.main(["--block", "attn", "--cases", "1:64,5:37", "--attn-impl", "interpret"])
    out = capsys.readouterr().out
    assert "attention impl interpret, T=1 tokens over L=64" in out and "T=5 tokens over L=37" in out


def test_engine_calibration():
    sl = dict(attn_impl="auto", moe_impl="pallas", expert_layout="kernel", drafter_layers=6, block_size=8,
              draft_window=None)
    case = lambda r: dict(method="b8", batch=1, ctx=4096, round_ms=r)
    deep = dict(slice=dict(sl, layers=9, moe_layers=8), cases=[case(8.0)])
    shallow = dict(slice=dict(sl, layers=3, moe_layers=2), cases=[case(5.0), dict(case(1.0), method="ar")])
    cal = kr.engine_calibration(deep, shallow)
    assert list(cal["cases"]) == ["b8/B1/4k"] and cal["cases"]["b8/B1/4k"]["layer_ms"] == pytest.approx(0.5)
    # parts: MoE layer 1.0 ms of components (0.6 of it routed, scaled by 0.5 -> 0.7), dense layer 0.5, round 2.0
    P = dict(moe_layer=dict(attention=0.3, moe_routed=0.6, router=0.1), dense_layer=dict(attention=0.3, dense_mlp=0.2),
             round=dict(drafter=1.5, tree=0.5))
    c = kr.calibrate_parts(P, 0.5, dict(layers=9, moe_layers=8), cal["cases"]["b8/B1/4k"])
    assert c["layer_ms_components"] == pytest.approx(0.7) and c["f_layer"] == pytest.approx(0.5 / 0.7)
    # rest of the round: 8.0 - 8 x 0.5 - 1 x 0.5 x f_layer
    assert c["f_round"] == pytest.approx((8.0 - 4.0 - 0.5 * 0.5 / 0.7) / 2.0)
    with pytest.raises(ValueError, match="fewer MoE layers"):
        kr.engine_calibration(shallow, deep)
    with pytest.raises(ValueError, match="attn_impl"):
        kr.engine_calibration(deep, dict(shallow, slice=dict(shallow["slice"], attn_impl="xla")))
