"""moe_offload.state: an elastic KV cache maps memory behind the positions in use, keeps its
addresses, zeroes what it maps, and gives memory back when emptied (a fake elastic buffer stands
in for offload_native.ElasticBuffer, which needs CUDA: test_runtime_gpu covers the real one)."""
import pytest
import torch

from loaders import open_model
from moe_offload.errors import OffloadError
from moe_offload.state import State


class FakeElastic:
    """ElasticBuffer's interface over host memory: `capacity` bytes, mapped in `chunk`s."""

    chunk = 4096

    def __init__(self, capacity: int):
        self.capacity = -(-capacity // self.chunk) * self.chunk
        self.view = torch.full((self.capacity,), 0xAB, dtype=torch.uint8)  # "garbage"
        self.mapped = self.chunk
        self.closed = False

    def resize(self, nbytes: int) -> int:
        self.mapped = min(self.capacity, max(1, -(-nbytes // self.chunk)) * self.chunk)
        return self.mapped

    def close(self) -> None:
        self.closed = True


@pytest.fixture(scope="module")
def config(tiny_model):
    return open_model(tiny_model).config


def test_elastic_kv_maps_what_the_context_uses(config):
    bufs = []

    def alloc(n):
        bufs.append(FakeElastic(n))
        return bufs[-1]

    n_ctx = 1024
    st = State(config, 1, n_ctx, "cpu", torch.float16, kv_alloc=alloc)
    fixed = State(config, 1, n_ctx, "cpu", torch.float16)
    row = config.n_head_kv * config.head_dim * 2
    assert len(bufs) == 2 * len(config.attention_layers) and st.elastic_kv
    assert st.nbytes == fixed.nbytes   # the whole context's bytes, mapped or not
    assert st.kv_rows == FakeElastic.chunk // row and st.kv_mapped == len(bufs) * FakeElastic.chunk
    for t in (*st.k.values(), *st.v.values()):   # what is mapped starts zeroed
        assert t.view(-1)[:st.kv_rows * row // 2].eq(0).all()
    k0 = st.k[config.attention_layers[0]]
    addr = k0.data_ptr()
    rows = 3 * FakeElastic.chunk // row + 5
    assert st.kv_bytes(rows) == len(bufs) * 4 * FakeElastic.chunk
    st.map_kv(rows)
    assert st.kv_rows >= rows and st.kv_mapped == st.kv_bytes(rows)
    assert k0.data_ptr() == addr and k0.view(-1)[:rows * row // 2].eq(0).all()   # grown: zeroed
    st.map_kv(10 * n_ctx)                        # never beyond the context
    assert st.kv_rows == n_ctx
    st.map_kv(1)                                 # an emptied conversation: one chunk stays
    assert st.kv_mapped == len(bufs) * FakeElastic.chunk
    st.close()
    assert all(b.closed for b in bufs) and not st.elastic_kv and st.kv_rows == n_ctx


def test_elastic_kv_holds_one_sequence(config):
    with pytest.raises(OffloadError, match="batch 1"):
        State(config, 2, 64, "cpu", torch.float16, kv_alloc=FakeElastic)


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_cpu_kv_takes_memory_only_as_positions_are_written(tiny_model):
    """A large --ctx on the CPU reserves address space; pages come as the conversation grows."""
    c = open_model(tiny_model).config
    before = _resident_bytes()
    st = State(c, 1, 1_000_000, "cpu")
    kv = sum(t.nbytes for t in (*st.k.values(), *st.v.values()))
    assert kv >= 500 << 20
    assert _resident_bytes() - before < kv // 10
    layer = c.attention_layers[0]
    assert float(st.k[layer][0, 999_999].abs().sum()) == 0.0    # reads as zeros
    st.k[layer][0, :1000] = 1.0
    assert _resident_bytes() - before < kv // 10


def test_a_kv_cache_too_large_for_the_device_is_one_error_with_numbers(tiny_model):
    c = open_model(tiny_model).config
    with pytest.raises(OffloadError, match=r"KV cache at 1,000,000,000,000 positions .* GiB.*lower --ctx"):
        State(c, 1, 10**12, "cpu")


def test_recurrent_nbytes_is_one_snapshot(config):
    """What a snapshot (or a kept verify step) of the delta-net state costs: every recurrent
    layer's conv window and S matrix, float32, for each sequence of the batch."""
    st = State(config, 2, 64)
    c = config
    per_layer = (c.ssm_conv_dim * (c.ssm_d_conv - 1)
                 + c.ssm_n_v_heads * c.ssm_d_state * c.ssm_head_v_dim) * 4
    assert st.recurrent_nbytes == 2 * per_layer * len(c.recurrent_layers)
    snap = st.snapshot()
    assert st.recurrent_nbytes == sum(t.numel() * 4 for d in (snap.conv, snap.ssm)
                                      for t in d.values())


def test_a_states_row_holds_its_buffers_addresses_and_its_position(config):
    """State.row (what a StateTable stacks): the address of every attention layer's K and V and
    every delta-net layer's conv and ssm state, at the columns table_columns names, then the
    position, which moves with pos (a view of the row), through advance, rewind and restore."""
    from moe_offload.state import StateTable, table_columns
    st = State(config, 1, 64)
    cols = table_columns(config)
    assert st.row.shape == (len(cols) + 1,) and sorted(cols.values()) == list(range(len(cols)))
    for (name, layer), col in cols.items():
        assert name in (("conv", "ssm") if config.recurrent[layer] else ("k", "v"))
        assert int(st.row[col]) == getattr(st, name)[layer].data_ptr()
    snap = st.snapshot()
    st.advance(5)
    assert int(st.row[-1]) == 5 == int(st.pos)
    st.restore(snap)
    assert int(st.row[-1]) == 0
    other = State(config, 1, 64)
    other.advance(3)
    rows = StateTable.stack([st, other])
    assert rows.shape == (2, len(cols) + 1) and rows[:, -1].tolist() == [0, 3]
    assert int(rows[1, cols["k", config.attention_layers[0]]]) == \
        other.k[config.attention_layers[0]].data_ptr()
