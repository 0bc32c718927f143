"""`Qwen35Moe.decode_many`: B single-sequence states at different positions advanced by one
token each in one step equal each sequence decoded alone (greedy ids identical, logits within
float noise), with the CPU kernels the server uses and with the reference ones."""
from __future__ import annotations

import pytest
import torch

from loaders import open_model
from moe_offload.errors import OffloadError
from moe_offload.models import build_model

PROMPTS = [[5, 17, 99, 3, 42], list(range(30, 52)), [7], list(range(200, 212))]


@pytest.fixture(scope="module")
def model(tiny_model):
    return build_model(open_model(tiny_model), "cpu")


def _greedy_alone(model, prompt, steps):
    """(logits [steps, V], ids) of one sequence decoded by itself."""
    st = model.new_state(1, 128)
    logits = model.prefill(torch.tensor([prompt], device=model.device), st)
    out, ids = [], []
    for _ in range(steps):
        tok = int(logits.argmax(-1))
        ids.append(tok)
        logits = model.decode(torch.tensor([tok], device=model.device), st)
        out.append(logits[0])
    return torch.stack(out).cpu(), ids


def _greedy_together(model, prompts, steps, fresh=()):
    """The same through decode_many: prompts prefilled apart (None: a fresh state whose first
    token is `fresh[i]`), then `steps` joint steps."""
    states = [model.new_state(1, 128) for _ in prompts]
    toks = []
    for p, st, f in zip(prompts, states, fresh or [None] * len(prompts)):
        toks.append(f if p is None else
                    int(model.prefill(torch.tensor([p], device=model.device), st).argmax(-1)))
    out, ids = [], [[] for _ in prompts]
    for _ in range(steps):
        for b, t in enumerate(toks):
            ids[b].append(t)
        logits = model.decode_many(torch.tensor(toks, device=model.device), states)
        out.append(logits)
        toks = logits.argmax(-1).tolist()
    return torch.stack(out, 1).cpu(), ids, states               # [B, steps, V]


@pytest.mark.parametrize("kernels", ["native", "reference"])
def test_decode_many_equals_each_sequence_alone(model, kernels, request):
    if kernels == "reference":
        request.getfixturevalue("reference_kernels")
    logits, ids, states = _greedy_together(model, PROMPTS, 6)
    for b, p in enumerate(PROMPTS):
        ref, ref_ids = _greedy_alone(model, p, 6)
        assert ids[b] == ref_ids
        torch.testing.assert_close(logits[b], ref, rtol=1e-4, atol=1e-4)
        assert states[b].n_past == len(p) + 6


def test_a_fresh_sequence_joins_running_ones(model):
    """A state at position 0 (nothing prefilled) beside states deep in their prompts."""
    first = 11
    logits, ids, _ = _greedy_together(model, [PROMPTS[1], None, PROMPTS[0]], 4,
                                      fresh=[None, first, None])
    st = model.new_state(1, 128)
    tok, alone = first, []
    for _ in range(4):
        step = model.decode(torch.tensor([tok]), st)[0]
        alone.append(step)
        tok = int(step.argmax())
    torch.testing.assert_close(logits[1], torch.stack(alone), rtol=1e-4, atol=1e-4)
    ref, ref_ids = _greedy_alone(model, PROMPTS[1], 4)
    assert ids[0] == ref_ids
    torch.testing.assert_close(logits[0], ref, rtol=1e-4, atol=1e-4)


def test_decode_many_checks_its_arguments(model):
    st = model.new_state(1, 4)
    with pytest.raises(OffloadError, match="one single-sequence state per token"):
        model.decode_many(torch.tensor([1, 2]), [st])
    with pytest.raises(OffloadError, match="one single-sequence state per token"):
        model.decode_many(torch.tensor([1, 2]), [model.new_state(2, 4)] * 2)
    model.prefill(torch.tensor([[1, 2, 3, 4]]), st)
    with pytest.raises(OffloadError, match="do not fit the context"):
        model.decode_many(torch.tensor([1]), [st])


@pytest.mark.gpu
def test_decode_many_on_cuda_equals_each_alone(tiny_model):
    """The plain model on a GPU (step kernels, decode matvecs over B rows): greedy ids equal,
    logits within the kernels' float noise."""
    cuda = build_model(open_model(tiny_model), "cuda")
    together, ids, _ = _greedy_together(cuda, PROMPTS, 6)
    for b, p in enumerate(PROMPTS):
        ref, ref_ids = _greedy_alone(cuda, p, 6)
        assert ids[b] == ref_ids
        torch.testing.assert_close(together[b], ref, rtol=1e-3, atol=1e-3)
