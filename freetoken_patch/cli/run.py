"""`ftpatch run`: generate text after a prompt on one device (`run --vram`: under the offload
runtime), streaming it."""
from __future__ import annotations

import argparse
import sys

from ..errors import CLIError
from .model_args import (add_draft_arg, add_model_args, add_sampling_args, add_template_arg,
                         add_vram_arg, chat_template_for, check_fits, device_for,
                         nonfinite_error, offload_stats_lines, open_for, open_model_named,
                         sampling_params, speculative_for, stop_reason)

DESCRIPTION = """\
Generate text after PROMPT and stream it to standard output; the prompt and decode speeds
(tokens per second) and the time to first token follow on standard error, and under --vram the
expert cache's statistics. Sampling runs in llama.cpp's order: penalties, top-k, top-p, min-p,
temperature. --temp 0 is greedy.
"""

EPILOG = """\
examples:
  ftpatch run model.gguf -p "Once upon a time" -n 64
  ftpatch run model.gguf -p "Write a haiku about GPUs" --chat --temp 0.7 --seed 1
  ftpatch run 35b.gguf -p "Explain PCIe" --chat --vram 8GiB   # a model bigger than the GPU
  ftpatch run model.gguf -p "Hi" --chat --chat-template chatml.jinja   # not the file's template
"""


def add_parser(sub) -> None:
    s = sub.add_parser("run", help="generate text after a prompt, streaming it",
                       description=DESCRIPTION, epilog=EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(s, device_default=None,
                   device_help="cpu (default; the whole model in RAM) or cuda / cuda:N (the whole "
                               "model in VRAM; with --vram: the GPU the runtime uses)")
    s.add_argument("-p", "--prompt", required=True, metavar="TEXT", help="the prompt")
    add_vram_arg(s)
    s.add_argument("--chat", action="store_true",
                   help="send the prompt as a user message through the model's chat template")
    add_template_arg(s)
    add_sampling_args(s, n_default=128, n_predict_alias=True)
    add_draft_arg(s)


def timings_line(done) -> str:
    """Speeds after a generation. The token count is what was generated, the same number -n
    asks for; the first of them comes from the prompt's forward pass (inside TTFT), so the
    decode rate is of the steps after it."""
    t, n = done.timings, len(done.tokens)
    return (f"prompt: {t.n_prompt} tokens, {t.prompt_tps:.1f} tok/s | generated: {n} "
            f"token{'s' * (n != 1)}, decode {t.decode_tps:.1f} tok/s | TTFT {t.ttft_s * 1000:.0f} ms")


def run(args: argparse.Namespace) -> int:
    import torch

    from loaders.tokenizer import Tokenizer
    from moe_offload import DoneEvent, NonFiniteLogits, Session
    device = device_for(args.device, args.vram)
    params = sampling_params(args)
    if not args.prompt:
        raise CLIError("the prompt is empty; give some text with -p")
    loaded = open_model_named(args.model)
    if "tokenizer.ggml.tokens" not in loaded.metadata:
        raise CLIError(f"{args.model} has no tokenizer metadata, so `run` cannot read or write "
                       "text; use `ftpatch logits MODEL --tokens IDS` instead")
    tok = Tokenizer.from_metadata(loaded.metadata, str(args.model))
    template = chat_template_for(args, loaded.metadata, args.model)
    if args.chat:   # the prompt's text stays text: it cannot spell a turn's control tokens
        ids = template.render_prompt([{"role": "user", "content": args.prompt}], tok).ids
    else:
        ids = tok.encode(args.prompt, add_special=True, parse_special=True)
    n_ctx = check_fits(ids, args, loaded.config.n_ctx_train)
    model = open_for(args, loaded, device, n_ctx)
    try:
        session = Session(model, model.new_state(1, n_ctx), tok, template,
                          draft=speculative_for(args, model))
        try:
            with torch.inference_mode():
                for ev in session.generate(ids, params):
                    sys.stdout.write(ev.text)
                    sys.stdout.flush()
                    if isinstance(ev, DoneEvent):
                        done = ev
        except NonFiniteLogits as e:
            raise nonfinite_error(loaded, e.position) from None
        print()
        print(f"{timings_line(done)} | stop: {stop_reason(done.reason, params, n_ctx)}",
              file=sys.stderr)
        if session.draft is not None:
            print(session.draft.stats.summary(), file=sys.stderr)
        if model.caps.offload:
            for line in offload_stats_lines(model.stats()):
                print(line, file=sys.stderr)
    finally:
        model.close()   # the offload runtime gives back pinned pages and the allocator cap
    return 0


COMMANDS = {"run": (add_parser, run)}
