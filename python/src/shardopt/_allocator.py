"""shardopt's host allocator as PyTorch's CPU allocator (docs/performance.md,
"Allocator")."""

from typing import Dict

from . import _C  # the C++ core (built against this torch)


def install_host_allocator() -> str:
    """Makes shardopt's host allocator PyTorch's CPU allocator in this process.

    CPU tensors of 1 MiB or more then get their own memory mappings, kept when
    freed for the next tensor they fit (best fit, at most twice its size; up
    to 2 GiB kept unused); smaller ones still come from malloc. A training
    loop asks for the same sizes every step, so peak memory stops depending on
    how glibc's heap happened to split (docs/performance.md, "Allocator": it helps
    models with few tensor sizes, and keeps more than glibc where a step's
    phases use many different sizes, as torchvision's resnet101). Call it
    once, early, before the model is built: tensors allocated before keep
    their own allocator. It is process-wide and cannot be undone; idempotent.
    Returns a one-line description for logs.
    """
    return _C.install_host_allocator()


def host_allocator_stats() -> Dict[str, int]:
    """Counters of the allocator install_host_allocator() installed ({} before):
    mapped_bytes, kept_bytes, peak_mapped_bytes, maps (cache misses), reuses,
    reuses_larger (of those, from a larger kept block)."""
    return dict(_C.host_allocator_stats())
