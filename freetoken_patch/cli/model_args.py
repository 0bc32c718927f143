"""Argparse helpers shared by the commands that load a model and generate (`run`, `chat`):
the model / device / context / VRAM flags, the sampling flags, the checks behind them, and the
model (plain or offload runtime) those flags ask for."""
from __future__ import annotations

import argparse

from ..errors import CLIError


def add_model_args(s: argparse.ArgumentParser, *, model_optional: bool = False,
                   model_help: str = "GGUF file, any shard of a split set, or a folder",
                   device_default: str | None = "cpu",
                   device_help: str = "cpu (default) or cuda / cuda:N; the whole model goes there"
                   ) -> None:
    """MODEL, --device, --ctx."""
    if model_optional:
        s.add_argument("model", nargs="?", help=model_help)
    else:
        s.add_argument("model", help=model_help)
    s.add_argument("--device", default=device_default, metavar="DEV", help=device_help)
    s.add_argument("--ctx", type=int, metavar="N",
                   help="context size in tokens (default: the model's, at most 4096)")


def add_sampling_args(s: argparse.ArgumentParser, *, n_default: int | None,
                      n_flags: tuple[str, ...] = ("-n", "--n-predict"),
                      n_help: str | None = None) -> None:
    """-n, --temp, --top-k, --top-p, --min-p, --repeat-penalty, --presence-penalty, --seed, --stop
    (read back with `sampling_params(args)`)."""
    s.add_argument(*n_flags, dest="n_predict", type=int, default=n_default, metavar="N",
                   help=n_help or f"most tokens to generate (default {n_default})")
    s.add_argument("--temp", type=float, default=0.8, help="temperature (default 0.8; 0 = greedy)")
    s.add_argument("--top-k", type=int, default=40, help="keep the k likeliest (default 40; 0 = off)")
    s.add_argument("--top-p", type=float, default=0.95, help="nucleus mass (default 0.95; 1 = off)")
    s.add_argument("--min-p", type=float, default=0.05,
                   help="drop tokens below min-p x the top probability (default 0.05; 0 = off)")
    s.add_argument("--repeat-penalty", type=float, default=1.0,
                   help="penalise the last 64 context tokens (default 1.0 = off)")
    s.add_argument("--presence-penalty", type=float, default=0.0,
                   help="subtract from tokens already present (default 0)")
    s.add_argument("--seed", type=int, help="random seed (default: a fresh one)")
    s.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="stop before this text (repeatable)")


def sampling_params(args: argparse.Namespace):
    """The SamplingParams the flags of `add_sampling_args` ask for."""
    from moe_offload.generate import SamplingParams
    if args.n_predict < 1:
        raise CLIError(f"-n {args.n_predict}: generate at least one token")
    return SamplingParams(temperature=args.temp, top_k=args.top_k, top_p=args.top_p,
                          min_p=args.min_p, repeat_penalty=args.repeat_penalty,
                          presence_penalty=args.presence_penalty, seed=args.seed,
                          max_tokens=args.n_predict, stop=tuple(args.stop))


def size_arg(text: str) -> int:
    """argparse type for sizes such as 8GiB, 512MiB or a plain byte count."""
    from loaders import GGUFError
    from loaders.synth import parse_size
    try:
        return parse_size(text)
    except GGUFError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def parse_device(name: str):
    """--device NAME -> torch.device, or a CLIError saying what is available."""
    import torch
    kind = name.split(":")[0]
    if kind not in ("cpu", "cuda"):
        raise CLIError(f"--device {name!r} is not known; use cpu or cuda (cuda:N for one GPU)")
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise CLIError("--device cuda: torch sees no CUDA device (CPU-only build, or no "
                           "GPU/driver); use --device cpu")
        index = int(name.split(":")[1]) if ":" in name else 0
        if index >= torch.cuda.device_count():
            raise CLIError(f"--device {name}: only {torch.cuda.device_count()} CUDA device(s)")
    return torch.device(name)


def context_size(ctx: int | None, n_ctx_train: int) -> int:
    """--ctx, or the model's training context capped at the default (4096)."""
    from moe_offload.state import DEFAULT_N_CTX
    if ctx is not None and ctx < 1:
        raise CLIError(f"--ctx {ctx}: the context needs at least one token")
    return ctx or min(n_ctx_train, DEFAULT_N_CTX)


def check_fits(ids: list[int], ctx: int | None, n_ctx_train: int) -> int:
    """The context size; fails when the prompt `ids` is empty or does not fit it."""
    from moe_offload.errors import OffloadError
    if not ids:
        raise CLIError("the prompt is empty (0 tokens); give some text or token ids")
    n_ctx = context_size(ctx, n_ctx_train)
    if len(ids) > n_ctx:
        raise OffloadError(f"the prompt has {len(ids)} tokens, more than the context of {n_ctx}; "
                           "shorten it or raise --ctx")
    return n_ctx


__all__ = ["add_model_args", "add_sampling_args", "sampling_params", "size_arg", "parse_device", "context_size",
           "check_fits"]


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


def placement_options(args) -> dict:
    """RuntimeOptions fields of add_placement_args' flags."""
    return {"host_head": bool(getattr(args, "host_head", False)),
            "host_embedding": not getattr(args, "gpu_embedding", False)}


def device_for(device: str | None, vram: int | None):
    """--device, defaulting to cuda under --vram; --vram without a CUDA device is refused."""
    import torch
    if vram is not None and not torch.cuda.is_available():
        raise CLIError("--vram puts the hot experts on a GPU and torch sees no CUDA device; "
                       "run without --vram to use the CPU")
    return parse_device(device or ("cuda" if vram is not None else "cpu"))


def build_for(loaded, dev, n_ctx: int, vram: int | None, placement: dict | None = None):
    """The plain model on one device, or (with --vram) the offload runtime, which presents the
    same interface (new_state / prefill / decode) plus stats()."""
    if vram is None:
        if placement and (placement.get("host_head") or not placement.get("host_embedding", True)):
            raise CLIError("--host-head and --gpu-embedding place weights for the offload "
                           "runtime; add --vram SIZE")
        from moe_offload.models import build_model
        return build_model(loaded, dev)
    if dev.type != "cuda":
        raise CLIError(f"--vram caps GPU memory, so it needs a CUDA device, not --device {dev}")
    try:
        from moe_offload.runtime import OffloadRuntime, RuntimeOptions
    except ImportError as e:
        raise CLIError(f"--vram needs the offload runtime (moe_offload.runtime), which does not "
                       f"import here ({e}); run without --vram") from None
    return OffloadRuntime(loaded, RuntimeOptions(vram=vram, n_ctx=n_ctx, device=str(dev),
                                                 **(placement or {})))


def offload_stats_lines(m: dict) -> list[str]:
    """The offload runtime's stats() as lines for people (chat's /stats, run's summary)."""
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
