"""One request's token stream: moe_offload's own (generate() drives the same one)."""
from moe_offload import TokenStream

__all__ = ["TokenStream"]
