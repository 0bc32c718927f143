"""Rewrite, in place, the agreement rate of a model made by `ftpatch synth --mtp-agree`: its MTP
embedding table and the ftpatch.synth.mtp_agree metadata, byte for byte as `synth` would have
written them at the new rate (the rest of the file does not depend on the rate). Saves the
GPU session a second 17 GB synthesis. Assumes synth's defaults for what is not given.
Usage: python scripts/dev/mtp_reagree.py MODEL.gguf RATE [--preset 35b-a3b --type IQ3_S --seed 0]

It rebuilds the table from loaders.synth's own tensor plan (private functions: no public form
of one tensor's bytes exists), so tests/test_scripts.py checks its output against a fresh
synthesis of the tiny preset."""
import argparse
import sys


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("rate", type=float)
    ap.add_argument("--preset", default="35b-a3b")
    ap.add_argument("--type", default="IQ3_S")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    if not 0.0 <= a.rate <= 1.0:
        ap.error(f"rate {a.rate}: give an agreement rate in [0, 1]")
    import numpy as np
    from gguf import GGUFReader

    from loaders import synth
    opts = synth.SynthOptions(preset=a.preset, type=a.type, seed=a.seed, mtp_agree=a.rate)
    preset = synth.PRESETS[a.preset]
    n_vocab = preset.n_vocab or len(synth.builtin_vocab())
    c = synth._config(preset, n_vocab, preset.n_layer)
    plans = synth._agreeing_mtp(synth.plan_tensors(opts, c, synth._mtp_specs(c, a.rate)), opts, c)
    name = f"blk.{c.n_layer}.nextn.embed_tokens.weight"
    plan = next(pl for pl in plans if pl.name == name)
    data = np.ascontiguousarray(plan.make(synth._tensor_seed(a.seed, name))).view(np.uint8).reshape(-1)
    r = GGUFReader(a.model, "r+")
    t = next(t for t in r.tensors if t.name == name)
    dst = t.data.view(np.uint8).reshape(-1)
    assert dst.nbytes == data.nbytes, (dst.nbytes, data.nbytes)
    dst[:] = data
    f = r.fields["ftpatch.synth.mtp_agree"]
    f.parts[f.data[0]][0] = a.rate
    r.data.flush()
    print(f"{a.model}: MTP head now agrees at {a.rate}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
