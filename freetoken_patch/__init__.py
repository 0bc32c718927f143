"""freetoken_patch: what a person touches.

- `cli` — the `ftpatch` command: one module per command (inspect, synth, tokenize, logits, run,
  chat, bench); public names `main`, `build_parser`.
- `errors` — `CLIError`, bad command-line input.
- `server`, `upstream` — reserved: the OpenAI-compatible server; the FreeToken runtime patch,
  doctor and pr-notes builder.
"""
