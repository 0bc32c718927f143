"""Generation: sampling, the token stream, the chat session, prefix reuse, token read-back.

  SamplingParams, GREEDY, Sampler, SAMPLING_RULES, sampling_problem   sampling and its ranges
  TokenStream, TokenEvent, DoneEvent, Timings, StopScanner             the one token stream
  ScreenedSampler, screen_logits                                       non-finite logits caught
  generate                                                             it, driven for one sequence
  Session                                                              a chat on one State
  PrefixIndex, Cached, continue_ids, usable_prefix                     prefix reuse
  TokenReadback                                                        an id read while the next step runs
  TokenConstraint, GrammarConstraint, TriggeredConstraint, apply_mask constrained decoding (a mask hook)
  TokenLogprob, prompt_logprobs                                        log probabilities
"""
from .constraint import (ConstraintUnavailable, GrammarConstraint, TokenConstraint,
                         TriggeredConstraint, apply_mask, check_grammar, grammar_tokenizer)
from .logprobs import TokenLogprob, prompt_logprobs
from .generate import generate
from .prefix import Cached, PrefixIndex, continue_ids, usable_prefix
from .readback import TokenReadback
from .sampling import (DEFAULTS, GREEDY, SAMPLING_RULES, Sampler, SamplingParams, default_of,
                       recent_ids, sampling_problem)
from .session import Session
from .stream import (DoneEvent, ScreenedSampler, StopScanner, Timings, TokenEvent, TokenStream,
                     screen_logits, text_decoder)

__all__ = ["generate", "Cached", "PrefixIndex", "continue_ids", "usable_prefix", "TokenReadback",
           "DEFAULTS", "GREEDY", "SAMPLING_RULES", "Sampler", "SamplingParams", "default_of",
           "recent_ids", "sampling_problem", "Session", "DoneEvent", "StopScanner", "Timings",
           "TokenEvent", "TokenStream", "text_decoder", "ScreenedSampler", "screen_logits",
           "ConstraintUnavailable", "GrammarConstraint", "TokenConstraint", "TriggeredConstraint",
           "apply_mask",
           "check_grammar", "grammar_tokenizer", "TokenLogprob", "prompt_logprobs"]
