"""TokenReadback: the host gets the token's value, and the next step is queued before the read."""
from __future__ import annotations

import pytest
import torch

from moe_offload.gen.readback import TokenReadback


def _order_of(device):
    events = []
    tok = torch.tensor([7], device=device)
    value, ahead = TokenReadback(torch.device(device))(tok, lambda: events.append("queued") or "ahead")
    return value, ahead, events


def test_on_the_cpu_the_step_runs_and_the_value_comes_back():
    value, ahead, events = _order_of("cpu")
    assert (value, ahead, events) == (7, "ahead", ["queued"])


@pytest.mark.gpu
def test_on_a_gpu_the_value_crosses_pinned_memory_while_the_next_step_queues():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    rb = TokenReadback(torch.device("cuda"))
    for v in (3, 248319, 0):   # the slot is reused: each read sees its own token
        tok = torch.tensor([v], device="cuda")
        got, nxt = rb(tok, lambda: tok * 2)   # the queued work reads the device token
        assert got == v and int(nxt) == 2 * v


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_several_ids_come_back_in_order_whatever_their_count(device):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    rb = TokenReadback(torch.device(device))
    for ids in ([5], [1, 248319, 2, 0], [9, 8], list(range(6))):   # the buffer grows, is reused
        t = torch.tensor(ids, device=device)
        got, nxt = rb.many(t, lambda: t + 1)
        assert got == ids and nxt.tolist() == [i + 1 for i in ids]
