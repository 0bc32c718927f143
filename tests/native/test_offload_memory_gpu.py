"""Memory the offload runtime manages itself: elastic device pools (CUDA virtual memory) and CUDA
views of pinned host memory. Needs CUDA."""
import pytest
import torch

from native import offload_native as on

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def need_cuda():
    if not torch.cuda.is_available() or on._cuda is None:
        pytest.skip("needs a CUDA device and native._cuda")


def _free() -> int:
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


def test_elastic_buffer_grows_and_shrinks_in_place():
    if not on.elastic_supported():
        pytest.skip("this GPU has no virtual memory management")
    buf = on.ElasticBuffer(64 << 20, initial=3 << 20)
    try:
        g = buf.chunk
        assert buf.capacity >= 64 << 20 and buf.capacity % g == 0
        assert buf.mapped == -(-(3 << 20) // g) * g
        addr = buf.view.data_ptr()
        n0 = buf.mapped
        pattern = torch.randint(0, 256, (n0,), dtype=torch.uint8, device="cuda",
                                generator=torch.Generator(device="cuda").manual_seed(0))
        buf.view[:n0].copy_(pattern)

        free0 = _free()
        assert buf.resize(40 << 20) >= 40 << 20
        assert _free() <= free0 - (buf.mapped - n0) + (2 << 20)   # the memory is really taken
        assert buf.view.data_ptr() == addr                        # ... behind the same address
        assert torch.equal(buf.view[:n0], pattern)                # ... keeping what was there
        buf.view[n0:buf.mapped].fill_(7)                          # and the new part is usable
        assert int(buf.view[buf.mapped - 1]) == 7

        big = buf.mapped
        free1 = _free()
        assert buf.resize(n0) == n0
        assert _free() >= free1 + (big - n0) - (2 << 20)          # given back to the device
        assert torch.equal(buf.view[:n0], pattern)
        assert buf.resize(0) == g                                 # one chunk stays mapped
        assert buf.resize(10 ** 12) == buf.capacity
    finally:
        buf.close()
    buf.close()   # twice is harmless


def test_host_view_reads_pinned_host_memory_from_kernels():
    host = torch.arange(4096 * 8, dtype=torch.int32).view(torch.uint8).view(4096, 32).clone()
    on.pin_host(host)
    try:
        dev = on.host_view(host)
        assert dev.is_cuda and dev.shape == host.shape and dev.data_ptr() == host.data_ptr()
        rows = torch.tensor([5, 4095, 0, 5], device="cuda")
        assert torch.equal(dev[rows].cpu(), host[rows.cpu()])    # gathered over PCIe
        del dev
        torch.cuda.synchronize()
    finally:
        on.unpin_host(host)
