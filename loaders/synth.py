"""Synthetic qwen35moe GGUFs with real shapes and random valid weights (`ftpatch synth`).

Weights are random blocks whose scales give |w| ~ 0.02, so activations stay finite through every
layer; vectors (norms, gates, decay parameters) get values in the ranges trained models use.
Everything is deterministic for a seed: each tensor draws from its own generator seeded by
(seed, tensor name), so tensors can be made in parallel and in any order.
"""
from __future__ import annotations

import os
import re
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from .archs.qwen35moe import Qwen35MoeConfig, mtp_schema, tensor_schema
from .errors import GGUFError
from .quants import QuantType, float_bytes, quant_type, random_tensor
from .registry import TensorSpec
from .vocab import VocabSpec, builtin_vocab, read_vocab, vocab_metadata

ARCH = "qwen35moe"


@dataclass(frozen=True)
class Preset:
    n_layer: int
    n_embd: int
    n_vocab: int | None          # None: exactly the tokenizer's size
    n_expert: int
    n_expert_used: int
    n_ff_exp: int
    n_ff_shexp: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_rot: int
    rope_sections: tuple[int, ...]
    ssm_d_inner: int
    ssm_d_state: int
    ssm_n_v_heads: int
    ssm_n_k_heads: int
    n_ctx_train: int
    full_attention_interval: int = 4
    ssm_d_conv: int = 4
    rope_base: float = 1e7
    rms_eps: float = 1e-6


PRESETS: dict[str, Preset] = {
    # CI: seconds to write, every structural feature of the real model at small sizes.
    "tiny": Preset(n_layer=4, n_embd=256, n_vocab=None, n_expert=16, n_expert_used=4,
                   n_ff_exp=256, n_ff_shexp=256, n_head=2, n_head_kv=1, head_dim=128, n_rot=32,
                   rope_sections=(6, 5, 5, 0), ssm_d_inner=256, ssm_d_state=64,
                   ssm_n_v_heads=4, ssm_n_k_heads=2, n_ctx_train=4096),
    # Qwen3.5-35B-A3B's shapes (its published config).
    "35b-a3b": Preset(n_layer=40, n_embd=2048, n_vocab=248320, n_expert=256, n_expert_used=8,
                      n_ff_exp=512, n_ff_shexp=512, n_head=16, n_head_kv=2, head_dim=256,
                      n_rot=64, rope_sections=(11, 11, 10, 0), ssm_d_inner=4096,
                      ssm_d_state=128, ssm_n_v_heads=32, ssm_n_k_heads=16, n_ctx_train=262144),
}


@dataclass(frozen=True)
class SynthOptions:
    preset: str = "tiny"
    seed: int = 0
    type: str = "IQ3_S"                 # every 2-D weight not covered below
    expert_type: str | None = None      # routed experts (default: `type`)
    down_type: str | None = None        # ffn_down_exps (default: expert_type)
    output_type: str | None = None      # output.weight (default: `type`)
    embed_type: str = "Q8_0"            # token_embd.weight
    tensor_types: tuple[tuple[str, str], ...] = ()  # (regex, type) overrides, last match wins
    routing_skew: float = 0.0           # 0: uniform routing; larger: a few experts win more
    mtp: bool = False                   # add the MTP block (blk.{n_layer}.*)
    mtp_agree: float | None = None      # an MTP head that agrees with the trunk at this rate
                                        # (implies mtp; see _agreeing_mtp)
    n_layer: int | None = None          # override the preset's layer count
    split_max_size: int = 0             # bytes per shard (0: one file)
    vocab: str | None = None            # GGUF to copy the tokenizer from (default: built-in)


@dataclass
class _Plan:
    name: str
    shape: tuple[int, ...]
    qtype: QuantType
    make: Callable[[np.random.Generator], np.ndarray] = field(repr=False)

    @property
    def nbytes(self) -> int:
        return self.qtype.nbytes(self.shape)


def _config(p: Preset, n_vocab: int, n_layer: int) -> Qwen35MoeConfig:
    return Qwen35MoeConfig(
        n_layer=n_layer, n_nextn=0, n_embd=p.n_embd, n_vocab=n_vocab, n_ctx_train=p.n_ctx_train,
        n_expert=p.n_expert, n_expert_used=p.n_expert_used, n_ff_exp=p.n_ff_exp,
        n_ff_shexp=p.n_ff_shexp, n_head=p.n_head, n_head_kv=p.n_head_kv, head_dim=p.head_dim,
        n_rot=p.n_rot, rope_base=p.rope_base, rope_sections=p.rope_sections, rms_eps=p.rms_eps,
        ssm_d_conv=p.ssm_d_conv, ssm_d_inner=p.ssm_d_inner, ssm_d_state=p.ssm_d_state,
        ssm_n_v_heads=p.ssm_n_v_heads, ssm_n_k_heads=p.ssm_n_k_heads,
        recurrent=tuple((i + 1) % p.full_attention_interval != 0 for i in range(n_layer)),
        tied_output=False)


def _vector_maker(spec: TensorSpec, c: Qwen35MoeConfig, skew: float) -> Callable[[np.random.Generator], np.ndarray]:
    """float32 values (stored as F32/F16/BF16): values in the ranges a trained model's tensors have (as GGUF stores them)."""
    n = spec.name
    shape = spec.shape

    def make(rng: np.random.Generator) -> np.ndarray:
        if n.endswith("norm.weight"):          # stored with the +1 folded in: around 1
            v = 1.0 + 0.1 * rng.standard_normal(shape)
        elif n.endswith("ssm_a"):              # -exp(A_log): negative decay rates
            v = -rng.uniform(0.05, 2.0, shape)
        elif n.endswith("ssm_dt.bias"):        # softplus(dt_bias) ~ 0.05-0.5: long memory
            v = rng.uniform(-3.0, -0.5, shape)
        elif n.endswith("ssm_conv1d.weight"):  # depthwise conv, fan-in = kernel size
            v = rng.uniform(-0.5, 0.5, shape)
        elif n.endswith("ffn_gate_inp.weight"):  # router; row scale sets expert popularity
            v = 0.02 * rng.standard_normal(shape)
            if skew:
                rank = rng.permutation(shape[0])
                v *= ((1.0 + rank) ** -skew * shape[0] ** skew / 4)[:, None]
        else:                                   # shared-expert gate and anything else
            v = 0.02 * rng.standard_normal(shape)
        return np.asarray(v, np.float64).astype(np.float32)
    return make


def _is_value_tensor(spec: TensorSpec) -> bool:
    """Tensors whose values matter (norms, router, decay, conv): made as floats, kept float."""
    return not spec.matrix or spec.role == "router" or spec.name.endswith("ssm_conv1d.weight")


def plan_tensors(opts: SynthOptions, c: Qwen35MoeConfig, extra: list[TensorSpec]) -> list[_Plan]:
    """Every tensor to write, in file order, with its type and how to make it."""
    expert_t = opts.expert_type or opts.type
    overrides = [(re.compile(pat), quant_type(t)) for pat, t in opts.tensor_types]
    plans = []
    for spec in list(tensor_schema(c)) + extra:
        if spec.group == "fused":
            continue  # write the split forms; fused variants are for real files
        name, values = spec.name, _is_value_tensor(spec)
        if values:
            t = "F32"
        elif name.endswith("ffn_down_exps.weight") and opts.down_type:
            t = opts.down_type
        else:
            t = {"embed": opts.embed_type, "output": opts.output_type or opts.type,
                 "experts": expert_t}.get(spec.role, opts.type)
        qt = quant_type(t)
        for pat, ot in overrides:
            if pat.search(name):
                qt = ot
        if spec.shape[-1] % qt.block_elems:
            raise GGUFError(f"{qt.name} needs rows of whole {qt.block_elems}-weight blocks; "
                            f"{name} has rows of {spec.shape[-1]}; pick another type for it")
        if values:
            if qt.family != "float":
                raise GGUFError(f"{name} holds values, not weights; store it as F32, F16 or BF16")
            vm = _vector_maker(spec, c, opts.routing_skew)
            make = (lambda vm, qt: lambda rng: float_bytes(vm(rng), qt))(vm, qt)
        else:
            make = (lambda qt, shape: lambda rng: random_tensor(qt, shape, rng))(qt, spec.shape)
        plans.append(_Plan(name, spec.shape, qt, make))
    return plans


def _mtp_specs(c: Qwen35MoeConfig, agree: float | None = None) -> list[TensorSpec]:
    """The NextN block at index n_layer: a full-attention layer + MoE + the MTP projections
    (agreeing: its own embedding table, and the trunk's output norm for its head)."""
    specs = mtp_schema(c)
    if agree is None:
        return specs
    b = f"blk.{c.n_layer}."
    return [s for s in specs if s.name != b + "nextn.shared_head_norm.weight"] + [
        TensorSpec(b + "nextn.embed_tokens.weight", ((c.n_vocab, c.n_embd),), "embed")]


# An MTP head that agrees with the trunk at a chosen rate (`SynthOptions.mtp_agree`):
#  - the trunk is made near-bigram: token embeddings EMBED_GAIN times the usual size, so the
#    residual stream stays the token's own embedding plus comparatively small layer outputs;
#  - the embedding row of token t is the output head's row of next(t), scaled up, where next is
#    one random cycle through the whole vocabulary: the head's logits of norm(emb t) peak at
#    next(t), so greedy decoding walks that cycle and visits a fresh token every step (a random
#    head instead makes the walk fall into a loop of a few dozen tokens, whose kept share is one
#    fixed draw: the realised acceptance then sat 0.1-0.15 below the rate);
#  - the head sees only the token: eh_proj = [MTP_GAIN * I | 0] (the hidden half zero), enorm
#    = 1, no shared_head_norm (the trunk's output norm serves), so the block's own layer
#    outputs are small beside the residual and the head guesses next(token);
#  - its embedding table (nextn.embed_tokens) is the trunk's with the rows of a random
#    (1 - rate) share of the vocabulary swapped among themselves: for those tokens the head
#    guesses next of another token, which is never the trunk's.
# So a draft of the token after t agrees with the trunk iff t is in the kept share, and each
# step's token is a fresh one: the realised acceptance is a binomial draw around the rate.
EMBED_GAIN = 5000.0
MTP_GAIN = 100.0


def _agreeing_mtp(plans: list[_Plan], opts: SynthOptions, c: Qwen35MoeConfig) -> list[_Plan]:
    rate = float(opts.mtp_agree)
    b = f"blk.{c.n_layer}.nextn."
    embed = next(pl for pl in plans if pl.name == "token_embd.weight")
    head = next(pl for pl in plans if pl.name == "output.weight")
    V, H = c.n_vocab, c.n_embd
    made: list[np.ndarray] = []     # the trunk's table, made once for both tables
    lock = threading.Lock()         # (the writer's pool may ask for both at once)

    def make_embd(rng: np.random.Generator | None = None) -> np.ndarray:
        with lock:
            if not made:
                made.append(_bigram_embedding(embed.qtype, head, V, opts.seed))
        return made[0]

    def make_mtp_embd(rng: np.random.Generator) -> np.ndarray:
        rows = make_embd()
        pick = np.random.default_rng([opts.seed, zlib.crc32(b"mtp_agree")])
        moved = np.flatnonzero(pick.random(V) >= rate)
        out = rows.copy()
        if len(moved) > 1:     # a cyclic shift among the moved rows: none keeps its own
            out[moved] = rows[np.roll(moved, 1 + int(pick.integers(len(moved) - 1)))]
        return out

    def make_eh(rng: np.random.Generator) -> np.ndarray:
        w = np.zeros((H, 2 * H), np.float32)
        w[np.arange(H), np.arange(H)] = MTP_GAIN
        return float_bytes(w, "F16")

    f16 = quant_type("F16")
    makers = {"token_embd.weight": (embed.qtype, make_embd),
              b + "embed_tokens.weight": (embed.qtype, make_mtp_embd),
              b + "eh_proj.weight": (f16, make_eh),
              b + "enorm.weight": (quant_type("F32"),
                                   lambda rng: float_bytes(np.ones(H, np.float32), "F32"))}
    return [replace(pl, qtype=makers[pl.name][0], make=makers[pl.name][1])
            if pl.name in makers else pl for pl in plans]


def bigram_next(seed: int, head_norms: np.ndarray) -> np.ndarray:
    """The agreeing model's trunk: greedy decoding follows token t with next[t]. The quarter of
    the tokens with the longest head rows form one cycle (a short row's own logit may lose to a
    long row's chance alignment: on the tiny preset's 256-wide rows 30% of the tokens did);
    every other token leads into it."""
    pick = np.random.default_rng([seed, zlib.crc32(b"bigram_next")])
    n = len(head_norms)
    strong = np.flatnonzero(head_norms >= np.quantile(head_norms, 0.75))
    order = pick.permutation(strong)
    nxt = pick.choice(order, n)
    nxt[order] = np.roll(order, -1)
    return nxt


def _bigram_embedding(qtype: QuantType, head: _Plan, n_vocab: int, seed: int,
                      rows_per_chunk: int = 16384) -> np.ndarray:
    """token_embd of the agreeing model: row t = EMBED_GAIN x the head's row next[t], stored as
    `qtype` (the head is made again from its own seed: the bytes the file holds)."""
    import gguf
    head_rows = head.make(_tensor_seed(seed, head.name))
    gq = gguf.GGMLQuantizationType(head.qtype.type_id)
    eq = gguf.GGMLQuantizationType(qtype.type_id)
    starts = range(0, n_vocab, rows_per_chunk)

    def norms(r0: int) -> np.ndarray:
        rows = gguf.quants.dequantize(head_rows[r0:r0 + rows_per_chunk], gq)
        return np.sqrt(np.square(rows, dtype=np.float64).sum(axis=1))

    def chunk(r0: int) -> np.ndarray:
        rows = gguf.quants.dequantize(head_rows[nxt[r0:r0 + rows_per_chunk]], gq)
        try:
            return gguf.quants.quantize(rows * np.float32(EMBED_GAIN), eq).view(np.uint8)
        except NotImplementedError:
            raise GGUFError(f"--mtp-agree writes the token embedding from the output head; "
                            f"gguf-py cannot quantize {qtype.name}: use --embed-type Q8_0, "
                            f"F16 or F32") from None

    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        nxt = bigram_next(seed, np.concatenate(list(pool.map(norms, starts))))
        parts = list(pool.map(chunk, starts))
    return np.concatenate(parts).reshape(n_vocab, qtype.row_bytes(head.shape[-1]))


def _metadata(opts: SynthOptions, p: Preset, c: Qwen35MoeConfig, vocab: VocabSpec) -> dict:
    n_blocks = c.n_layer + (1 if opts.mtp or opts.mtp_agree is not None else 0)
    A = ARCH + "."
    md = {
        "general.name": f"synthetic qwen35moe {opts.preset} (random weights)",
        "general.description": "Random weights with real shapes, made by `ftpatch synth`. "
                               "Not a trained model: its text is meaningless.",
        "general.quantization_version": 2,
        A + "context_length": (p.n_ctx_train, "u32"), A + "embedding_length": (c.n_embd, "u32"),
        A + "block_count": (n_blocks, "u32"),
        A + "expert_count": (c.n_expert, "u32"), A + "expert_used_count": (c.n_expert_used, "u32"),
        A + "expert_feed_forward_length": (c.n_ff_exp, "u32"),
        A + "expert_shared_feed_forward_length": (c.n_ff_shexp, "u32"),
        A + "attention.head_count": (c.n_head, "u32"),
        A + "attention.head_count_kv": (c.n_head_kv, "u32"),
        A + "attention.key_length": (c.head_dim, "u32"),
        A + "attention.value_length": (c.head_dim, "u32"),
        A + "attention.layer_norm_rms_epsilon": (c.rms_eps, "f32"),
        A + "rope.dimension_count": (c.n_rot, "u32"), A + "rope.freq_base": (c.rope_base, "f32"),
        A + "rope.dimension_sections": (np.asarray(c.rope_sections, np.int32), "arr"),
        A + "ssm.conv_kernel": (c.ssm_d_conv, "u32"), A + "ssm.inner_size": (c.ssm_d_inner, "u32"),
        A + "ssm.state_size": (c.ssm_d_state, "u32"),
        A + "ssm.time_step_rank": (c.ssm_n_v_heads, "u32"),
        A + "ssm.group_count": (c.ssm_n_k_heads, "u32"),
        A + "full_attention_interval": (p.full_attention_interval, "u32"),
        A + "attention.recurrent_layers": ([*c.recurrent] + [False] * (n_blocks - c.n_layer), "arr"),
        "ftpatch.synth.preset": opts.preset, "ftpatch.synth.seed": (opts.seed, "u32"),
        "ftpatch.synth.routing_skew": (float(opts.routing_skew), "f32"),
    }
    if opts.mtp or opts.mtp_agree is not None:
        md[A + "nextn_predict_layers"] = (1, "u32")
    if opts.mtp_agree is not None:
        md["ftpatch.synth.mtp_agree"] = (float(opts.mtp_agree), "f32")
    md.update(vocab_metadata(vocab))
    return md


def _add_kv(w, key: str, val) -> None:
    import gguf
    kind = None
    if isinstance(val, tuple):
        val, kind = val
    if kind == "u32":
        w.add_uint32(key, int(val))
    elif kind == "f32":
        w.add_float32(key, float(val))
    elif isinstance(val, str):
        w.add_string(key, val)
    elif isinstance(val, bool):
        w.add_bool(key, val)
    elif isinstance(val, int):
        w.add_uint32(key, val)
    elif isinstance(val, np.ndarray):
        sub = {np.dtype(np.int32): gguf.GGUFValueType.INT32,
               np.dtype(np.float32): gguf.GGUFValueType.FLOAT32}[val.dtype]
        w.add_key_value(key, val.tolist(), gguf.GGUFValueType.ARRAY, sub_type=sub)
    elif isinstance(val, list):
        w.add_array(key, val)
    else:
        raise TypeError(f"metadata {key}: cannot write {type(val).__name__}")


def _tensor_seed(seed: int, name: str) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(name.encode())])


def synthesize(out: str | os.PathLike, opts: SynthOptions,
               progress: Callable[[int, int, str], None] | None = None,
               threads: int | None = None) -> list[Path]:
    """Write the model; returns the file(s). `progress(done_bytes, total_bytes, tensor)`."""
    import gguf
    preset = PRESETS.get(opts.preset)
    if preset is None:
        raise GGUFError(f"unknown preset {opts.preset!r}; presets: {', '.join(PRESETS)}")
    vocab = read_vocab(opts.vocab) if opts.vocab else builtin_vocab()
    n_vocab = preset.n_vocab or len(vocab)
    vocab = vocab.padded(n_vocab)
    n_layer = opts.n_layer or preset.n_layer
    c = _config(preset, n_vocab, n_layer)
    agree = opts.mtp_agree
    if agree is not None and not 0.0 <= agree <= 1.0:
        raise GGUFError(f"mtp agreement {agree} is not a rate between 0 and 1")
    plans = plan_tensors(opts, c, _mtp_specs(c, agree) if opts.mtp or agree is not None else [])
    if agree is not None:
        plans = _agreeing_mtp(plans, opts, c)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(None, ARCH, split_max_size=opts.split_max_size)
    for key, val in _metadata(opts, preset, c, vocab).items():
        _add_kv(w, key, val)
    for pl in plans:
        w.add_tensor_info(pl.name, (pl.nbytes,), np.dtype(np.uint8), pl.nbytes,
                          raw_dtype=gguf.GGMLQuantizationType(pl.qtype.type_id))
        # GGUFWriter derives the logical shape from a byte shape; give it the real one
        w.tensors[-1][pl.name].shape = list(pl.shape)
    w.path = out
    names = w.format_shard_names(out) if len(w.tensors) > 1 else [out]
    try:
        w.write_header_to_file(out)
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        total, done = sum(pl.nbytes for pl in plans), 0
        for pl, data in _generate(plans, opts.seed, threads):
            w.write_tensor_data(data)
            done += pl.nbytes
            if progress:
                progress(done, total, pl.name)
        w.close()
    except BaseException:
        w.close()
        for p in names:
            Path(p).unlink(missing_ok=True)
        raise
    return [Path(p) for p in names]


def _generate(plans: list[_Plan], seed: int, threads: int | None) -> Iterator[tuple[_Plan, np.ndarray]]:
    """Tensors in file order, made ahead by a thread pool (numpy's generators release the GIL)."""
    n = threads or min(16, os.cpu_count() or 1)
    with ThreadPoolExecutor(max_workers=n) as pool:
        window = 2 * n
        futures = {}

        def submit(i: int) -> None:
            pl = plans[i]
            futures[i] = pool.submit(lambda pl=pl: pl.make(_tensor_seed(seed, pl.name)))

        for i in range(min(window, len(plans))):
            submit(i)
        for i, pl in enumerate(plans):
            data = futures.pop(i).result()
            if i + window < len(plans):
                submit(i + window)
            if data.nbytes != pl.nbytes:
                raise AssertionError(f"{pl.name}: made {data.nbytes} bytes, planned {pl.nbytes}")
            yield pl, data


def parse_size(text: str) -> int:
    """'8GiB', '512M', '1.5G', '1000000' -> bytes (binary units for K/M/G/T with or without i)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kKmMgGtT]?)(i?[bB])?\s*", text)
    if not m:
        raise GGUFError(f"cannot read size {text!r}; write it like 8GiB, 512MiB or 4G")
    mult = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}[m.group(2).lower()]
    return int(float(m.group(1)) * mult)


def default_model_path(preset: str = "tiny", seed: int = 0) -> Path:
    """Where the embedded default model lives: the user's cache directory."""
    base = os.environ.get("FTPATCH_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "ftpatch")
    return Path(base) / f"synthetic-qwen35moe-{preset}-seed{seed}.gguf"


def ensure_default_model(preset: str = "tiny", seed: int = 0) -> Path:
    """Build the embedded default model once (atomically) and return its path."""
    path = default_model_path(preset, seed)
    if path.exists():
        return path
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    try:
        synthesize(tmp, SynthOptions(preset=preset, seed=seed))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


__all__ = ["PRESETS", "Preset", "SynthOptions", "synthesize", "parse_size",
           "default_model_path", "ensure_default_model"]
