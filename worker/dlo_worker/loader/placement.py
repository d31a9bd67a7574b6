"""Which pipeline components the loader leaves in host memory (pure).

DLO streams the DiTs itself; diffusers' offload modes move components in and out of the
device once loaded, so the loader must not place those on the device first.
"""

from __future__ import annotations

from dlo_worker.config import OffloadPolicy


def stays_on_host(policy: OffloadPolicy, component: str, dit_components: tuple[str, ...]) -> bool:
    """Whether the loader leaves ``component`` in host memory for the offload to move:
    every component under model-level offload, the DiTs under group offloading."""
    if policy == OffloadPolicy.MODEL_CPU_OFFLOAD:
        return True
    return policy == OffloadPolicy.LAYERWISE_OFFLOAD and component in dit_components
