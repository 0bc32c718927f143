"""The OpenAI- and Anthropic-compatible server behind `ftpatch serve` (FastAPI + uvicorn).

  app.py            routes, pydantic request/response models, checks, auth, request counts
  engine.py         the bounded queue and the one thread that owns the model: active sequences
                    advanced together (batched, newcomers' prompts in chunks) or in turn
                    (interleaved: the --vram runtime), a prefix cache of recent States
  sequence.py       one request's sampling and stop rules fed logits from a batched step
  openai_format.py  error objects, message content, SSE chunks, the reasoning and tool-call parsers
  anthropic_format.py  Anthropic's Messages API: its request, messages -> the template's,
                    content blocks whole or as named SSE events, stop reasons, usage, errors
  metrics.py        Prometheus text for /metrics

FastAPI and uvicorn come with the `serve` extra (pip install 'ftpatch[serve]'); importing this
package does not need them, `server.app` does.
"""
