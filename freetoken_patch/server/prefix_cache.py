"""The server's prefix cache: moe_offload's prefix index (the chat session keeps the same rule)."""
from moe_offload import Cached, PrefixIndex as PrefixCache

__all__ = ["Cached", "PrefixCache"]
