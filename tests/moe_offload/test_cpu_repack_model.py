"""The experts the CPU computes, in its repacked form (IQ3_S -> IQ3_S_N4): the CPU-only model and
the offload runtime's host banks give the same bits with it as without."""
from __future__ import annotations

import pytest
import torch

from loaders import open_model
from native import ops

pytestmark = pytest.mark.skipif(ops._cpu is None, reason="native._cpu is not built")


@pytest.fixture(scope="module")
def iq3s(synth_model):
    # layer 1's up projection in a type with no repacked form: banks of mixed forms
    return open_model(synth_model(type="Q4_K", expert_type="IQ3_S", down_type="IQ3_S",
                                  tensor_types=(("blk\\.1\\.ffn_up_exps", "Q4_K"),
                                                ("blk\\.0\\.(attn_qkv|ssm_out)", "IQ3_S"))))


def test_the_cpu_model_decodes_the_same_with_repacked_experts(iq3s):
    from moe_offload.models import build_model
    toks = torch.tensor([[3, 141, 59, 26, 5, 35, 89, 79]])
    logits = {}
    for mode in ("off", "on"):
        m = build_model(iq3s, "cpu", cpu_repack=mode)
        names = {q.qtype.name for ex in m.experts for q in (ex.gate, ex.up, ex.down)}
        assert names == ({"IQ3_S", "Q4_K"} if mode == "off" else {"IQ3_S_N4", "Q4_K"})
        # the dense projections and the head too (the file's are Q4_K; one is IQ3_S)
        assert m.blk[0]["attn_qkv.weight" if "attn_qkv.weight" in m.blk[0] else "ssm_out.weight"].qtype.name \
            == ("IQ3_S" if mode == "off" else "IQ3_S_N4")
        st = m.new_state(1, 64)
        out = [m.prefill(toks, st)]
        for _ in range(5):
            out.append(m.decode(out[-1].argmax(-1), st))
        logits[mode] = torch.cat([o.reshape(-1) for o in out])
    assert torch.equal(logits["on"], logits["off"])


def test_host_banks_give_the_cpu_a_repacked_copy_with_the_same_products(iq3s):
    from moe_offload.offload.host_bank import HostExpertBank
    from native import offload_native as on
    c = iq3s.config
    bank = HostExpertBank(iq3s, pin=False, threads=2)
    plain = [bank.cpu_bank_args(L) for L in range(c.n_layer)]
    assert not bank.repack_for_cpu("off") and bank.cpu_banks is None
    with pytest.raises(Exception, match="auto, on or off"):
        bank.repack_for_cpu("sometimes")
    assert bank.repack_for_cpu("on")
    lay = bank.cpu_layouts[1]
    assert (lay.gate.qtype.name, lay.up.qtype.name, lay.down.qtype.name) == ("IQ3_S_N4", "Q4_K", "IQ3_S_N4")
    assert lay.expert_bytes % 256 == 0
    g = torch.Generator().manual_seed(0)
    K = c.n_expert_used
    for L in range(c.n_layer):
        x = torch.randn(2, c.n_embd, generator=g)
        ids = torch.stack([torch.randperm(c.n_expert, generator=g)[:K] for _ in range(2)]).to(torch.int32)
        w = torch.rand(2, K, generator=g)
        y0, y1 = torch.empty_like(x), torch.empty_like(x)
        on.host_moe_ffn(x, ids, w, plain[L], c.n_expert, y0, ff=c.n_ff_exp)
        on.host_moe_ffn(x, ids, w, bank.cpu_bank_args(L), c.n_expert, y1, ff=c.n_ff_exp)
        assert torch.equal(y0, y1), L
    bank.close()
    assert bank.cpu_banks is None


def test_auto_keeps_the_files_form_where_host_ram_is_short(iq3s, monkeypatch):
    """auto repacks only where host RAM keeps room beside the copy; on repacks regardless."""
    from moe_offload import memory
    from moe_offload.offload.host_bank import HostExpertBank
    from moe_offload.models import build_model
    monkeypatch.setattr(memory, "host_ram_available", lambda: 1 << 30)
    m = build_model(iq3s, "cpu", cpu_repack="auto")
    assert m.experts[0].gate.qtype.name == "IQ3_S"
    assert build_model(iq3s, "cpu", cpu_repack="on").experts[0].gate.qtype.name == "IQ3_S_N4"
    bank = HostExpertBank(iq3s, pin=False, threads=1)
    assert not bank.repack_for_cpu("auto") and bank.cpu_banks is None
    assert bank.repack_for_cpu("on") and bank.cpu_banks is not None
    with pytest.raises(ValueError, match="auto, on or off"):
        build_model(iq3s, "cpu", cpu_repack="always")
