"""The OpenAI- and Anthropic-compatible server behind `ftpatch serve` (FastAPI + uvicorn).

A request's path: access.py (log line, retry headers) -> auth.py -> app.py's route ->
validate.py (fields) -> prompt.py (template, ids, fits the context) -> structured.py (a mask,
if the reply is constrained) -> engine.py (queue, thread) -> streams.py (SSE or the whole
reply, in the route's API).

  app.py            create_app(): the routes (validate -> prompt -> submit -> reply), the model
                    card, /tokenize and /detokenize, and the exception handlers; re-exports Served
  access.py         the outermost wrapper: one access-log line a request (--log-format), and
                    x-should-retry / retry-after where clients look for them
  validate.py       the OpenAI routes' pydantic models and every field check (sampling ranges,
                    tool_choice, logprobs, the model's name, pydantic's errors as one line)
  prompt.py         messages (+ tools) -> ChatTemplate.render_prompt -> text and ids (client text
                    never control ids; system messages anywhere); the context-fit check, in the
                    wording each API's clients act on
  structured.py     response_format and forced tool calls -> a grammar -> GrammarConstraint
  streams.py        a job's events out: SSE in each dialect (one event loop), or one reply
  auth.py           the API key and per-route request counts (an ASGI wrapper)
  served.py         Served: the engine, tokenizer, template and names the routes read
  jobs.py           Job (a request's ids, sampling and event queue), Failure, the submit
                    refusals, Active (an admitted job: its State, ids, snapshots)
  engine.py         the bounded queue and the one thread that owns the backend: admission with
                    prefix reuse (moe_offload.PrefixIndex), the interleaved and speculative
                    modes, failures, the States
  batcher.py        the batched mode's step: decode_many for all, prompts in chunks, run-ahead;
                    each request's rules are moe_offload's TokenStream (generate()'s own)
  openai_format.py  error objects, message content, SSE chunks, the reasoning and tool-call parsers
  anthropic_format.py  Anthropic's Messages API: its request, messages -> the template's,
                    content blocks whole or as named SSE events, stop reasons, usage, errors
  metrics.py        Prometheus text for /metrics

FastAPI and uvicorn come with the `serve` extra (pip install 'ftpatch[serve]'); importing this
package does not need them, `server.app` does.
"""
