"""SGLang's --mem-fraction-static as a KV pool size.

SGLang gives the model's weights and its KV pool together this fraction of the GPU's
memory. zpd computes, once per worker after its weights are loaded:

    KV pool MiB = fraction x total memory of the worker's device
                  - bytes of the model's parameters and buffers as loaded

where total memory is the GPU's (torch.cuda.mem_get_info) on cuda, and on cpu the
host's RAM (the cgroup's memory.max where that is lower). Workers sharing a device
(`zpd launch` on one host) each take the fraction: give each 1/N of it. Activation
scratch and packed weight copies made later are not counted, as SGLang leaves the
rest (1 - fraction) for them."""
from __future__ import annotations

import os
from pathlib import Path

import torch

from engines.config import ModelError

MIB = 2 ** 20
CGROUP_MEMORY_MAX = Path("/sys/fs/cgroup/memory.max")


def kv_cache_mb(fraction: float | None, kv_cache_mb: float, net: torch.nn.Module,
                device: torch.device) -> float:
    """The KV pool size a worker allocates: `kv_cache_mb` without a fraction."""
    if fraction is None:
        return kv_cache_mb
    total, weights = device_memory(device), model_bytes(net)
    budget = fraction * total - weights
    if budget < MIB:
        raise ModelError(f"--mem-fraction-static {fraction}: {fraction} x {total / MIB:.0f} MiB "
                         f"of {device} leaves no room for KV after {weights / MIB:.0f} MiB of "
                         "weights")
    return budget / MIB


def model_bytes(net: torch.nn.Module) -> int:
    """Memory the loaded model holds: its parameters and buffers (rotary tables)."""
    tensors = list(net.parameters()) + list(net.buffers())
    seen, total = set(), 0
    for t in tensors:
        if t.data_ptr() not in seen:            # tied embeddings are one tensor
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


def device_memory(device: torch.device) -> int:
    """Total bytes of the device's memory (for cpu: RAM, within the cgroup's limit)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[1]
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return min(ram, cgroup_limit() or ram)


def cgroup_limit() -> int | None:
    try:
        text = CGROUP_MEMORY_MAX.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None         # "max": no limit
