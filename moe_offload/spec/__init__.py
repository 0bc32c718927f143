"""Speculative decoding with the model's MTP head.

  SpeculativeDecoder   draft k tokens, verify them in one trunk step, keep the agreeing prefix
  DraftPolicy          how many to draft each step (fixed, or adaptive on measured costs)
  SpecStats            what it did
"""
from .decoder import SpeculativeDecoder
from .policy import DraftPolicy, SpecStats

__all__ = ["SpeculativeDecoder", "DraftPolicy", "SpecStats"]
