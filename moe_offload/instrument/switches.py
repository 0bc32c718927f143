"""A/B switches: each fast path beside the reference it must equal, so tests and A/B timings
can run either. Read at call time, so a test sets one for a block of code."""
from __future__ import annotations

import os

# native step kernels (norms, routing, swiglu, the delta-net, attention) on CUDA and CPU
# tensors; off: models/layers.py's torch code, their reference
STEP_KERNELS = True
# a CPU forward of up to 8 tokens of one sequence in one native call (models/cpu_plan.py);
# off (or FTPATCH_DECODE_LOOP=0): the per-op path, a kernel call at a time from Python
CPU_PLAN = os.environ.get("FTPATCH_DECODE_LOOP", "1") != "0"
# a prompt chunk's attention products on a GPU's tensor cores (TF32 operands, f32 sums:
# attention.attention_tiled); off (or FTPATCH_ATTENTION_TF32=0): full float32
ATTENTION_TF32 = os.environ.get("FTPATCH_ATTENTION_TF32", "1") != "0"
# a prompt chunk's per-tile softmax update (mask, max, exp, sum) as one CUDA kernel
# (native.ops.softmax_tile_); off (or FTPATCH_SOFTMAX_TILE=0): the torch ops, its reference
SOFTMAX_TILE = os.environ.get("FTPATCH_SOFTMAX_TILE", "1") != "0"
