"""The offload runtime: a MoE model under a hard VRAM cap (runtime.py is its face)."""
