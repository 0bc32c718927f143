"""Long prompts under a VRAM cap, one run each: open the offload runtime at a context with a KV
type; for each prompt size, prefill that many random tokens on a fresh state once (no warm-up
run), then decode 32 warm-up steps (the expert cache refills with what decoding routes to) and
128 timed. One JSON line a size: prefill tok/s, decode tok/s after it, hit rate, the cache and
the KV it left, nvidia-smi's peak, and what decides the misses' path (the scheduler's PCIe share
of them and the link and CPU rates it measured: a machine whose CPU measures fast against its
link computes more misses there, and below a share of one half decode stops guessing the next
layer's experts, whose used copies count as hits: the hit rate and the decode rate move from
machine to machine with it).

    python scripts/dev/long_context.py 35b.gguf --ctx 133120 --kv-type q8_0 -p 65536,131072
"""
from __future__ import annotations

import argparse
import json
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--vram", default="8GiB", help="the cap (default 8GiB)")
    ap.add_argument("--ctx", type=int, default=133120)
    ap.add_argument("--kv-type", default="q8_0", choices=("f16", "q8_0", "q4_0"))
    ap.add_argument("-p", "--prompts", default="65536,131072", help="prompt sizes, comma separated")
    args = ap.parse_args()

    import torch

    from freetoken_patch.cli.model_args import size_arg
    from loaders import open_model
    from moe_offload import open_runtime

    sizes = [int(x) for x in args.prompts.split(",")]
    t0 = time.perf_counter()
    rt = open_runtime(open_model(args.model), size_arg(args.vram), ctx=args.ctx,
                      kv_type=args.kv_type)
    print(f"opened ctx {args.ctx} KV {args.kv_type} in {time.perf_counter() - t0:.1f}s; "
          f"cache {rt.cache.nbytes / 2**30:.2f} GiB", flush=True)
    g = torch.Generator().manual_seed(0)
    for n in sizes:
        st = rt.new_state(1, args.ctx)
        toks = torch.randint(0, rt.config.n_vocab, (1, n), generator=g).cuda()
        torch.cuda.synchronize()
        t = time.perf_counter()
        logits = rt.prefill(toks, st)
        torch.cuda.synchronize()
        pp = n / (time.perf_counter() - t)
        nxt = logits.argmax(-1)
        for _ in range(32):
            nxt = rt.decode(nxt, st).argmax(-1)
        torch.cuda.synchronize()
        rt.reset_stats()
        t = time.perf_counter()
        for _ in range(128):
            nxt = rt.decode(nxt, st).argmax(-1)
        torch.cuda.synchronize()
        tg = 128 / (time.perf_counter() - t)
        s = rt.stats().as_dict()
        print(json.dumps({"ctx": args.ctx, "kv": args.kv_type, "prompt": n, "pp_tok_s": round(pp, 1),
                          "tg128_after_tok_s": round(tg, 2), "hit_rate": round(s["hit_rate"], 4),
                          "cache_bytes": rt.cache.nbytes, "kv_mapped": rt.vram.kv_mapped(),
                          "smi_peak": rt.vram_peaks()["nvidia_smi_peak"], "n_past": st.n_past,
                          "fetched": s["fetched"], "cpu": s["cpu"], "prefetched": s["prefetched"],
                          "fetch_fraction": round(s["fetch_fraction"], 3),
                          "rates_GBps": {k: round(v, 2) for k, v in s["rates"].items()}}),
              flush=True)
        del st, logits
    rt.close()


if __name__ == "__main__":
    main()
