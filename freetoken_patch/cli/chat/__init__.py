"""`ftpatch chat [MODEL]`: talk to a model in the terminal.

On a terminal: prompt_toolkit input (history in the cache directory, Alt-Enter for a new line,
bracketed paste) and rich output: while an answer streams, a transient view shows its newest
lines; then the whole answer is printed once, followed by a status line. With piped stdin: one
message (or command) per line in, each answer and a newline out on stdout; the banner, status
lines, command output and errors on stderr, no escape codes; the exit status is 1 if any line
failed.

Ctrl-C during an answer stops it between two tokens, so the cache still matches the conversation
and the partial answer stays in it. A second Ctrl-C stops at once; the cache may then be half a
step ahead, so it is dropped (the conversation is kept and re-read on the next message).
"""
from __future__ import annotations

import argparse
import sys

from ..model_args import (add_draft_arg, add_model_args, add_sampling_args, add_template_arg,
                          add_vram_arg, device_for, load_for_text, nonfinite_error,
                          sampling_params, speculative_for)
from .conversation import HELP, Conversation, answer, command
from .screens import PlainScreen, TerminalScreen

DESCRIPTION = """\
Chat with MODEL in the terminal. Without MODEL it runs the embedded default: a tiny synthetic
qwen35moe with random weights, built once into the cache directory, for trying the machinery
(its replies are gibberish by design).

The model runs on the CPU unless you say otherwise, GPU or not: --device cuda puts the whole
model in VRAM (fine for models that fit), --vram SIZE runs the offload runtime for ones that do
not. Input history is kept in the cache directory ($FTPATCH_CACHE, else ~/.cache/ftpatch).

Piped stdin is read one message per line; each answer is printed followed by a newline on
standard output, and everything else (banner, status lines, command output, errors) goes to
standard error, so scripts can drive it; the exit status is 1 if any line failed.
"""

EPILOG = f"""\
commands (type them at the prompt):
{HELP}

examples:
  ftpatch chat                                     # the embedded default (random weights)
  ftpatch chat model.gguf --temp 0.7 --system "Answer briefly."
  ftpatch chat model.gguf --no-think -n 2048       # skip the reasoning block (Qwen3.5 templates)
  ftpatch chat model.gguf --vram 8GiB --ctx 8192   # hot experts on the GPU under an 8 GiB cap
  ftpatch chat model.gguf --chat-template my.jinja # a template of yours instead of the file's
  printf 'hi\\n/stats\\n' | ftpatch chat             # scripted: one message per line
"""


def add_parser(sub) -> None:
    s = sub.add_parser("chat", help="chat with a model in the terminal",
                       description=DESCRIPTION, epilog=EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(s, model_optional=True, device_default=None,
                   ctx_auto="host RAM (the KV cache) or, under --vram, leaves the expert cache half "
                            "of its room",
                   model_help="GGUF file, shard or folder (default: the embedded random-weights "
                              "model)",
                   device_help="cpu (default; the whole model in RAM) or cuda / cuda:N (the whole "
                               "model in VRAM; with --vram: the GPU the runtime uses)")
    add_sampling_args(s, n_default=None,
                      n_help="most tokens per answer (default 1024; 128 for the embedded "
                             "default; -1 = until the end of text or a full context)")
    s.add_argument("--system", metavar="TEXT", help="system prompt (change it with /system)")
    s.add_argument("--no-think", action="store_true",
                   help="ask the chat template to skip the reasoning block (enable_thinking=false)")
    add_template_arg(s)
    add_vram_arg(s)
    add_draft_arg(s)


def load(args: argparse.Namespace, screen) -> tuple[Conversation, list[str]]:
    """The model, its session and the banner lines; bad input raises one clear error."""
    from loaders.synth import default_model_path, ensure_default_model
    from moe_offload import Session
    dev = device_for(args.device, args.vram)
    embedded = args.model is None
    if args.max_tokens is None:
        args.max_tokens = 128 if embedded else 1024
    params = sampling_params(args)
    if embedded:
        path = default_model_path()
        with screen.busy(f"building the embedded default model into {path.parent} (once)"
                         if not path.exists() else "loading the embedded default model"):
            ensure_default_model()
    else:
        path = args.model
    with screen.busy(f"loading {path}"):
        loaded, tok, template, choice, model = load_for_text(args, path, dev, "chat")
        n_ctx = choice.n_ctx
        session = Session(model, model.new_state(1, n_ctx), tok, template,
                          draft=speculative_for(args, model))
    conv = Conversation(session, params, args.system, False if args.no_think else None,
                        loaded=loaded)
    where = f"{dev}" + (f", offload runtime under {args.vram / 2**30:.2f} GiB of VRAM"
                        if args.vram is not None else "")
    if embedded:
        banner = ["embedded default model: a tiny synthetic qwen35moe with random weights, for "
                  "trying the machinery; its replies are gibberish, not a bug.",
                  "Pass a GGUF file (ftpatch chat MODEL.gguf) to talk to a real model."]
    else:
        banner = [f"{loaded.metadata.get('general.name') or path}"]
    banner.append(f"{where} | {choice.describe()} | /help lists the commands, Ctrl-D quits")
    if args.no_think and "enable_thinking" not in template.source:
        banner.append("note: this model's chat template has no thinking switch; --no-think "
                      "changes nothing")
    return conv, banner


def run(args: argparse.Namespace) -> int:
    from moe_offload import NonFiniteLogits
    interactive = sys.stdin.isatty() and sys.stdout.isatty()
    screen = TerminalScreen() if interactive else PlainScreen()
    conv, banner = load(args, screen)
    try:
        return talk(conv, banner, screen)
    except NonFiniteLogits as e:    # bad weights: one line and exit 1, not a chat error
        raise nonfinite_error(conv.loaded, e.position) from None


def talk(conv: Conversation, banner: list[str], screen) -> int:
    """The loop: lines in, answers and commands out; 1 if any line failed."""
    for line in banner:
        screen.note(line)
    while True:
        line = screen.read()
        if line is None:
            break
        stripped = line.strip()
        if not stripped:
            continue
        if stripped.startswith("/") and not stripped.startswith("//"):
            if not command(conv, screen, stripped):
                break
            continue
        answer(conv, screen, stripped[1:] if stripped.startswith("//") else line)
    return 1 if getattr(screen, "errors", 0) else 0


COMMANDS = {"chat": (add_parser, run)}
