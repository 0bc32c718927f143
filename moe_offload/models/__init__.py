"""Model forward passes, one module per architecture, and `build_model` to put one on a device.

Public names:
  build_model(loaded, device, experts_device=None)  LoadedModel -> model object on a device
  MODELS                 architecture name -> model class (the one registry of runnable archs);
                         a class offers forward / prefill / decode / new_state, router_logits
                         (the offload runtime's guesses) and FUSED_PROJECTIONS
  Qwen35Moe              the qwen35moe forward pass (forward / prefill / decode / new_state)
  ResidentExperts, upload_weights, split_gate_up   weights on a device; the experts interface
"""
from __future__ import annotations

import torch

from ..errors import OffloadError
from .qwen35moe import Qwen35Moe
from .weights import Experts, ResidentExperts, split_gate_up, upload_weights

MODELS = {"qwen35moe": Qwen35Moe}


def build_model(loaded, device: torch.device | str = "cpu",
                experts_device: torch.device | str | None = None):
    """Upload a validated LoadedModel's weights and wrap them in its architecture's model."""
    cls = MODELS.get(loaded.arch.name)
    if cls is None:
        raise OffloadError(f"architecture {loaded.arch.name!r} has no forward pass; "
                           f"runnable: {', '.join(MODELS)}")
    if loaded.problems:
        raise OffloadError(f"{loaded.file.path}: {loaded.problems[0]}")
    fuse = cls.FUSED_PROJECTIONS if torch.device(device).type != "cpu" else None  # no copies on the CPU
    tensors, experts = upload_weights(loaded, device, experts_device, fuse=fuse)
    return cls(loaded.config, tensors, experts)


__all__ = ["MODELS", "build_model", "Qwen35Moe", "Experts", "ResidentExperts", "upload_weights",
           "split_gate_up"]
