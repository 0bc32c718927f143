"""Dev measurement on a GPU: how fast experts cross PCIe from host banks allocated three ways, by
the fetch kernel (the decode path) and by the copy engine (cudaMemcpyAsync per expert).

  pageable+pin   torch.empty, then cudaHostRegister (the host bank before 2 MiB pages)
  hugepage+pin   anonymous mmap advised MADV_HUGEPAGE (2 MiB pages: fewer IOMMU translations)
  hostalloc      cudaHostAlloc (torch pin_memory=True)

usage: link_probe.py [--experts N] [--expert-bytes B]"""
import argparse
import mmap
import sys
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experts", type=int, default=1024)
    ap.add_argument("--expert-bytes", type=int, default=1351680)   # one IQ3_S expert of the 35B
    args = ap.parse_args()
    import numpy as np
    import torch
    from native import offload_native as on
    N, eb = args.experts, args.expert_bytes
    dev = torch.device("cuda")
    print(open("/sys/kernel/mm/transparent_hugepage/enabled").read().strip())

    def anon_huge() -> torch.Tensor:
        size = N * eb + (2 << 20)
        mm = anon_huge.keep = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        mm.madvise(mmap.MADV_HUGEPAGE)
        t = torch.frombuffer(mm, dtype=torch.uint8)
        skip = (-t.data_ptr()) % (2 << 20)
        return t[skip:skip + N * eb].view(N, eb)

    def huge_kb() -> int:
        for line in open("/proc/meminfo"):
            if line.startswith("AnonHugePages"):
                return int(line.split()[1])
        return -1

    pool = torch.empty((64, eb), dtype=torch.uint8, device=dev)
    rng = np.random.default_rng(0)

    def fetch_rate(bank, n: int, blocks: int, reps: int = 40) -> float:
        lists = []
        for _ in range(reps):
            fl = torch.zeros(1 + 2 * 64, dtype=torch.int32)
            fl[0] = n
            fl[1:1 + 2 * n:2] = torch.from_numpy(rng.choice(N, n, replace=False).astype(np.int32))
            fl[2:2 + 2 * n:2] = torch.arange(n)
            lists.append(fl.to(dev))
        on.fetch(lists[0], bank, pool, 64, blocks)
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for fl in lists:
            on.fetch(fl, bank, pool, 64, blocks)
        b.record()
        b.synchronize()
        return reps * n * eb / (a.elapsed_time(b) / 1e3) / 1e9

    def dma_rate(bank, n: int, reps: int = 40) -> float:
        picks = [rng.choice(N, n, replace=False) for _ in range(reps)]
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for p in picks:
            for j, e in enumerate(p):
                pool[j].copy_(bank[int(e)], non_blocking=True)
        b.record()
        b.synchronize()
        return reps * n * eb / (a.elapsed_time(b) / 1e3) / 1e9

    for name in ("pageable+pin", "hugepage+pin", "hostalloc"):
        h0 = huge_kb()
        t = time.perf_counter()
        if name == "pageable+pin":
            bank = torch.empty((N, eb), dtype=torch.uint8)
        elif name == "hugepage+pin":
            bank = anon_huge()
        else:
            bank = torch.empty((N, eb), dtype=torch.uint8, pin_memory=True)
        bank.fill_(1)
        t_fill = time.perf_counter() - t
        t = time.perf_counter()
        if name != "hostalloc":
            on.pin_host(bank)
        t_pin = time.perf_counter() - t
        row = [f"{name:13s} fill {t_fill:.2f}s pin {t_pin:.2f}s hugepages +{(huge_kb() - h0) >> 10} MiB |"]
        for n in (2, 4, 8, 32):
            row.append(f"n{n}: " + "/".join(f"{fetch_rate(bank, n, b):.1f}" for b in (16, 32, 64))
                       + f" dma {dma_rate(bank, n):.1f}")
        print(" ".join(row) + "  (GB/s; fetch kernel 16/32/64 blocks, copy engine)", flush=True)
        if name != "hostalloc":
            on.unpin_host(bank)
        del bank
    return 0


if __name__ == "__main__":
    sys.exit(main())
