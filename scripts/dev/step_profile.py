"""GPU kernel time of one step, by family, for the step kinds that add tokens to a step.

    python scripts/dev/step_profile.py MODEL [--vram 8GiB] [--trace] [--steps 16]

Opens the offload runtime holding 4 sequences, prefills them, then for each step kind -- plain
decode of one sequence (B=1), a verify step of T = 2 and 3 positions of one sequence, and
decode_many of B = 2 and 4 sequences -- times --steps graph replays without the profiler and
--steps with it, and prints per step: wall ms, the GPU's busy time, and kernel time by family
(routed experts, fetch copies, CPU wait, delta-net core, attention core, dense projections,
norms and small ops, copies). What an extra token of a step costs, and in which kernels, is the
difference between rows. Verify steps rewind after each replay so every step sees the same
positions. Kinds d1..d3: the MTP head's draft of k tokens (one captured graph, replayed at the
same MTP position). JSON (--json) keeps the per-kernel totals as well.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

FAMILIES = (   # (family, substrings of the kernel's name), first match wins
    ("fetch", ("fetch_kernel",)),
    ("cpu wait", ("wait_add",)),
    ("routed experts", ("GateUpMap", "DownMap", "act_kernel", "group_kernel", "sum_kernel")),
    ("delta-net core", ("conv_silu", "delta_step")),
    ("attention core", ("attention_part", "attention_merge")),
    ("dense projections", ("rows_kernel",)),
    ("norms", ("residual_norm",)),
    ("routing", ("route_", "plan", "prefetch")),
    ("copies", ("copy", "Memcpy", "memcpy", "cat", "elementwise_kernel")),
)


def per_token_verify() -> None:
    """The verify step's per-token parts as they were (for an A/B in one process)."""
    from native import ops
    from moe_offload.models import qwen35moe
    attend = qwen35moe.gated_attention

    def attention(qg, k, v, qn, kn, eps, pos, n_rot, base, kc, vc, n_attn):
        T = qg.shape[1]
        if T == 1 or not qg.is_cuda:
            return attend(qg, k, v, qn, kn, eps, pos, n_rot, base, kc, vc, n_attn)
        return torch.cat([attend(qg[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], qn, kn, eps,
                                 pos[t:t + 1], n_rot, base, kc, vc, n_attn) for t in range(T)], 1)

    def float_matmul(x, w):
        o, h = w.shape
        wt = ops._rows(w).view(ops._FLOAT_DTYPES[w.qtype.name]).view(o, h).float()
        x2 = x.reshape(-1, h).float()
        return torch.cat([x2[i:i + 1] @ wt.T for i in range(x2.shape[0])]).reshape(*x.shape[:-1], o)

    qwen35moe.gated_attention = attention
    ops._float_matmul = float_matmul


def family(name: str) -> str:
    for fam, keys in FAMILIES:
        if any(k in name for k in keys):
            return fam
    return "other"


def union_length(spans) -> float:
    total, end = 0.0, -1e30
    for a, b in sorted(spans):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def main() -> None:
    from moe_offload import OffloadPolicy, open_runtime
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("--vram", default="8GiB")
    p.add_argument("--trace", action="store_true", help="route by a replayed realistic trace")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--kinds", default="b1,v2,v3,b2,b4")
    p.add_argument("--json")
    p.add_argument("--per-token-verify", action="store_true",
                   help="A/B: a verify step's attention one token at a time and its float "
                        "matmuls (the F32 router) one cuBLAS GEMM a row, as before the multi-token "
                        "attention and the rows engine for decode's float matmuls")
    args = p.parse_args()
    if args.per_token_verify:
        per_token_verify()
    drafts = any(k.startswith("d") for k in args.kinds.split(","))
    rt = open_runtime(args.model, args.vram, ctx=1024, max_sequences=4, mtp=drafts,
                      policy=OffloadPolicy(prefetch=not args.trace))
    dev, c = rt.device, rt.config
    rng = np.random.default_rng(0)
    states = [rt.new_state(1) for _ in range(4)]
    for st in states:
        rt.prefill(torch.from_numpy(rng.integers(0, c.n_vocab, (1, 24))).to(dev), st)
    regime = "model routing"
    if args.trace:
        from moe_offload.instrument.trace import TraceParams, make_trace
        rt.replay(make_trace(512 * rt.engine.max_tok, c.n_layer, c.n_expert, c.n_expert_used,
                             TraceParams()))
        regime = TraceParams().label()
    rt.keep_steps(states[0], max([int(k[1:]) for k in args.kinds.split(",") if k[0] == "v"] + [3]) - 1)

    def step_fn(kind: str):
        if kind.startswith("d"):
            k, st = int(kind[1:]), states[0]   # its MTP KV made by keep_steps
            h = torch.randn(1, 1, c.n_embd, device=dev)
            toks = torch.randint(0, c.n_vocab, (1, 1), device=dev)
            p0 = st.mtp_past

            def draft():
                st.mtp_past = p0
                rt.draft(h, toks, st, k)
            return draft
        if kind.startswith("b"):
            b = int(kind[1:])
            sts = states[:b]
            toks = torch.randint(0, c.n_vocab, (b,), device=dev)
            if b == 1:
                return lambda: rt.decode(toks, sts[0])
            return lambda: rt.decode_many(toks, sts)
        T = int(kind[1:])
        st = states[0]
        toks = torch.randint(0, c.n_vocab, (1, T), device=dev)

        def verify():
            rt.verify(toks, st)
            st.rewind(T - 1)   # keep the first position: the next replay runs one further on
        return verify

    out = {"model": args.model, "vram": args.vram, "regime": regime, "rows": []}
    print(f"{args.vram}, {regime}, {rt.cache.slots[0]} slots a layer")
    for kind in args.kinds.split(","):
        fn = step_fn(kind)
        for _ in range(3):   # the graph captured and warm
            fn()
        torch.cuda.synchronize(dev)
        rt.reset_stats()
        t = time.perf_counter()
        for _ in range(args.steps):
            fn()
        torch.cuda.synchronize(dev)
        wall = (time.perf_counter() - t) / args.steps
        s = rt.stats().as_dict()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(args.steps):
                fn()
            torch.cuda.synchronize(dev)
        path = tempfile.mktemp(suffix=".json")
        prof.export_chrome_trace(path)
        ev = [e for e in json.load(open(path))["traceEvents"]
              if e.get("cat") == "kernel" and e.get("ph") == "X"]
        n = args.steps
        fams: dict[str, float] = {}
        names: dict[str, list] = {}
        for e in ev:
            f = family(e["name"])
            fams[f] = fams.get(f, 0.0) + e["dur"] / n
            r = names.setdefault(e["name"][:90], [0.0, 0])
            r[0] += e["dur"] / n
            r[1] += 1 / n
        busy = union_length([(e["ts"], e["ts"] + e["dur"]) for e in ev]) / n
        compute = union_length([(e["ts"], e["ts"] + e["dur"]) for e in ev
                                if family(e["name"]) not in ("fetch", "cpu wait")]) / n
        row = {"kind": kind, "wall_ms": round(wall * 1e3, 3), "gpu_busy_ms": round(busy / 1e3, 3),
               "compute_busy_ms": round(compute / 1e3, 3),
               "kernels_per_step": round(len(ev) / n, 1),
               "families_us": {k: round(v, 1) for k, v in sorted(fams.items(), key=lambda kv: -kv[1])},
               "hit_rate": round(s["hit_rate"], 4), "fetched_per_step": round(s["fetched"] / n, 1),
               "cpu_per_step": round(s["cpu"] / n, 1),
               "pcie_MB_per_step": round(s["pcie_bytes"] / n / 1e6, 1),
               "top": [(k, round(v[0], 1), round(v[1], 1)) for k, v in
                       sorted(names.items(), key=lambda kv: -kv[1][0])[:14]]}
        out["rows"].append(row)
        print(f"== {kind}: wall {row['wall_ms']} ms, GPU busy {row['gpu_busy_ms']} ms "
              f"(compute {row['compute_busy_ms']}), {row['kernels_per_step']} kernels, "
              f"hit {row['hit_rate']}, fetched {row['fetched_per_step']}, cpu {row['cpu_per_step']}, "
              f"{row['pcie_MB_per_step']} MB")
        print("   " + ", ".join(f"{k} {v:.0f}" for k, v in row["families_us"].items()))
        for name, us, cnt in row["top"]:
            print(f"   {us:8.1f} us {cnt:6.1f}x  {name}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    rt.close()


if __name__ == "__main__":
    main()
