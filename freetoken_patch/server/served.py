"""What the app serves: the engine, the tokenizer and chat template, the model's name and
context, the API key, the metrics and the request limits. The CLI (and tests) build one; every route reads it."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .engine import Engine
from .limits import Limits
from .metrics import Metrics
from .openai_format import now


@dataclass
class Served:
    """The model behind the app: its engine, tokenizer, chat template and names."""
    engine: Engine
    tokenizer: Any
    template: Any
    model_id: str
    n_ctx: int
    api_key: str | None = None
    metrics: Metrics = field(default_factory=Metrics)
    created: int = field(default_factory=now)
    limits: Limits = field(default_factory=Limits)   # what a request may cost (limits.py)
    allow_special: bool = False       # --allow-special-in-content: client text may spell controls
    context: Any = None               # cli.ctx_auto.ContextChoice: how n_ctx was chosen
    n_ctx_train: int | None = None

    @property
    def n_logits(self) -> int | None:
        """The model's logits width (a padded head may pass the tokenizer), None if unknown."""
        return getattr(getattr(self.engine.model, "config", None), "n_vocab", None)

    @property
    def n_ids(self) -> int:
        """The token ids a request may name: the tokenizer's, within the model's logits."""
        return min(len(self.tokenizer), self.n_logits or len(self.tokenizer))

    def model_meta(self) -> dict:
        """/v1/models' `meta` (llama-server's n_ctx, and how the context was chosen)."""
        meta = {"n_ctx": self.n_ctx, "n_vocab": len(self.tokenizer)}
        if self.n_ctx_train is not None:
            meta["n_ctx_train"] = self.n_ctx_train
        if self.context is not None:
            meta.update(self.context.as_meta())
        return meta
