"""Argparse helpers shared by the commands that load a model and generate (`run`, `chat`):
the model / device / context / VRAM flags, the sampling flags, the checks behind them, and the
model (plain or offload runtime) those flags ask for."""
from __future__ import annotations

import argparse
import math
import sys

from ..errors import CLIError
from .inputs import check, check_seed


def add_model_args(s: argparse.ArgumentParser, *, model_optional: bool = False,
                   model_help: str = "GGUF file, any shard of a split set, or a folder",
                   device_default: str | None = "cpu",
                   device_help: str = "cpu (default) or cuda / cuda:N; the whole model goes there",
                   ctx_auto: str | None = None) -> None:
    """MODEL, --device, --ctx; ctx_auto: --ctx also takes `auto`, its default, and this says
    what the automatic context fits (serve and chat)."""
    if model_optional:
        s.add_argument("model", nargs="?", help=model_help)
    else:
        s.add_argument("model", help=model_help)
    s.add_argument("--device", default=device_default, metavar="DEV", help=device_help)
    if ctx_auto is None:
        s.add_argument("--ctx", type=int, metavar="N",
                       help="context size in tokens, up to the model's own unless "
                            "--allow-long-ctx (default: the model's, capped at 4096)")
    else:
        from .ctx_auto import ctx_arg
        s.add_argument("--ctx", type=ctx_arg, default="auto", metavar="N|auto",
                       help=f"context size in tokens, or auto (default): the largest that fits "
                            f"{ctx_auto}, up to the model's trained length; a number is checked "
                            "against that length unless --allow-long-ctx")
    s.add_argument("--allow-long-ctx", action="store_true",
                   help="let --ctx exceed the context the model was trained for (its output "
                        "past that length is usually poor)")
    add_kv_type_arg(s)


KV_TYPE_NAMES = ("f32", "f16", "q8_0", "q4_0")   # native.kv_cache.KV_TYPES (no torch at parse)


def add_kv_type_arg(s: argparse.ArgumentParser) -> None:
    s.add_argument("--kv-type", choices=("auto",) + KV_TYPE_NAMES, default="auto",
                   help="how the KV cache stores keys and values: f32, f16, or blocks of 32 "
                        "with ggml's arithmetic, q8_0 (8 bits and a scale: about half of f16's "
                        "bytes) or q4_0 (4 bits: about a quarter). auto (default): f32 without "
                        "--vram; under --vram f16 while the whole context's KV leaves the "
                        "expert cache its share of the cap (the rule --ctx auto uses), else "
                        "q8_0, else q4_0")


def kv_type_for(args, loaded, n_ctx: int, n_states: int = 1, vram=...) -> str:
    """--kv-type, with auto resolved for the context and the cap (args.vram unless `vram` is
    given: bytes, or None for none); sets args.kv_type."""
    kv = getattr(args, "kv_type", None) or "auto"
    c = loaded.config
    vram = getattr(args, "vram", None) if vram is ... else vram
    if kv == "auto":
        if vram is None:
            kv = "f32"
        else:
            from moe_offload import auto_kv_type
            kv = auto_kv_type(loaded, vram, n_ctx, n_seq=n_states)
    elif kv in ("q8_0", "q4_0") and c.head_dim % 32:
        raise CLIError(f"--kv-type {kv} stores blocks of 32 values and this model's heads have "
                       f"{c.head_dim}; use --kv-type f16")
    args.kv_type = kv
    return kv


def add_sampling_args(s: argparse.ArgumentParser, *, n_default: int | None,
                      n_help: str | None = None, n_predict_alias: bool = False) -> None:
    """-n/--max-tokens, --temp, --top-k, --top-p, --min-p, --repeat-penalty, --presence-penalty,
    --frequency-penalty, --seed, --stop (read back with `sampling_params(args)`);
    `n_predict_alias` also accepts llama.cpp's --n-predict, unlisted."""
    s.add_argument("-n", "--max-tokens", dest="max_tokens", type=int, default=n_default,
                   metavar="N", help=n_help or f"most tokens to generate (default {n_default}; "
                                              "-1 = until the end of text or a full context)")
    if n_predict_alias:
        s.add_argument("--n-predict", dest="max_tokens", type=int, default=argparse.SUPPRESS,
                       help=argparse.SUPPRESS)
    s.add_argument("--temp", type=float, default=0.8, metavar="T",
                   help="temperature, >= 0 (default 0.8; 0 = greedy)")
    s.add_argument("--top-k", type=int, default=40, metavar="K",
                   help="keep the k likeliest (default 40; 0 = off)")
    s.add_argument("--top-p", type=float, default=0.95, metavar="P",
                   help="nucleus mass, in (0, 1] (default 0.95; 1 = off)")
    s.add_argument("--min-p", type=float, default=0.05, metavar="P",
                   help="drop tokens below min-p x the top probability, in [0, 1] (default 0.05; "
                        "0 = off)")
    s.add_argument("--repeat-penalty", type=float, default=1.0, metavar="X",
                   help="penalise the last 64 context tokens, > 0 (default 1.0 = off)")
    s.add_argument("--presence-penalty", type=float, default=0.0, metavar="X",
                   help="subtract from tokens already present (default 0)")
    s.add_argument("--frequency-penalty", type=float, default=0.0, metavar="X",
                   help="subtract from a token once per time it is present (default 0)")
    s.add_argument("--seed", type=int, metavar="N",
                   help="random seed, 0 or more (default: a fresh one)")
    s.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="stop before this text (repeatable)")


def sampling_params(args: argparse.Namespace):
    """The SamplingParams the flags of `add_sampling_args` ask for, each checked."""
    from moe_offload import SamplingParams, sampling_problem
    n = args.max_tokens
    check("-n", n, n >= 1 or n == -1,
          "give 1 or more tokens, or -1 for no limit (until the end of text or a full context)")
    for flag, field, v in (("--temp", "temperature", args.temp), ("--top-k", "top_k", args.top_k),
                           ("--top-p", "top_p", args.top_p), ("--min-p", "min_p", args.min_p),
                           ("--repeat-penalty", "repeat_penalty", args.repeat_penalty),
                           ("--presence-penalty", "presence_penalty", args.presence_penalty),
                           ("--frequency-penalty", "frequency_penalty", args.frequency_penalty)):
        problem = sampling_problem(field, v)     # moe_offload's ranges: one table
        check(flag, v, problem is None, problem)
    check_seed("--seed", args.seed)
    return SamplingParams(temperature=args.temp, top_k=args.top_k, top_p=args.top_p,
                          min_p=args.min_p, repeat_penalty=args.repeat_penalty,
                          presence_penalty=args.presence_penalty,
                          frequency_penalty=args.frequency_penalty, seed=args.seed,
                          max_tokens=sys.maxsize if n == -1 else n, stop=tuple(args.stop))


def stop_reason(reason: str, params, n_ctx: int) -> str:
    """Why generation stopped, in words (`reason` as generate's DoneEvent gives it)."""
    return {"eog": "end of text", "stop": "a --stop text",
            "length": f"reached --max-tokens ({params.max_tokens})",
            "context": f"the context is full ({n_ctx} tokens; see --ctx)",
            "interrupted": "interrupted"}.get(reason, reason)


def size_arg(text: str) -> int:
    """argparse type for sizes such as 8GiB, 512MiB or 4G; a bare number is refused (does
    `--vram 8` mean 8 bytes or 8 GiB?): bytes are written 1000B."""
    from loaders import GGUFError
    from loaders.synth import parse_size
    try:
        n = parse_size(text)
    except GGUFError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if text.strip().replace(".", "", 1).isdigit():
        shown = text.strip()
        raise argparse.ArgumentTypeError(
            f"{shown!r} has no unit; write {shown}GiB for {shown} GiB (or {shown}MiB, {shown}B)")
    return n


def parse_device(name: str):
    """--device NAME -> torch.device, or a CLIError saying what is available."""
    import torch
    kind = name.split(":")[0]
    if kind not in ("cpu", "cuda"):
        raise CLIError(f"--device {name!r} is not known; use cpu or cuda (cuda:N for one GPU)")
    if name.count(":") > 1 or (":" in name and not name.split(":")[1].isdigit()):
        raise CLIError(f"--device {name!r}: write cuda:N with N a GPU index, e.g. cuda:0")
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise CLIError("--device cuda: torch sees no CUDA device (CPU-only build, or no "
                           "GPU/driver); use --device cpu")
        index = int(name.split(":")[1]) if ":" in name else 0
        if index >= torch.cuda.device_count():
            raise CLIError(f"--device {name}: only {torch.cuda.device_count()} CUDA device(s)")
    return torch.device(name)


def context_size(ctx: int | None, n_ctx_train: int, allow_long: bool = False) -> int:
    """--ctx, checked against the model's training context (unless allow_long), or by default
    that context capped at DEFAULT_N_CTX."""
    from moe_offload import DEFAULT_N_CTX
    if ctx is None:
        return min(n_ctx_train, DEFAULT_N_CTX)
    check("--ctx", ctx, ctx >= 1, "the context needs at least one token")
    check("--ctx", ctx, allow_long or ctx <= n_ctx_train,
          f"the model was trained for {n_ctx_train} tokens; give --ctx {n_ctx_train} or less, "
          "or add --allow-long-ctx to go past it")
    return ctx


def check_fits(ids: list[int], args: argparse.Namespace, n_ctx_train: int) -> int:
    """The context size of --ctx; fails when the prompt `ids` is empty or does not fit it."""
    from moe_offload import OffloadError
    if not ids:
        raise CLIError("the prompt is empty (0 tokens); give some text or token ids")
    n_ctx = context_size(args.ctx, n_ctx_train, args.allow_long_ctx)
    if len(ids) > n_ctx:
        raise OffloadError(f"the prompt has {len(ids)} tokens, more than the context of {n_ctx}; "
                           "shorten it or raise --ctx")
    return n_ctx


def open_model_named(path, *, strict: bool = True):
    """loaders.open_model, its errors naming the file when they do not already."""
    from loaders import GGUFError, open_model
    try:
        return open_model(path, strict=strict)
    except GGUFError as e:
        if str(path) in str(e):
            raise
        raise GGUFError(f"{path}: {e}") from e


__all__ = ["add_model_args", "add_sampling_args", "sampling_params", "stop_reason", "size_arg",
           "parse_device", "context_size", "check_fits", "open_model_named", "add_template_arg",
           "chat_template_for", "load_for_text", "open_for", "speculative_for",
           "check_memory", "nonfinite_error"]


def add_template_arg(s: argparse.ArgumentParser) -> None:
    s.add_argument("--chat-template", metavar="FILE",
                   help="a Jinja chat template to use instead of the model's own "
                        "(tokenizer.chat_template), e.g. when the file's template is refused")


def chat_template_for(args, metadata, model_path):
    """The chat template: --chat-template FILE if given, else the model's own (or ChatML)."""
    from loaders.chat_template import ChatTemplate
    path = getattr(args, "chat_template", None)
    if path is None:
        return ChatTemplate.from_metadata(metadata, str(model_path))
    try:
        with open(path, "rb") as f:
            raw = f.read(1 << 20)
    except OSError as e:
        raise CLIError(f"--chat-template {path}: {e.strerror or e}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CLIError(f"--chat-template {path}: not UTF-8 text (byte {e.start})") from None
    return ChatTemplate(text, where=str(path))


def load_for_text(args, path, dev, what: str):
    """A model that reads and writes text, as chat and serve open it: (loaded, tokenizer, chat
    template, the context chosen (ctx_auto.ContextChoice), model). `what` names the command in
    the error for a file without a tokenizer."""
    from loaders.tokenizer import Tokenizer
    from .ctx_auto import choose_context
    loaded = open_model_named(path)
    md = loaded.metadata
    if "tokenizer.ggml.tokens" not in md:
        raise CLIError(f"{path} has no tokenizer metadata, so {what} cannot read or write text; "
                       "use `ftpatch logits MODEL --tokens IDS` instead")
    tok = Tokenizer.from_metadata(md, str(path))
    template = chat_template_for(args, md, path)
    # sequences that hold a KV at once: under --vram the runtime's (--parallel); on the plain
    # model every State (serve: every active request's and every cached conversation's)
    n_states = (getattr(args, "parallel", None) or 1) if args.vram is not None \
        else states_held(args)
    choice = choose_context(args, loaded, dev, n_states)
    return loaded, tok, template, choice, open_for(args, loaded, dev, choice.n_ctx)


def add_vram_arg(s: argparse.ArgumentParser) -> None:
    s.add_argument("--vram", type=size_arg, metavar="SIZE",
                   help="run under the offload runtime with this VRAM cap (e.g. 8GiB): dense "
                        "weights and hot experts on the GPU, the rest in host RAM")
    add_placement_args(s)


def add_placement_args(s: argparse.ArgumentParser) -> None:
    """Where the offload runtime keeps the embedding and the output head (with --vram)."""
    s.add_argument("--host-head", action="store_true",
                   help="with --vram: keep the output head in host RAM too; frees its VRAM for "
                        "experts, but every token reads it over PCIe (for very small GPUs)")
    s.add_argument("--gpu-embedding", action="store_true",
                   help="with --vram: keep the token embedding in VRAM (by default it stays in "
                        "pinned host RAM: a token reads one row of it)")
    s.add_argument("--link-gbps", type=float, metavar="X",
                   help="with --vram: emulate a slower host-to-GPU link of X GB/s (11.8 is a "
                        "laptop's RTX 4060 on PCIe 4.0 x8): every copy of experts to the GPU takes "
                        "as long as that link would need")
    s.add_argument("--threads", type=int, metavar="N",
                   help="CPU threads for the native kernels (the experts the CPU computes; "
                        "default: every core, or every core but two under --vram: the GPU's "
                        "launching thread and the driver keep theirs)")
    s.add_argument("--cpu-repack", choices=("auto", "on", "off"), default="auto",
                   help="the weights the CPU multiplies (without --vram every weight but the "
                        "embedding, under --vram the experts), in its own repacked form where "
                        "their type has one (IQ3_S: 4-bit codes the kernels read without table "
                        "lookups; the same results, 22%% more bytes in host RAM, under --vram a "
                        "second copy of the experts). auto (default): where host RAM has room; "
                        "on; off")


def add_draft_arg(s: argparse.ArgumentParser, note: str = "") -> None:
    """--draft N|auto of run, chat and serve; `note` adds what the command does with it."""
    from .bench_spec import parse_draft
    s.add_argument("--draft", type=parse_draft, default=0, metavar="N|auto",
                   help="speculative decoding with the model's MTP head: N draft tokens a step "
                        "(1..3), or auto (chosen each step from the measured acceptance and "
                        "cost, plain decoding where drafting does not pay); the output is the "
                        "same as without. With --vram, auto is the one to try (measured on an "
                        "8 GiB cap: 1.45-1.49x at 0.8 acceptance with realistic routing, "
                        "0.98-1.00x where drafts rarely match; docs/BENCHMARKS.md). Default 0: "
                        "off (on "
                        "the CPU engine drafting costs more than it saves)" + note)


def speculative_for(args, backend):
    """The SpeculativeDecoder --draft asks for (None when off); `backend` was opened with the
    MTP head (open_for does so when --draft is given)."""
    draft = getattr(args, "draft", 0)
    if not draft:
        return None
    from moe_offload import SpeculativeDecoder
    return SpeculativeDecoder(backend, draft=draft)


def placement_options(args) -> dict:
    """open_runtime options (RuntimeOptions fields) of add_placement_args' flags, checked."""
    link, threads = getattr(args, "link_gbps", None), getattr(args, "threads", None)
    if link is not None:
        check("--link-gbps", link, math.isfinite(link) and 0.1 <= link <= 1000,
              "give the emulated link's rate in GB/s, from 0.1 to 1000 (e.g. 11.8)")
    if threads is not None:
        check("--threads", threads, 1 <= threads <= 1024, "give 1 or more threads")
    out = {"mtp": bool(getattr(args, "draft", 0)),
           "host_head": bool(getattr(args, "host_head", False)),
           "host_embedding": not getattr(args, "gpu_embedding", False),
           "link_gbps": link, "cpu_threads": threads,
           "cpu_repack": getattr(args, "cpu_repack", "auto")}
    if getattr(args, "parallel", None) and getattr(args, "vram", None) is not None:
        out["max_sequences"] = args.parallel   # serve: the runtime holds that many sequences
    return out


def resolve_parallel(args: argparse.Namespace) -> int:
    """--parallel of serve and bench serve, checked: by default 4, but 1 under --vram, where
    each more sequence takes its state and KV from the expert cache (asked for, not default)."""
    if args.parallel is None:
        args.parallel = 1 if args.vram is not None else 4
    check("--parallel", args.parallel, 1 <= args.parallel <= 256, "give 1 to 256")
    return args.parallel


def device_for(device: str | None, vram: int | None):
    """--device, defaulting to cuda under --vram; --vram without a CUDA device is refused."""
    import torch
    if vram is not None and not torch.cuda.is_available():
        raise CLIError("--vram puts the hot experts on a GPU and torch sees no CUDA device; "
                       "run without --vram to use the CPU")
    return parse_device(device or ("cuda" if vram is not None else "cpu"))


def open_for(args, loaded, dev, n_ctx: int):
    """The Backend the flags ask for: the plain model on `dev`, or (with --vram) the offload
    runtime; with --draft the model's MTP head too."""
    from loaders.model import mtp_weights
    from moe_offload import open_backend
    placement = placement_options(args)
    vram = getattr(args, "vram", None)
    if placement.pop("mtp") and not mtp_weights(loaded):
        raise CLIError("--draft needs an MTP block (nextn_predict_layers = 1) and this model "
                       "has none; run without --draft")
    kv_type = kv_type_for(args, loaded, n_ctx, (getattr(args, "parallel", None) or 1)
                          if vram is not None else states_held(args))
    if vram is None:
        check_memory(loaded, dev, n_ctx, sequences=states_held(args), kv_type=kv_type)
        if placement["host_head"] or not placement["host_embedding"]:
            raise CLIError("--host-head and --gpu-embedding place weights for the offload "
                           "runtime; add --vram SIZE")
        if placement["link_gbps"] is not None:
            raise CLIError("--link-gbps emulates the link the offload runtime copies experts "
                           "over; add --vram SIZE")
        return open_backend(loaded, device=dev, n_ctx=n_ctx, mtp=bool(getattr(args, "draft", 0)),
                            cpu_repack=placement["cpu_repack"],
                            cpu_threads=placement["cpu_threads"], kv_type=kv_type)
    if dev.type != "cuda":
        raise CLIError(f"--vram caps GPU memory, so it needs a CUDA device, not --device {dev}")
    return open_backend(loaded, device=dev, vram=vram, n_ctx=n_ctx,
                        mtp=bool(getattr(args, "draft", 0)), kv_type=kv_type, **placement)


def states_held(args) -> int:
    """Sequences whose state the plain model holds at once: serve's --parallel and its prefix
    cache, else one."""
    return (getattr(args, "parallel", None) or 1) + (getattr(args, "prefix_cache", None) or 0)


def check_memory(loaded, dev, n_ctx: int, *, sequences: int = 1, logits_rows: int = 0,
                 kv_type: str = "f32") -> None:
    """Before the plain model is built: what it needs beside its weights (moe_offload.memory's
    estimate: delta-net states, a KV cache that may fill n_ctx, a prompt chunk's workspace) must
    fit what this process may still take, on the CPU from host RAM, on a GPU from what the
    device has free once the weights are there; else one line naming the key responsible."""
    from moe_offload import KV_TYPES, check_host_memory, check_vram_memory, estimate_memory
    what = str(loaded.file.path)
    kv_bytes = KV_TYPES[kv_type].bytes_per_value(loaded.config.head_dim)
    if dev.type == "cpu":
        check_host_memory(estimate_memory(loaded.config, n_ctx, sequences=sequences,
                                          logits_rows=logits_rows, kv_bytes=kv_bytes), what)
        return
    import torch
    free = torch.cuda.mem_get_info(dev)[0]
    weights = sum(w.nbytes for w in loaded.weights.values())
    est = estimate_memory(loaded.config, n_ctx, sequences=sequences, kv_sequences=sequences,
                          logits_rows=logits_rows, where="VRAM", kv_bytes=kv_bytes)
    check_vram_memory(est, max(0, free - weights), f"{dev} (free memory less the weights)", what)


def nonfinite_error(loaded, position: int) -> CLIError:
    """One line for logits that are NaN or Inf at `position`: the file, the position, and the
    cause -- the weights whose stored values or block scales are NaN/Inf when there are (read
    for at most 10 s), else a tensor stored as the wrong type is the likely one."""
    from loaders.model import nonfinite_weights
    names, complete = nonfinite_weights(loaded)
    if names:
        more = f" (and {len(names) - 1} more tensors)" if len(names) > 1 else ""
        cause = f"{names[0]} holds NaN/Inf{more}: the file is corrupt"
    else:
        read = "no weight stores NaN/Inf" if complete else "no weight read in 10 s stores NaN/Inf"
        cause = (f"{read}, so a tensor is likely corrupt in its values or stored as the wrong "
                 "type (its values overflow)")
    return CLIError(f"{loaded.file.path}: the logits at position {position} are not finite "
                    f"(NaN or Inf): {cause}; download or convert the file again")


def offload_stats_lines(m) -> list[str]:
    """The offload runtime's stats() (RuntimeStats, or its dict) as lines for people (chat's
    /stats, run's summary)."""
    if not isinstance(m, dict):
        m = m.as_dict()
    fetched, cpu = int(m.get("fetched", 0)), int(m.get("cpu", 0))
    lines = [f"expert cache: hit rate {100 * m.get('hit_rate', 0.0):.1f}%, {m.get('hits', 0)} "
             f"hits, {fetched + cpu} misses ({fetched} fetched over PCIe, {cpu} run on the CPU)"]
    if m.get("cache_slots"):
        kv = (f"; the KV maps {m['kv_bytes'] / 2**20:.0f} MiB (it grows with the conversation)"
              if m.get("kv_bytes") else "")
        lines.append(f"cache size: {m['cache_slots'][0]} slots a layer now, "
                     f"{m['cache_bytes'] / 2**30:.2f} GiB of VRAM{kv}")
    if m.get("prefetched"):
        lines.append(f"prefetch: {m['prefetched']} experts guessed ahead, precision "
                     f"{100 * m['prefetch_precision']:.0f}%, recall {100 * m['prefetch_recall']:.0f}%")
    return lines
