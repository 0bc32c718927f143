"""freetoken_patch: what a person touches.

- `cli` — the `ftpatch` command: one module per command (inspect, synth, tokenize, logits, run,
  chat, serve, bench, doctor, freetoken, pr-notes); public names `main`, `build_parser`.
- `errors` — `CLIError`, bad command-line input.
- `server` — the OpenAI-compatible server behind `ftpatch serve`.
- `upstream` — the FreeToken integration: the runtime patch, its doctor, the pr-notes builder.
- `report` — `ftpatch bench report`'s page, charts and tables.
"""
