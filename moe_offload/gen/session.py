"""A chat session: model + state + tokenizer + chat template, the conversation kept in the cache
between turns (prefix reuse by prefix.py's rule)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, Sequence

from ..errors import OffloadError
from ..state import State
from .generate import generate
from .prefix import continue_ids, usable_prefix
from .sampling import GREEDY, SamplingParams
from .stream import DoneEvent, TokenEvent

@dataclass
class Session:
    """Model + state + tokenizer + chat template. `chat(messages)` renders the whole conversation
    and feeds only what the cache lacks: the longest cached prefix is kept (rewinding to a turn
    snapshot when the new prompt diverges inside the cache)."""

    model: object
    state: State
    tokenizer: object = None
    template: object = None
    tokens: list[int] = field(default_factory=list)      # ids now in the cache, in order
    max_snapshots: int = 4
    draft: object = None                                  # a spec.SpeculativeDecoder (MTP head)
    text: str | None = None                              # the text `tokens` spell (chat turns)
    _prompt: tuple = (0, None)                           # (ids, text) of the last chat prompt
    _snaps: list = field(default_factory=list, repr=False)

    @classmethod
    def load(cls, path, device: str = "cpu", n_ctx: int | None = None,
             kv_type="f32", experts_device: str | None = None) -> "Session":
        """Open a GGUF, put it on `device`; tokenizer and template when the file has them."""
        from loaders import open_model
        from loaders.chat_template import ChatTemplate
        from loaders.tokenizer import Tokenizer
        from ..models import build_model
        loaded = open_model(path)
        model = build_model(loaded, device, experts_device)
        md = loaded.metadata
        tok = Tokenizer.from_metadata(md, str(path)) if "tokenizer.ggml.tokens" in md else None
        tmpl = ChatTemplate.from_metadata(md, str(path)) if tok is not None else None
        return cls(model, model.new_state(1, n_ctx, kv_type), tok, tmpl)

    def reset(self) -> None:
        self.state.reset()
        self.tokens.clear()
        self._snaps.clear()
        self.text, self._prompt = None, (0, None)

    def generate(self, prompt: Sequence[int], params: SamplingParams = GREEDY
                 ) -> Iterator[TokenEvent | DoneEvent]:
        """Continue the cached sequence with `prompt` ids and stream the reply. Stopping early
        (leaving the loop) is fine: the session keeps what the cache holds."""
        start, sampled = len(self.tokens), []
        self.text, self._prompt = None, (0, None)   # ids without their text (chat() sets it)
        self._snapshot()                          # end of the previous reply
        gen = generate(self.model, self.state, prompt, params, tokenizer=self.tokenizer,
                       history=self.tokens, draft=self.draft)
        try:
            for ev in gen:
                if isinstance(ev, TokenEvent):
                    if not sampled:
                        self._snapshot()          # prompt prefilled, reply not yet fed
                    sampled.append(ev.token)
                yield ev
        finally:                                  # the last sampled id is never fed
            gen.close()                           # (a speculative step gives back the rest)
            self.tokens += (list(prompt) + sampled)[:self.state.n_past - start]

    def complete(self, text: str, params: SamplingParams = GREEDY) -> Iterator[TokenEvent | DoneEvent]:
        """Plain text continuation (special-token text is parsed; BOS added if the model asks)."""
        ids = self._tok().encode(text, add_special=not self.tokens, parse_special=True)
        return self.generate(ids, params)

    def chat(self, messages: Sequence[dict], params: SamplingParams = GREEDY,
             enable_thinking: bool | None = None, allow_special_in_content: bool = False
             ) -> Iterator[TokenEvent | DoneEvent]:
        """The assistant's reply to the whole conversation `messages` (OpenAI-style list).

        The template is applied to the whole conversation (ChatTemplate.render_prompt: text in
        the messages never becomes control tokens unless allow_special_in_content), but when
        its text extends the text the cache holds (the last turn's prompt and reply), the
        cached ids are kept and only the new text is tokenized, as the prompt tokenizes it: a
        reply's text need not tokenize back into the ids sampled, and the next turn should
        not prefill the conversation again because of that."""
        tok = self._tok()
        rp = self.template.render_prompt(messages, tok, enable_thinking=enable_thinking,
                                         allow_special_in_content=allow_special_in_content)
        ids = (continue_ids(self.tokens, self.text, rp.text, rp.encode_suffix)
               or self._from_prompt(rp.text, rp.encode_suffix) or rp.ids)
        return self._turn(ids, rp.text, params)

    def _from_prompt(self, text: str, encode) -> list[int] | None:
        """The last prompt's ids, then `text`'s rest, when `text` extends that prompt's text and
        its rewind point is kept (prefix.py: where a reply's text does not come back exactly)."""
        n, prompt_text = self._prompt
        if prompt_text is None or not any(s.n_past == n for s in self._snaps):
            return None
        return continue_ids(self.tokens[:n], prompt_text, text, encode)

    def _turn(self, ids: list[int], text: str, params: SamplingParams
              ) -> Iterator[TokenEvent | DoneEvent]:
        try:
            yield from self.generate(ids[self._reuse(ids):], params)
        finally:   # the cache holds `ids` (the text) and the reply's ids fed after them
            whole = len(self.tokens) >= len(ids)
            self.text = text + self.tokenizer.decode(self.tokens[len(ids):]) if whole else None
            self._prompt = (len(ids), text) if whole else (0, None)

    # -- prefix reuse -----------------------------------------------------------------------

    def _reuse(self, ids: list[int]) -> int:
        """Rewind the cache to the longest usable prefix of ids; returns its length (< len(ids))."""
        n, snap = usable_prefix(self.tokens, self._snaps, ids)
        if snap is None and n == len(self.tokens):
            return n
        if snap is None:
            self.reset()
            return 0
        self.state.restore(snap)
        self._snaps = [s for s in self._snaps if s.n_past <= snap.n_past]
        del self.tokens[snap.n_past:]
        return snap.n_past

    def _snapshot(self) -> None:
        if self.state.n_past and not (self._snaps and self._snaps[-1].n_past == self.state.n_past):
            self._snaps = (self._snaps + [self.state.snapshot()])[-self.max_snapshots:]

    def _tok(self):
        if self.tokenizer is None:
            raise OffloadError("this model has no tokenizer metadata; pass token ids instead of text")
        return self.tokenizer
