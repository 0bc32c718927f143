"""Same-process A/B of runtime settings: variants in interleaved rounds inside one offload runtime.

    python scripts/dev/ab.py MODEL [--vram 8GiB] [--measure decode|prefill|spec]
                             [--variants base,pcie-only,threads8] [--rounds 3] [--trace]

Machines of one kind differ by up to ~10%, and one machine drifts within a run, so a change of a
few percent is decided only in one process: the runtime is opened once, and each round runs
every variant in turn (the order reversed every other round): set it, measure, set it back.
Prints each variant's median and every round. Needs a CUDA GPU.

Measures:
  decode   (default) a new conversation (a 16-token prompt; --batch B: B of them, stepped
           together by decode_many), one step (the cache grows back to its decode size), the
           variant set, 15 steps to settle (slots refill, graphs are captured), then --steps
           timed: tok/s, MB over PCIe, hit rate and CPU experts a token. --after-prompt: the
           variant is set first and the first --steps steps after the prompt are timed (the
           cache's regrowth and refill included, as `ftpatch bench` times tg); one untimed
           conversation before captures the variant's graphs.
  prefill  a prompt of --tokens random tokens in a new conversation, then --steps decode steps
           after it: pp and tg tok/s (one untimed round first).
  spec     bench's pair of plain and speculative greedy runs (bench_spec.speculative_tg: --gen
           tokens, 2 timed repetitions) for each k of --drafts: the speed-up, the acceptance, and
           the guesses made while drafting (layer 0's copies and how many its plans used). Needs
           a file with an MTP head (ftpatch synth ... --mtp-agree 0.8).

Variants (a '+' joins settings: prefill-bf16+moe-bf16):
  base             the runtime as opened
  pcie-only        every miss over PCIe, none on the CPU (the scheduler's override)
  fractionQ        a share Q of a layer's misses over PCIe (the scheduler's override)
  threadsN         N threads in the CPU kernels' pool
  slots+N, slots-N every layer's cache N slots larger or smaller (mapped past the cap: what N
                   slots are worth, not a configuration that fits)
  pfN              N experts guessed a token one layer ahead (graphs captured again)
  no-guess-split   a layer's guessed copies not counted in the link's share of its misses
  inflightN        decode steps launched before the host waits for the oldest
  chunksN          the rows engine's warps stream at least N chunks (graphs captured again)
  record           the routed ids recorded every step, as `ftpatch bench` does in model routing
  torch-steps      norms, routing and the mixers' cores in torch (instrument.switches.STEP_KERNELS)
  prefill-DT       the prefill's dense GEMM operands in DT: bf16, f16 or f32 (native.ops.PREFILL_DTYPE)
  moe-DT           the prefill's grouped expert GEMMs in DT: bf16 or f16 (native.ops.PREFILL_MOE_DTYPE)
  moeminN          prompts of more than N tokens take the grouped expert GEMMs
  short-promptN    prompts of up to N tokens run as decode steps (OffloadPolicy.short_prompt)
  draft-guessN     while drafting, guess the verify step's experts in N first layers
                   (OffloadPolicy.draft_guess_layers)
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("model")
    p.add_argument("--vram", default="8GiB", help="the VRAM cap (default 8GiB)")
    p.add_argument("--measure", choices=("decode", "prefill", "spec"), default="decode")
    p.add_argument("--variants", default="base,pcie-only", help="comma list (see below)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--trace", action="store_true",
                   help="route by a replayed trace of realistic locality (TraceParams()); guesses "
                        "are off while replaying")
    p.add_argument("--steps", type=int, default=64, help="decode steps timed")
    p.add_argument("--batch", type=int, default=1, help="decode: sequences stepped together")
    p.add_argument("--after-prompt", action="store_true", help="decode: time the steps right "
                   "after the prompt, the variant set before it")
    p.add_argument("--tokens", type=int, default=2048, help="prefill: the prompt's tokens")
    p.add_argument("--drafts", default="1,3", help="spec: drafts a step to run, comma list (auto too)")
    p.add_argument("--gen", type=int, default=128, help="spec: tokens a run")
    p.add_argument("--json", help="write every round's figures here too")
    return p


# ---- settings: each sets one thing on the runtime and returns how to set it back -------------------

def _scheduler_share(rt, q: float | None):
    sch = rt.scheduler
    old = sch.forced
    sch.forced = q
    sch.apply()

    def undo():
        sch.forced = old
        sch.apply()
    return undo


def _cpu_threads(rt, n: int):
    import native._cpu as cpu_ext
    old = cpu_ext.threads()
    cpu_ext.set_threads(n)
    return lambda: cpu_ext.set_threads(old)


def _slots(rt, delta: int):
    old = rt.cache.slots
    rt.cache.resize([s + delta for s in old])
    return lambda: rt.cache.resize(old)


def _attr(obj, name: str, value, drop_graphs=None):
    """obj.name = value (graphs captured again where they hold it); undo sets it back."""
    old = getattr(obj, name)
    setattr(obj, name, value)
    if drop_graphs is not None:
        drop_graphs()

    def undo():
        setattr(obj, name, old)
        if drop_graphs is not None:
            drop_graphs()
    return undo


def _guesses(rt, k: int):
    eng = rt.engine
    old = eng.prefetch_k
    if eng.predict is not None:
        eng.set_predictor(eng.predict, k)   # (refuses a count the step cannot take)
    eng.prefetch_k = k
    rt.graphs.drop()

    def undo():
        eng.prefetch_k = old
        rt.graphs.drop()
    return undo


def _rows_chunks(rt, n: int):
    import native._cuda as cuda_ext
    old = cuda_ext.rows_min_chunks()
    cuda_ext.set_rows_min_chunks(n)
    rt.graphs.drop()

    def undo():
        cuda_ext.set_rows_min_chunks(old)
        rt.graphs.drop()
    return undo


def _record(rt):
    from moe_offload import RoutingRecorder
    rt.attach_recorder(RoutingRecorder(256))
    return lambda: rt.attach_recorder(None)


def _switch(rt, name: str, value: bool):
    from moe_offload.instrument import switches
    return _attr(switches, name, value, rt.graphs.drop)


def _ops(name: str, value):
    from native import ops
    return _attr(ops, name, value)


def _policy(rt, **change):
    old = rt.policy
    rt.policy = old.with_(**change)

    def undo():
        rt.policy = old
    return undo


def _dtype(name: str):
    import torch
    return {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}[name]


SETTINGS = (   # (pattern, rt and the match -> undo)
    (r"base", lambda rt, m: (lambda: None)),
    (r"pcie-only", lambda rt, m: _scheduler_share(rt, 1.0)),
    (r"fraction([0-9.]+)", lambda rt, m: _scheduler_share(rt, float(m[1]))),
    (r"threads(\d+)", lambda rt, m: _cpu_threads(rt, int(m[1]))),
    (r"slots([+-]\d+)", lambda rt, m: _slots(rt, int(m[1]))),
    (r"pf(\d+)", lambda rt, m: _guesses(rt, int(m[1]))),
    (r"no-guess-split", lambda rt, m: _attr(rt.engine, "guesses_in_split", False, rt.graphs.drop)),
    (r"inflight(\d+)", lambda rt, m: _attr(rt.engine, "max_in_flight", int(m[1]))),
    (r"chunks(\d+)", lambda rt, m: _rows_chunks(rt, int(m[1]))),
    (r"record", lambda rt, m: _record(rt)),
    (r"torch-steps", lambda rt, m: _switch(rt, "STEP_KERNELS", False)),
    (r"prefill-(bf16|f16|f32)", lambda rt, m: _ops("PREFILL_DTYPE", _dtype(m[1]))),
    (r"moe-(bf16|f16)", lambda rt, m: _ops("PREFILL_MOE_DTYPE", _dtype(m[1]))),
    (r"moemin(\d+)", lambda rt, m: _ops("PREFILL_MOE_MIN_TOKENS", int(m[1]))),
    (r"short-prompt(\d+)", lambda rt, m: _policy(rt, short_prompt=int(m[1]))),
    (r"draft-guess(\d+)", lambda rt, m: _policy(rt, draft_guess_layers=int(m[1]))),
)


def parse_variant(text: str) -> list:
    """'pf4+threads8' -> [(make, match), ...] ('+' before a digit is slots+N's sign, not a
    join); an unknown setting ends the run with a line."""
    out = []
    for part in re.split(r"\+(?!\d)", text):
        for pattern, make in SETTINGS:
            if m := re.fullmatch(pattern, part):
                out.append((make, m))
                break
        else:
            raise SystemExit(f"--variants: unknown setting {part!r} (see --help)")
    return out


def apply(rt, settings: list):
    """Set a variant's settings in order -> undo (sets them back in reverse)."""
    rt.engine.settle()   # nothing in flight reads what changes
    undos = [make(rt, m) for make, m in settings]

    def undo():
        rt.engine.settle()
        for u in reversed(undos):
            u()
    return undo


# ---- measures ---------------------------------------------------------------------------------------

class Decode:
    def __init__(self, rt, args):
        import torch
        self.rt, self.args, self.torch = rt, args, torch
        self.states: list = []
        self.restart()
        self.steps(48)   # graphs captured, the cache warm

    def restart(self) -> None:
        """New conversations: positions back to the first bucket (no capture while timing)."""
        rt, torch = self.rt, self.torch
        for st in self.states:
            rt.release(st)
        self.states = [rt.new_state(1) for _ in range(self.args.batch)]
        n_vocab = rt.config.n_vocab
        self.tok = torch.cat([rt.prefill(torch.randint(0, n_vocab, (1, 16), device=rt.device), st)
                              .argmax(-1) for st in self.states])

    def steps(self, n: int) -> float:
        rt, torch = self.rt, self.torch
        torch.cuda.synchronize(rt.device)
        t = time.perf_counter()
        for _ in range(n):
            if len(self.states) == 1:
                self.tok = rt.decode(self.tok, self.states[0]).argmax(-1)
            else:
                self.tok = rt.decode_many(self.tok, self.states).argmax(-1)
        torch.cuda.synchronize(rt.device)
        return n * len(self.states) / (time.perf_counter() - t)

    def round(self, settings: list) -> dict:
        rt, n = self.rt, self.args.steps
        if self.args.after_prompt:
            undo = apply(rt, settings)
            self.restart()
            self.steps(1)   # a variant that captures anew does so here, not in the timed steps
            self.restart()
        else:
            self.restart()
            self.steps(1)   # the cache grows back to its decode size (slots+N applies to that)
            undo = apply(rt, settings)
            self.steps(15)
        rt.reset_stats()
        tps = self.steps(n)
        s = rt.stats().as_dict()
        undo()
        return {"tok_s": tps, "MB_per_step": s["pcie_bytes"] / n / 1e6, "hit_rate": s["hit_rate"],
                "cpu_per_step": s["cpu"] / n}

    @staticmethod
    def summary(name: str, rows: list[dict]) -> str:
        tps = [r["tok_s"] for r in rows]
        return (f"{name:16s} {statistics.median(tps):7.1f} tok/s {[round(x, 1) for x in tps]}  "
                f"{statistics.mean(r['MB_per_step'] for r in rows):6.1f} MB a step  hit "
                f"{statistics.mean(r['hit_rate'] for r in rows):.1%}  cpu "
                f"{statistics.mean(r['cpu_per_step'] for r in rows):.2f} experts a step")


class Prefill:
    def __init__(self, rt, args):
        import torch
        self.rt, self.args, self.torch = rt, args, torch
        self.gen = torch.Generator().manual_seed(0)

    def round(self, settings: list) -> dict:
        rt, args, torch = self.rt, self.args, self.torch
        undo = apply(rt, settings)
        toks = torch.randint(0, rt.config.n_vocab, (1, args.tokens), generator=self.gen).to(rt.device)
        st = rt.new_state(1)
        torch.cuda.synchronize(rt.device)
        t0 = time.perf_counter()
        tok = rt.prefill(toks, st).argmax(-1)
        torch.cuda.synchronize(rt.device)
        t1 = time.perf_counter()
        for _ in range(args.steps):
            tok = rt.decode(tok, st).argmax(-1)
        torch.cuda.synchronize(rt.device)
        undo()
        return {"pp_tok_s": args.tokens / (t1 - t0), "tg_tok_s": args.steps / (time.perf_counter() - t1)}

    def summary(self, name: str, rows: list[dict]) -> str:
        pp, tg = [r["pp_tok_s"] for r in rows], [r["tg_tok_s"] for r in rows]
        return (f"{name:16s} pp{self.args.tokens} {statistics.median(pp):7.1f} tok/s "
                f"{[round(v) for v in pp]}  tg{self.args.steps} after it "
                f"{statistics.median(tg):6.1f} tok/s {[round(v, 1) for v in tg]}")


class Spec:
    def __init__(self, rt, args):
        import torch
        self.rt, self.args, self.torch = rt, args, torch
        r = rt.scheduler.rates
        print(f"guessing {rt.prefetching}, link {r.link_bytes_per_s / 1e9:.1f} GB/s, CPU "
              f"{r.cpu_bytes_per_s / 1e9:.1f} GB/s, q {rt.scheduler.q():.3f}")

    def round(self, settings: list) -> dict:
        from freetoken_patch.cli.bench import draft_guess_stats
        from freetoken_patch.cli.bench_spec import speculative_tg
        rt, args = self.rt, self.args
        undo = apply(rt, settings)
        out = {}
        for k in args.drafts:          # parsed in main
            rt.reset_stats()
            res = speculative_tg(rt, k, gen=args.gen, reps=2, n_vocab=rt.config.n_vocab,
                                 new_state=lambda: rt.new_state(1, 4096),
                                 sync=lambda: self.torch.cuda.synchronize(rt.device))
            g, s = draft_guess_stats(rt), rt.stats()
            out[k] = {"speedup": res["speedup"], "spec_tok_s": res["speculative_tps"]["median"],
                      "plain_tok_s": res["plain_tps"]["median"], "acceptance": res["acceptance"],
                      "same_tokens": res["same_tokens"], "layer0_guessed": g["layer0_guessed"],
                      "layer0_used": g["layer0_hits"], "hit_rate": s.hit_rate,
                      "guessing_changes": rt.guessing_changes}
        undo()
        return out

    def summary(self, name: str, rows: list[dict]) -> str:
        return "\n".join(
            f"{name:16s} k {k}: x{statistics.median(r[k]['speedup'] for r in rows):.3f} "
            f"{[round(r[k]['speedup'], 3) for r in rows]}, {statistics.median(r[k]['spec_tok_s'] for r in rows):.1f} "
            f"against {statistics.median(r[k]['plain_tok_s'] for r in rows):.1f} plain, acceptance "
            f"{statistics.mean(r[k]['acceptance'] for r in rows):.2f}, same tokens "
            f"{all(r[k]['same_tokens'] for r in rows)}, layer 0 guessed "
            f"{sum(r[k]['layer0_guessed'] for r in rows)} used {sum(r[k]['layer0_used'] for r in rows)}"
            for k in rows[0])


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    names = args.variants.split(",")
    variants = {name: parse_variant(name) for name in names}   # a typo ends the run before loading
    if args.measure == "spec":   # parsed once, before loading: a typo ends the run here
        from freetoken_patch.cli.bench_spec import parse_drafts
        try:
            args.drafts = parse_drafts(args.drafts)
        except argparse.ArgumentTypeError as e:
            raise SystemExit(f"--drafts {args.drafts}: {e}") from None
    from moe_offload import OffloadPolicy, TraceParams, make_trace, open_runtime
    spec = args.measure == "spec"
    rt = open_runtime(args.model, args.vram, ctx=4096, mtp=spec, max_sequences=args.batch,
                      policy=OffloadPolicy(prefetch=not args.trace))
    c = rt.config
    if args.trace:
        m = rt.engine.max_tok
        rt.replay(make_trace(-(-256 // m) * m, c.n_layer, c.n_expert, c.n_expert_used, TraceParams()),
                  by_position=spec)
    measure = {"decode": Decode, "prefill": Prefill, "spec": Spec}[args.measure](rt, args)
    if args.measure == "prefill":
        for name in names:
            measure.round(variants[name])   # untimed: each variant's kernels loaded
    got: dict[str, list] = {name: [] for name in names}
    for r in range(args.rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            got[name].append(measure.round(variants[name]))
            print(f"round {r} {name}: {json.dumps(got[name][-1])}", flush=True)
    print(f"{args.vram}, {'trace' if args.trace else 'model routing'}, {args.measure}, "
          f"{args.rounds} rounds, slots a layer {min(rt.cache.slots)}-{max(rt.cache.slots)}")
    for name in names:
        print(measure.summary(name, got[name]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "vram": args.vram, "measure": args.measure,
                       "trace": args.trace, "rounds": got}, f, indent=1)
    rt.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
