"""Reserved for the OpenAI-compatible server behind `ftpatch serve` (FastAPI + uvicorn): request
models, a batcher that feeds the runtime's multi-sequence steps, a store of prefix snapshots, and
metrics. Nothing is built yet; the package exports no names."""
