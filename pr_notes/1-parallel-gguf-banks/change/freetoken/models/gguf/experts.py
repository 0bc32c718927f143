# Fragment merged into freetoken/models/gguf/experts.py by `ftpatch pr-notes build 1`: the
# definitions below replace FreeToken's of the same name or are added; imports are added.
import os
from concurrent.futures import ThreadPoolExecutor, as_completed

import torch

# a fill job copies whole experts of one layer, about this many bytes: big enough that the hand-off
# to a thread costs nothing, small enough that the last layers do not leave threads idle
_FILL_JOB_BYTES = 32 << 20


def gguf_load_workers() -> int:
    """Threads that fill GGUF expert banks: ``FREETOKEN_GGUF_LOAD_WORKERS``, else min(8, CPUs)."""
    value = os.environ.get("FREETOKEN_GGUF_LOAD_WORKERS", "").strip()
    return max(1, int(value)) if value else min(8, os.cpu_count() or 1)


def _fill_jobs(layer: int, parts: list[torch.Tensor], down: torch.Tensor, banks: dict[str, torch.Tensor]) -> list[tuple]:
    """(layer, [(bank view, file view)]) jobs covering every expert of one layer."""
    experts = down.shape[0]
    per_expert = sum(t[0].numel() * t.element_size() for t in (*parts, down))
    step = max(1, _FILL_JOB_BYTES // max(1, per_expert))
    jobs = []
    for e0 in range(0, experts, step):
        e1 = min(experts, e0 + step)
        copies, col = [], 0
        for part in parts:
            copies.append((banks["gate_up"][e0:e1, col : col + part.shape[1]], part[e0:e1]))
            col += part.shape[1]
        copies.append((banks["down"][e0:e1], down[e0:e1]))
        jobs.append((layer, copies))
    return jobs


def _run_fill_job(job: tuple) -> int:
    layer, copies = job
    for dst, src in copies:
        dst.copy_(src)
    return layer


def load_gguf_expert_banks(model_path: str, num_layers: int, *, first_layer: int = 0, dummy: bool = False, device: torch.device | None = None, workers: int | None = None):
    """``ExpertBanks`` with one bank per (layer, role): pinned host banks for the offload cache, or resident banks on ``device``.

    Every layer's banks are allocated first; ``workers`` threads (default :func:`gguf_load_workers`) then copy the experts from the memory-mapped file, and a layer is pinned as soon as its last copy lands.
    One reader thread leaves a disk's queue and the memory bus mostly idle: the copies overlap page faults on the file with copies of pages already read."""
    from freetoken.moe.expert_banks import ExpertBanks
    from freetoken.moe.host_banks import HostBank, PinPipeline

    index = gguf_tensor_index(model_path)
    scaled = has_expert_scales({name: info.ggml_type for name, info in index.items()})
    roles = ("gate_up", "down", "global") if scaled else ("gate_up", "down")
    sources: dict[str, list[torch.Tensor]] = {role: [] for role in roles}
    tails: dict[str, list[int]] = {role: [] for role in roles}
    tags, hosts, files, jobs = [], [], [], []
    for layer in range(num_layers):
        blk = f"blk.{first_layer + layer}"
        down = index[f"{blk}.ffn_down_exps.weight"]
        fused = index.get(f"{blk}.ffn_gate_up_exps.weight")
        parts = [fused] if fused is not None else [index[f"{blk}.ffn_gate_exps.weight"], index[f"{blk}.ffn_up_exps.weight"]]
        gate = parts[0]
        if any(p.ggml_type != gate.ggml_type for p in parts):
            raise NotImplementedError(f"{blk}: gate and up experts have different ggml types")
        tags.append(("ggml", type_name(gate.ggml_type), type_name(down.ggml_type)))
        tails["gate_up"].append(mmq_tail_bytes(gate.ggml_type, gate.ne[0]))
        tails["down"].append(mmq_tail_bytes(down.ggml_type, down.ne[0]))
        if scaled:
            tails["global"].append(0)
        part_rows = [_expert_rows(p) for p in parts]
        down_rows = _expert_rows(down)
        experts, width = part_rows[0].shape[0], part_rows[0].shape[2]
        gate_up_shape = (experts, sum(r.shape[1] for r in part_rows), width)
        if device is None:
            host = {"gate_up": HostBank(gate_up_shape, part_rows[0].dtype), "down": HostBank(tuple(down_rows.shape), down_rows.dtype)}
            if scaled:
                host["global"] = HostBank((experts, 4), torch.float32)
            banks = {role: bank.tensor for role, bank in host.items()}
        else:
            host = None
            banks = {
                "gate_up": _device_bank(gate_up_shape, gate.ggml_type, gate.ne[0], part_rows[0].dtype, device),
                "down": _device_bank(tuple(down_rows.shape), down.ggml_type, down.ne[0], down_rows.dtype, device),
            }
            if scaled:
                banks["global"] = torch.empty(experts, 4, dtype=torch.float32, device=device)
        if scaled:
            banks["global"].copy_(_expert_scales(parts, down, experts))
        if dummy:
            banks["gate_up"].zero_()
            banks["down"].zero_()
        else:
            jobs += _fill_jobs(layer, part_rows, down_rows, banks)
        hosts.append(host)
        files.append((*parts, down))
        for role, bank in banks.items():
            sources[role].append(bank)

    pending = [0] * num_layers
    for layer, _ in jobs:
        pending[layer] += 1
    threads = workers or gguf_load_workers()
    with PinPipeline() if device is None else contextlib.nullcontext() as pins:
        # a dummy load has no copies: its layers are complete already
        for layer in (l for l in range(num_layers) if pending[l] == 0 and device is None):
            pins(layer, hosts[layer])
        with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="gguf-banks") as pool:
            for done in as_completed([pool.submit(_run_fill_job, job) for job in jobs]):
                layer = done.result()
                pending[layer] -= 1
                if pending[layer]:
                    continue
                for info in files[layer]:
                    _drop_page_cache(info)
                if device is None:
                    pins(layer, hosts[layer])
    where = "in host RAM" if device is None else f"on {device}"
    gib = sum(t.numel() * t.element_size() for ts in sources.values() for t in ts) / 2**30
    logger.info_rank0(f"GGUF expert banks: {gib:.1f} GiB of {num_layers} layers {where}, filled by {threads} threads")
    return ExpertBanks("gguf_scaled" if scaled else "gguf", sources, kind=QuantKind.GGUF, kernel="ggml", layout=None, layer_tags=tags, row_tail_bytes=tails)
