"""Model forward passes, one module per architecture, and `build_model` to put one on a device.

Public names:
  build_model(loaded, device, experts_device=None, cpu_repack="auto")  LoadedModel -> model
                         object on a device
  MODELS                 architecture name -> model class (the one registry of runnable archs);
                         a class offers forward / prefill / decode / new_state, router_logits
                         (the offload runtime's guesses) and FUSED_PROJECTIONS
  Qwen35Moe              the qwen35moe forward pass (forward / prefill / decode / new_state)
  ResidentExperts, upload_weights, split_gate_up   weights on a device; the experts interface
  repack_cpu_weights     host-RAM weights in the CPU's repacked forms (native.ops.cpu_form)
  attention_tiled        a prompt chunk's causal attention over a cache of any KV type, read in
                         tiles (what prefill runs a layer; scripts/dev/attention_bench.py times it)
"""
from __future__ import annotations

import torch

from ..errors import OffloadError
from .attention import attention_tiled
from .qwen35moe import Qwen35Moe
from .weights import Experts, ResidentExperts, repack_cpu_weights, split_gate_up, upload_weights

MODELS = {"qwen35moe": Qwen35Moe}


def build_model(loaded, device: torch.device | str = "cpu",
                experts_device: torch.device | str | None = None, cpu_repack: str = "auto"):
    """Upload a validated LoadedModel's weights and wrap them in its architecture's model.
    Weights the CPU multiplies are repacked into its own form where their type has one
    (`cpu_repack`: auto = where host RAM has room, on, off; see repack_cpu_weights)."""
    cls = MODELS.get(loaded.arch.name)
    if cls is None:
        raise OffloadError(f"architecture {loaded.arch.name!r} has no forward pass; "
                           f"runnable: {', '.join(MODELS)}")
    if loaded.problems:
        raise OffloadError(f"{loaded.file.path}: {loaded.problems[0]}")
    fuse = cls.FUSED_PROJECTIONS if torch.device(device).type != "cpu" else None  # no copies on the CPU
    tensors, experts = upload_weights(loaded, device, experts_device, fuse=fuse)
    return cls(loaded.config, *repack_cpu_weights(tensors, experts, cpu_repack))


__all__ = ["attention_tiled", "MODELS", "build_model", "Qwen35Moe", "Experts", "ResidentExperts",
           "upload_weights", "split_gate_up", "repack_cpu_weights"]
