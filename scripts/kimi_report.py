"""Derived numbers, the 8-GPU projection and the report of scripts/bench_kimi.py (no jax, no GPU): per-case parts
and HBM floors from a run's JSON, the PROJECTION (module docstring of bench_kimi.py: byte-share model, collective
cost model, the Engine-calibrated variant), the bars, the markdown table and the plot.  bench_kimi.py's
`--project-from` recomputes all of it from a saved JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import os

from bench_slice import kimi_bytes, uniform_distinct  # noqa: E402  (imports jax, does not start a backend)

LAYER_CATS = ("attention", "router", "moe_routed", "moe_shared", "dense_mlp", "other")
ROUND_CATS = ("drafter", "tree", "lm_head", "accept", "commit", "embed", "other")
MAX_UNATTRIBUTED = 0.2  # an Engine profile with more kernel time outside known ops than this is not used


def case_key(method: str, B: int, ctx: int) -> str:
    return f"{method}/B{B}/{ctx_label(ctx)}"


def ctx_label(ctx: int) -> str:
    return f"{ctx // 1024}k" if ctx % 1024 == 0 else str(ctx)


def drafter_slots(info: dict, S: int, read: bool = False) -> int:
    """Drafter context rows per request: held in its cache (a ring of window + block slots with a draft window,
    spec/round.py) or, read=True, read by one draft pass (the window)."""
    W = info.get("draft_window")
    if W is None:
        return S
    return min(S, W if read else W + info["block_size"])


def write_json(path: str, obj):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, default=float)
    os.replace(tmp, path)


# ---------------------------------------------------------------- derived numbers (no jax)
def case_parts(rec: dict, info: dict, kind: str) -> dict | None:
    """Per-round parts in ms on the slice: moe_layer / dense_layer {category: ms} (one layer; 'gap' = launch
    gaps spread by kernel count) and round {category: ms}."""
    if kind == "engine":
        p = rec.get("profile")
        if not p or not p["layer_ms"]:
            return None
        if p.get("source") == "device" and p.get("unattributed_ms", 0.0) > MAX_UNATTRIBUTED * p["kernel_ms"]:
            # On the H200 XLA kept its command buffers (CUDA graphs) under the profiler: a graph shows up as
            # one `command_buffer_N` event with no HLO op, so the per-layer split would count only the few
            # kernels outside graphs (a layer "faster than its HBM floor"). Use the components instead.
            # (CPU smoke runs profile host thunks: XLA:CPU's bitcast copies carry no op name and took
            # 19-23 % of the time there, which says nothing about graphs.)
            return None
        n_k = sum(p["cat_n"].values()) + sum(p["layer_n"].values())
        gap_per = max(rec["round_ms"] - p["kernel_ms"], 0.0) / max(n_k, 1)
        moe_ids = [l for l in p["layer_ms"] if int(l) > 0]
        def layer_mean(ids):
            if not ids:
                return {}
            d = {c: sum(p["layer_ms"][l].get(c, 0.0) for l in ids) / len(ids) for c in LAYER_CATS}
            d["gap"] = sum(p["layer_n"][l] for l in ids) / len(ids) * gap_per
            return d
        rnd = {c: p["cat_ms"].get(c, 0.0) for c in ROUND_CATS}
        rnd["other"] += p["cat_ms"].get("unattributed", 0.0)
        rnd["gap"] = sum(p["cat_n"].values()) * gap_per
        dense = layer_mean(["0"] if "0" in p["layer_ms"] else [])
        return dict(source="engine profile", moe_layer=layer_mean(moe_ids), dense_layer=dense, round=rnd,
                    gap_per_kernel_ms=gap_per, unattributed_ms=p.get("unattributed_ms", 0.0))
    cfg = info["cfg"]
    kb = kimi_bytes(argparse.Namespace(**cfg))
    moe_layer = {}
    if "moe_ms" in rec:
        d = rec["distinct_experts_batch"]
        routed_b, shared_b = d * kb["expert"], kb["shared"]
        rest = max(rec["moe_ms"] - rec["router_ms"], 0.0)
        moe_layer = dict(attention=rec["attn_ms"], router=rec["router_ms"],
                         moe_routed=rest * routed_b / (routed_b + shared_b),
                         moe_shared=rest * shared_b / (routed_b + shared_b), dense_mlp=0.0, other=0.0, gap=0.0)
    dense = dict(attention=rec["attn_ms"], dense_mlp=rec["dense_mlp_ms"], router=0.0, moe_routed=0.0, moe_shared=0.0,
                 other=0.0, gap=0.0)
    rnd = dict(drafter=rec.get("drafter_ms", 0.0), tree=rec.get("tree_ms", 0.0), lm_head=rec["head_ms"],
               accept=rec["accept_ms"], commit=rec.get("ctx_kv_ms", 0.0), embed=0.0, other=0.0, gap=0.0)
    return dict(source="components", moe_layer=moe_layer, dense_layer=dense, round=rnd)


def layer_floor(info: dict, roof: float, B: int, S: int, distinct: float | None, dense: bool = False) -> dict:
    cfg = info["cfg"]
    kb = kimi_bytes(argparse.Namespace(**cfg))
    kv = B * S * kb["kv_row"]
    if dense:
        w = kb["attn"] + kb["dense_mlp"]
    else:
        w = kb["attn"] + kb["router"] + kb["shared"] + distinct * kb["expert"]
    return dict(weights=w, kv=kv, total=w + kv, ms=(w + kv) / roof * 1e3, distinct=distinct)


def round_floor(info: dict, roof: float, B: int, S: int, method: str, distinct: float) -> float:
    """ms: the slice's layers + lm_head (+ drafter weights, its lm_head and context cache, commit's fc)."""
    cfg = info["cfg"]
    kb = kimi_bytes(argparse.Namespace(**cfg))
    n_moe = info["moe_layers"]
    b = kb["head"] + layer_floor(info, roof, B, S, None, dense=True)["total"] * (info["layers"] - n_moe)
    b += n_moe * layer_floor(info, roof, B, S, distinct)["total"]
    if method != "ar":
        b += info["drafter_bytes"] + kb["head"] + B * drafter_slots(info, S, read=True) * info["drafter_kv_row"] * info["drafter_layers"]
    return b / roof * 1e3


def summarize(result: dict) -> list[dict]:
    """One row per (method, B, ctx): Engine numbers where they exist, components otherwise."""
    info, roof = result["slice"], result["roof_bytes_per_s"]
    cfg = info["cfg"]
    E, k = cfg["n_routed_experts"], cfg["num_experts_per_tok"]
    comps = {case_key(r["method"], r["batch"], r["ctx"]): r for r in result.get("components", [])}
    engs = {case_key(r["method"], r["batch"], r["ctx"]): r for r in result.get("cases", [])}
    rows = []
    for key in list(engs) + [k_ for k_ in comps if k_ not in engs]:
        e, c = engs.get(key), comps.get(key)
        base = e or c
        method, B, ctx, S, T = base["method"], base["batch"], base["ctx"], base["S"], base["width"]
        parts = case_parts(e, info, "engine") if e else None
        if parts is None and c:
            parts = case_parts(c, info, "components")
        uni_req = uniform_distinct(E, k, T)
        uni_batch = uniform_distinct(E, k, B * T)
        meas_req = None
        if e and e.get("distinct_experts_per_layer"):
            meas_req = sum(e["distinct_experts_per_layer"]) / len(e["distinct_experts_per_layer"])
        if method == "ar" and B == 1:
            d_batch, d_src = float(k), "exact (1 token)"
        elif B == 1 and meas_req is not None:
            d_batch, d_src = meas_req, "measured (Engine, tree tokens)"
        elif c and "distinct_experts_batch" in c:
            d_batch, d_src = float(c["distinct_experts_batch"]), "measured (router on random hidden states)"
        else:
            d_batch, d_src = uni_batch, "uniform-routing estimate"
        # the layer floor counts the experts the timed layer actually routed to: component MoE timings route
        # random hidden states (T=9: ~64 experts), while an Engine tree's tokens share experts (~25)
        d_layer = d_batch
        if parts and parts["source"] == "components" and c and "distinct_experts_batch" in c and not (
                method == "ar" and B == 1):
            d_layer = float(c["distinct_experts_batch"])
        fl = layer_floor(info, roof, B, S, d_layer)
        src = parts["source"] if parts else "none"
        if parts and parts["source"] == "components" and c.get("drafter_skipped"):
            src += " (drafter not measured: memory)"
        if parts and parts["source"] == "engine profile" and parts["unattributed_ms"] > 0.05 * e["profile"]["kernel_ms"]:
            src += f" ({parts['unattributed_ms'] / e['profile']['kernel_ms']:.0%} of kernel time unattributed)"
        row = dict(key=key, method=method, batch=B, ctx=ctx, S=S, width=T, source=src,
                   round_ms=e["round_ms"] if e else None, floor=fl, distinct_source=d_src,
                   distinct_per_request_measured=meas_req, distinct_per_request_uniform=uni_req,
                   distinct_batch=d_batch, distinct_layer=d_layer, distinct_batch_uniform=uni_batch, parts=parts,
                   round_floor_ms=round_floor(info, roof, B, S, method, d_batch))
        if parts and parts["moe_layer"]:
            ml = parts["moe_layer"]
            row["layer_ms"] = sum(ml.values())
            row["layer_kernel_ms"] = row["layer_ms"] - ml.get("gap", 0.0)
            row["layer_over_floor"] = row["layer_ms"] / fl["ms"]
            row["model_round_ms"] = slice_round_ms(parts, info)
        if c and e and c.get("moe_ms") is not None:
            cp = case_parts(c, info, "components")
            row["components_layer_ms"] = sum(cp["moe_layer"].values())
            row["components_round_ms"] = slice_round_ms(cp, info)
        rows.append(row)
    return rows


def slice_round_ms(parts: dict, info: dict) -> float:
    """A round of the slice rebuilt from its parts (dense layers + MoE layers + per-round parts)."""
    n_moe = info["moe_layers"]
    return (sum(parts["dense_layer"].values()) * (info["layers"] - n_moe) + sum(parts["moe_layer"].values()) * n_moe
            + sum(parts["round"].values()))


# ---------------------------------------------------------------- projection (no jax)
def _binom_max_mean(n: int, p: float, devices: int) -> float:
    """E[max of `devices` iid Binomial(n, p)] (exact sum over the CDF)."""
    pmf = [math.comb(n, i) * p ** i * (1 - p) ** (n - i) for i in range(n + 1)]
    cdf, acc = [], 0.0
    for v in pmf:
        acc += v
        cdf.append(min(acc, 1.0))
    return sum(1 - cdf[m - 1] ** devices for m in range(1, n + 1))


def device_shares(cfg: dict, layout: str, B: int, S: int, distinct: float, ndev: int, info: dict) -> dict:
    """Each part's bytes per device / bytes on one GPU in kimijax's layouts (sharding/rules.py)."""
    kb = kimi_bytes(argparse.Namespace(**cfg))
    kv = B * S * kb["kv_row"]
    E = cfg["n_routed_experts"]
    dr_block = info["drafter_bytes"] - info["drafter_fc_bytes"]
    dr_cache = B * drafter_slots(info, S, read=True) * info["drafter_kv_row"] * info["drafter_layers"]
    if layout == "tp8":
        attn = (kb["attn"] - kb["attn_heads"] + kb["attn_heads"] / ndev + kv) / (kb["attn"] + kv)
        drafter = (dr_block / ndev + dr_cache / ndev + kb["head"] / ndev) / (dr_block + dr_cache + kb["head"])
        return dict(attention=attn, router=1.0, moe_routed=1 / ndev, moe_shared=1 / ndev, dense_mlp=1 / ndev,
                    other=1.0, gap=1.0, lm_head=1 / ndev, embed=1.0, drafter=drafter, tree=1.0,
                    accept=1 / ndev, commit=1 / ndev, round_other=1.0)  # commit: fc and K/V split (drafter.on_mesh)
    e_loc = E // ndev
    worst = _binom_max_mean(e_loc, min(distinct / E, 1.0), ndev) if distinct > 0 else 0.0
    drafter = (dr_block + dr_cache + kb["head"] / ndev) / (dr_block + dr_cache + kb["head"])
    return dict(attention=1.0, router=1.0, moe_routed=worst / max(distinct, 1e-9), moe_shared=1.0, dense_mlp=1.0,
                other=1.0, gap=1.0, lm_head=1 / ndev, embed=1.0, drafter=drafter, tree=1.0, accept=1 / ndev,
                commit=1.0, round_other=1.0, experts_on_busiest_device=worst)


def collective_plan(layout: str, method: str, B: int, T: int, cfg: dict, info: dict, n_layers: int) -> list:
    """[(kind, bytes per device, count)] per round (module docstring)."""
    D = cfg["hidden_size"]
    act = B * T * D * 2
    n_moe = n_layers - cfg.get("first_k_dense_replace", 1)
    spec = method != "ar"
    bs = info["block_size"]
    small = B * bs * 8
    plan = []
    if layout == "tp8":
        plan.append(("all-reduce", act, 2 * n_layers + 1))
        if spec:
            plan.append(("all-reduce", B * bs * D * 2, 2 * info["drafter_layers"] + 1))
            plan.append(("all-reduce", B * bs * D * 4, 1))  # the context step's fc psum (f32, sharding/drafter_fc.py)
    else:
        plan.append(("all-reduce", act, n_moe + 1))
        if spec:
            plan.append(("all-reduce", B * bs * D * 2, 1))
    if spec:
        plan.append(("all-reduce", small, 2))
        plan.append(("all-gather", small * 8, 1))
    plan.append(("all-gather", B * T * 8, 2))
    return plan


def collective_ms(plan: list, ndev: int, bw: float, lat_us: float) -> tuple[float, int]:
    t, n = 0.0, 0
    for kind, nbytes, count in plan:
        algo = 2 * (ndev - 1) / ndev * nbytes if kind == "all-reduce" else (ndev - 1) / ndev * nbytes
        t += count * (lat_us * 1e-3 + algo / bw * 1e3)
        n += count
    return t, n


def engine_calibration(deep: dict, shallow: dict) -> dict:
    """What one MoE layer adds to a real Engine round: (round of the deep slice - round of the shallow slice) /
    (their difference in MoE layers), per case both slices ran through the Engine. The two runs must use the
    same kernels and drafter (same script, ideally the same device session)."""
    ds, ss = deep["slice"], shallow["slice"]
    for k in ("attn_impl", "moe_impl", "expert_layout", "drafter_layers", "block_size", "draft_window"):
        if ds.get(k) != ss.get(k):
            raise ValueError(f"--calibrate-with: the slices differ in {k} ({ds.get(k)!r} vs {ss.get(k)!r})")
    dm, sm = ds["moe_layers"], ss["moe_layers"]
    if dm <= sm:
        raise ValueError(f"--calibrate-with needs a slice with fewer MoE layers ({sm} vs this run's {dm})")
    sh = {case_key(r["method"], r["batch"], r["ctx"]): r for r in shallow.get("cases", [])}
    cases = {}
    for r in deep.get("cases", []):
        k = case_key(r["method"], r["batch"], r["ctx"])
        s = sh.get(k)
        if s and r.get("round_ms") and s.get("round_ms"):
            cases[k] = dict(deep_round_ms=r["round_ms"], shallow_round_ms=s["round_ms"],
                            layer_ms=(r["round_ms"] - s["round_ms"]) / (dm - sm))
    return dict(deep_moe_layers=dm, shallow_moe_layers=sm, shallow_command=shallow.get("command"),
                shallow_date=shallow.get("date"), shallow_roof_bytes_per_s=shallow.get("roof_bytes_per_s"),
                cases=cases)


def calibrate_parts(P: dict, routed: float, info: dict, cal: dict) -> dict:
    """Factors that rescale a case's component parts to its Engine round: f_layer = the Engine's per-MoE-layer
    time / the components' MoE layer (routed-expert time scaled as the projection scales it), applied to the
    dense layer too; f_round = the rest of the Engine round (round - layers) / the components' per-round
    parts, or None where that rest is not positive (then the per-round parts stay as measured)."""
    comp_layer = sum(v * (routed if c == "moe_routed" else 1.0) for c, v in P["moe_layer"].items())
    comp_dense = sum(P["dense_layer"].values()) if P["dense_layer"] else comp_layer
    comp_round = sum(P["round"].values())
    f_layer = cal["layer_ms"] / comp_layer
    n_dense = info["layers"] - info["moe_layers"]
    rest = cal["deep_round_ms"] - info["moe_layers"] * cal["layer_ms"] - n_dense * comp_dense * f_layer
    f_round = rest / comp_round if comp_round > 0 and rest > 0 else None
    return dict(layer_ms_engine=cal["layer_ms"], layer_ms_components=comp_layer, f_layer=f_layer,
                round_rest_ms_engine=rest, round_parts_ms_components=comp_round, f_round=f_round)


def project(result: dict, rows: list[dict], args, calibration: dict | None = None) -> dict:
    """PROJECTION: per-token time and tokens/s of the full model on 8x H200 (module docstring). With
    `calibration` (engine_calibration): only the cases it covers, their parts rescaled to the Engine round
    (calibrate_parts)."""
    info = result["slice"]
    cfg = info["cfg"]
    ndev, n_layers = 8, args.full_layers
    n_moe = n_layers - cfg.get("first_k_dense_replace", 1)
    by = {(r["method"], r["batch"], r["ctx"]): r for r in rows if r.get("parts") and r["parts"].get("moe_layer")}
    ctx = args.contexts[0]
    links = {"nvlink": (args.nvlink_gbs * 1e9, args.coll_latency_us_nvlink),
             "pcie": (args.pcie_gbs * 1e9, args.coll_latency_us_pcie)}
    al = dict(ar=1.0, **{k.strip(): float(v) for k, v in (kv.split("=") for kv in args.acceptance.split(",") if kv)})
    label = "PROJECTION (not a measurement)" + (", Engine-calibrated" if calibration else "")
    out = dict(label=label, devices=ndev, layers=n_layers, context=ctx,
               acceptance_lengths=al, links={k: dict(gb_s=v[0] / 1e9, latency_us=v[1]) for k, v in links.items()},
               rows=[])
    for C in sorted({1, max(args.batches)}):
        for method in al:
            r = by.get((method, C, ctx))
            for layout in ("tp8", "ep8"):
                for link, (bw, lat) in links.items():
                    row = dict(layout=layout, link=link, method=method, concurrency=C)
                    if r is None:
                        row["missing"] = f"no measured {case_key(method, C, ctx)} case with a per-layer split"
                        out["rows"].append(row)
                        continue
                    P = r["parts"]
                    sh = device_shares(cfg, layout, C, r["S"], r["distinct_batch"], ndev, info)
                    # the timed layer may have routed to more experts than the case does (components route random
                    # hidden states; a tree's tokens share experts): routed-expert time scaled by bytes, i.e. by
                    # the distinct-expert ratio (linear; the H200 kernel was 12 % slower than linear at a 24- vs
                    # 66-expert routing of 9 tokens, BENCHMARKS.md)
                    routed = r["distinct_batch"] / max(r.get("distinct_layer") or r["distinct_batch"], 1e-9)
                    f_layer, f_round, cal = 1.0, 1.0, None
                    if calibration is not None:
                        c_case = calibration["cases"].get(r["key"])
                        if c_case is None:
                            row["missing"] = f"no Engine round of {r['key']} in both slices"
                            out["rows"].append(row)
                            continue
                        cal = calibrate_parts(P, routed, info, c_case)
                        f_layer, f_round = cal["f_layer"], cal["f_round"] or 1.0
                    moe_l = f_layer * sum(v * sh[c] * (routed if c == "moe_routed" else 1.0)
                                          for c, v in P["moe_layer"].items())
                    dense_l = f_layer * sum(v * sh[c] for c, v in P["dense_layer"].items()) if P["dense_layer"] else moe_l
                    rnd = f_round * sum(v * sh.get(c if c != "other" else "round_other", 1.0) for c, v in P["round"].items())
                    coll, ncoll = collective_ms(collective_plan(layout, method, C, r["width"], cfg, info, n_layers),
                                                ndev, bw, lat)
                    layers_ms = n_moe * moe_l + (n_layers - n_moe) * dense_l
                    t = layers_ms + rnd + coll
                    row.update(source_case=r["key"], source=r["source"], round_ms=t, layers_ms=layers_ms,
                               nonlayer_ms=rnd, collectives_ms=coll, collectives=ncoll,
                               ms_per_token=t / al[method], tok_s_per_user=al[method] / t * 1e3,
                               tok_s=C * al[method] / t * 1e3,
                               experts_on_busiest_device=sh.get("experts_on_busiest_device"),
                               routed_expert_time_scale=routed, calibration=cal)
                    out["rows"].append(row)
    return out


def bars(rows: list[dict], proj: dict, ctx: int, proj_engine: dict | None = None) -> list[dict]:
    by = {(r["method"], r["batch"], r["ctx"]): r for r in rows}
    out = []
    for method, what in (("ar", "AR step, batch 1"), ("b8", "DDTree b8 verify, batch 1")):
        r = by.get((method, 1, ctx))
        if r is None or "layer_over_floor" not in r:
            out.append(dict(bar=f"MoE layer time <= 1.25x HBM floor ({what}, {ctx_label(ctx)})", status="not measured"))
            continue
        whole = ""
        if r.get("round_ms") and r.get("round_floor_ms"):
            whole = (f"; whole Engine round {r['round_ms']:.3f} ms vs its floor {r['round_floor_ms']:.3f} ms = "
                     f"{r['round_ms'] / r['round_floor_ms']:.2f}x")
        out.append(dict(bar=f"MoE layer time <= 1.25x HBM floor ({what}, {ctx_label(ctx)})",
                        value=f"{r['layer_ms']:.3f} ms vs floor {r['floor']['ms']:.3f} ms = {r['layer_over_floor']:.2f}x "
                              f"(kernels alone {r['layer_kernel_ms'] / r['floor']['ms']:.2f}x; from {r['source']}){whole}",
                        status="met" if r["layer_over_floor"] <= 1.25 else "missed"))
    for pr, how in ((proj, "from components"), (proj_engine, "Engine-calibrated")):
        if pr is None:
            continue
        name = f"PROJECTED 8x H200 DDTree b8 at C=1 >= 500 tok/s ({how})"
        best = [p for p in pr["rows"] if p["method"] == "b8" and p["concurrency"] == 1 and p["link"] == "nvlink"
                and "tok_s" in p]
        if best:
            b = max(best, key=lambda p: p["tok_s"])
            vals = ", ".join(f"{p['layout']} {p['tok_s']:.0f}" for p in best)
            out.append(dict(bar=name, value=f"{vals} tok/s (NVLink)", status="met" if b["tok_s"] >= 500 else "missed"))
        else:
            out.append(dict(bar=name, status="not measured"))
    return out


# ---------------------------------------------------------------- report
def _f(x, fmt=".3f"):
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def _md(cells) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def _md_head(cols) -> list[str]:
    return [_md(cols), _md(["---"] * len(cols))]


def table(result: dict) -> str:
    """The markdown report: cases, Engine vs components, command buffers, the projection, the bars."""
    rows, proj, sl = result["summary"], result["projection"], result["slice"]
    L = [f"Device {result.get('device')}, jax {result.get('jax')}, read roof {result['roof_bytes_per_s'] / 1e12:.2f} "
         f"TB/s; slice {sl['layers']} layers ({sl['moe_layers']} MoE) + {sl['drafter_layers']}-layer drafter, kernels "
         f"attn={sl['attn_impl']} moe={sl['moe_impl']}, experts in the {sl['expert_layout']} layout. Times per round; "
         "'gap' = wall time not covered by kernels, spread over the kernels by count.", ""]
    L += _md_head(["case", "B", "ctx", "source", "round ms (HBM floor)", "MoE layer ms (kernels only)",
                   "per layer: attn / MoE routed+shared / router / other+gap", "per round: drafter / tree / "
                   "accept+commit / lm_head", "layer HBM floor ms", "layer / floor",
                   "distinct experts per layer: per request (uniform) ; batch ; in the timed layer"])
    for r in rows:
        P = r.get("parts") or {}
        ml, rd = P.get("moe_layer") or {}, P.get("round") or {}
        g = lambda d, *ks: sum(d.get(k) or 0.0 for k in ks)
        split = " / ".join(_f(g(ml, *ks)) for ks in (("attention",), ("moe_routed", "moe_shared"), ("router",),
                                                      ("other", "gap"))) if ml else "-"
        rsplit = " / ".join(_f(g(rd, *ks)) for ks in (("drafter",), ("tree",), ("accept", "commit"), ("lm_head",))) \
            if rd else "-"
        rnd = _f(r["round_ms"]) if r["round_ms"] is not None else f"{_f(r.get('model_round_ms'))} (components)"
        dist = (f"{_f(r['distinct_per_request_measured'], '.1f')} ({r['distinct_per_request_uniform']:.1f}) ; "
                f"{r['distinct_batch']:.1f} ; {r.get('distinct_layer', r['distinct_batch']):.1f}")
        L.append(_md([r["method"], r["batch"], ctx_label(r["ctx"]), r["source"], f"{rnd} ({r['round_floor_ms']:.3f})",
                      f"{_f(r.get('layer_ms'))} ({_f(r.get('layer_kernel_ms'))})", split, rsplit,
                      f"{r['floor']['ms']:.3f}", f"{_f(r.get('layer_over_floor'), '.2f')}x", dist]))
    ck = [c for c in result.get("components", []) if c.get("moe_checkpoint_layout_ms") is not None]
    if ck:
        c = ck[0]
        L += ["", f"MoE block at {c['width']} token(s) ({sl['moe_impl']}): {c['moe_ms']:.3f} ms with the experts in the kernel "
              f"layout (as in this run), {c['moe_checkpoint_layout_ms']:.3f} ms through the model's own path "
              "(checkpoint layout, which the Pallas kernel re-lays out inside every call)."]
    val = [r for r in rows if r.get("components_round_ms") is not None]
    if val:
        L += ["", "Engine vs components (same case): " + "; ".join(
            f"{r['key']}: round {r['round_ms']:.3f} ms measured vs {r['components_round_ms']:.3f} ms from "
            f"components, MoE layer {_f(r.get('layer_ms'))} vs {r['components_layer_ms']:.3f} ms" for r in val)]
    xf = result.get("xla_flags", {})
    if xf.get("variants"):
        L += ["", f"XLA command buffers, {xf.get('case')} on a {xf.get('layers')}-layer slice (op counts from the "
              "optimized HLO of the round body; graphs = command-buffer launches per round):", ""]
        L += _md_head(["XLA_FLAGS", "round ms", "kernels ms/round", "ops in command buffers", "graphs per round",
                       "whiles / conditionals outside graphs"])
        for v in xf["variants"]:
            name = f"{v['variant']} `{v.get('flags', '')}`"
            if "result" not in v:
                L.append(_md([name, v.get("error", "not run")[:100], "", "", "", ""]))
                continue
            rr = v["result"]
            hb = rr["hlo"].get("round_body", {})
            L.append(_md([name, f"{rr['round_ms']:.3f}", _f(rr.get("profile", {}).get("kernel_ms")),
                          f"{hb.get('ops_in_cb', 0)}/{hb.get('ops', 0)}", hb.get("cb_calls", 0),
                          f"{hb.get('whiles', 0)} / {hb.get('conditionals', 0)}"]))
    links = ", ".join(f"{k} {v['gb_s']:.0f} GB/s + {v['latency_us']:.0f} us" for k, v in proj["links"].items())
    L += ["", f"PROJECTION (not a measurement): {proj['layers']} layers on {proj['devices']}x H200, context "
          f"{ctx_label(proj['context'])}, acceptance lengths {proj['acceptance_lengths']}; collectives {links} each.", ""]
    L += _md_head(["layout", "link", "method", "C", "round ms", "layers / non-layer / collectives ms (count)",
                   "ms per token", "tok/s per user", "tok/s total", "from"])
    for p in proj["rows"]:
        if "tok_s" not in p:
            L.append(_md([p["layout"], p["link"], p["method"], p["concurrency"], "-", "-", "-", "-", "-", p["missing"]]))
            continue
        L.append(_md([p["layout"], p["link"], p["method"], p["concurrency"], f"{p['round_ms']:.3f}",
                      f"{p['layers_ms']:.2f} / {p['nonlayer_ms']:.2f} / {p['collectives_ms']:.2f} ({p['collectives']})",
                      f"{p['ms_per_token']:.3f}", f"{p['tok_s_per_user']:.0f}", f"{p['tok_s']:.0f}",
                      f"{p['source_case']} ({p['source']})"]))
    pe = result.get("projection_engine")
    if pe:
        cal = result["calibration"]
        L += ["", f"PROJECTION, Engine-calibrated (not a measurement): the same model with each case's parts rescaled "
              f"to the real Engine round. Per MoE layer in the Engine = (round of this {cal['deep_moe_layers']}-MoE-layer "
              f"slice - round of a {cal['shallow_moe_layers']}-MoE-layer slice) / {cal['deep_moe_layers'] - cal['shallow_moe_layers']} "
              f"(shallow run: `{cal.get('shallow_command')}`); f_layer = that / the components' layer, f_round = the "
              "round's remainder / the components' per-round parts.", ""]
        L += _md_head(["layout", "link", "method", "C", "Engine layer ms (components)", "f_layer / f_round", "round ms",
                       "layers / non-layer / collectives ms (count)", "ms per token", "tok/s total"])
        for p in pe["rows"]:
            if "tok_s" not in p:
                L.append(_md([p["layout"], p["link"], p["method"], p["concurrency"], "-", "-", "-", "-", "-", p["missing"]]))
                continue
            c = p["calibration"]
            L.append(_md([p["layout"], p["link"], p["method"], p["concurrency"],
                          f"{c['layer_ms_engine']:.3f} ({c['layer_ms_components']:.3f})",
                          f"{c['f_layer']:.2f} / {_f(c['f_round'], '.2f')}", f"{p['round_ms']:.3f}",
                          f"{p['layers_ms']:.2f} / {p['nonlayer_ms']:.2f} / {p['collectives_ms']:.2f} ({p['collectives']})",
                          f"{p['ms_per_token']:.3f}", f"{p['tok_s']:.0f}"]))
    L.append("")
    for b in result["bars"]:
        L.append(f"- {b['bar']}: **{b['status']}**" + (f" — {b['value']}" if "value" in b else ""))
    sk = result.get("skipped", [])
    if sk:
        L += ["", f"Skipped ({len(sk)}): " + "; ".join(f"{x['kind']} {x['case']} ({x['reason']})" for x in sk)]
    return "\n".join(L)


def plot(result: dict, path: str):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["summary"] if r.get("layer_ms") is not None]
    fig, axs = plt.subplots(1, 3, figsize=(18, 5))
    ax = axs[0]
    names = [f"{r['method']} B{r['batch']} {ctx_label(r['ctx'])}" for r in rows]
    bottom = [0.0] * len(rows)
    for cat, color in (("attention", "#4C72B0"), ("moe_routed", "#DD8452"), ("moe_shared", "#F2B880"),
                       ("router", "#55A868"), ("other", "#8172B2"), ("gap", "#BBBBBB")):
        vals = [r["parts"]["moe_layer"].get(cat, 0.0) for r in rows]
        ax.bar(names, vals, bottom=bottom, color=color, label=cat)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.plot(names, [r["floor"]["ms"] for r in rows], "k_", markersize=18, mew=2, label="HBM floor")
    ax.set_title("MoE layer time per round (ms) vs HBM floor", fontsize=9)
    ax.tick_params(axis="x", labelrotation=90, labelsize=7)
    ax.legend(fontsize=7)
    ax = axs[1]
    xf = [v for v in result.get("xla_flags", {}).get("variants", []) if "result" in v]
    ax.bar([v["variant"] for v in xf], [v["result"]["round_ms"] for v in xf], color="#4C72B0")
    ax.set_title(f"round ms by XLA command-buffer setting ({result.get('xla_flags', {}).get('case')})", fontsize=9)
    ax = axs[2]
    pr = [p for p in result["projection"]["rows"] if "tok_s" in p and p["link"] == "nvlink"]
    ax.bar([f"{p['layout']} {p['method']} C{p['concurrency']}" for p in pr], [p["tok_s"] for p in pr], color="#C44E52")
    ax.axhline(500, color="k", lw=0.8, ls="--")
    ax.set_yscale("log")
    ax.set_title("PROJECTION: 61 layers on 8x H200 (NVLink), tokens/s total", fontsize=9)
    ax.tick_params(axis="x", labelrotation=90, labelsize=7)
    fig.suptitle(f"bench_kimi {result.get('device')} (projection panel is a model, not a measurement)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def finalize(result: dict, args) -> dict:
    result["summary"] = summarize(result)
    result["projection"] = project(result, result["summary"], args)
    if getattr(args, "calibrate_with", None):
        with open(args.calibrate_with) as f:
            result["calibration"] = engine_calibration(result, json.load(f))
        result["projection_engine"] = project(result, result["summary"], args, result["calibration"])
    result["bars"] = bars(result["summary"], result["projection"], args.contexts[0], result.get("projection_engine"))
    return result


def report(result: dict, args):
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        write_json(args.out, result)
        png = os.path.splitext(args.out)[0] + ".png"
        try:
            plot(result, png)
        except Exception as e:  # noqa: BLE001
            print(f"plot failed: {e}")
    print()
    print(table(result))
    if args.out:
        print(f"\nwrote {args.out}")
