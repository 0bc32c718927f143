"""Speculative decoding with the model's MTP head: the draft policy and the decoder."""
