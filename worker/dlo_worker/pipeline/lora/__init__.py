"""``--lora``: LoRA adapters loaded into the pipeline at start and applied to every image.

Loaded with diffusers' own loader (``load_lora_weights``, which converts Kohya and other
community formats) after DLO is enabled: the adapters then live on the device beside the
streamed weights (:mod:`dlo_worker.offload.adapters`), so they add no host-to-device
bytes. Every adapter given is active, at its scale (``set_adapters``).

``--fuse-lora`` adapters are instead fused into the weights as they are loaded, before DLO
packs them (:func:`fusion`): into the DiT's private host copy, never a shared checkpoint
mapping, and into a runtime-cache entry only under an identity that holds them.

An adapter that would not do what it says is refused at start, naming the flag's value
and the reason: a missing, truncated or corrupt file, a pipeline without a LoRA loader,
an adapter none of whose layers the pipeline has (one for another model), and one some
of whose layers it lacks (diffusers only warns of these "unexpected keys" and would run
the rest of the adapter); one whose matrices do not match the layers they name (diffusers
would widen the layers to them), in any format diffusers converts; one whose rank, in any
format, exceeds ``--max-lora-rank``. These are checked on the pipeline's meta skeleton
before any weight is read, and again before each load.

Modules: :mod:`.files` (what a file says before it loads: existence, bytes, digest),
:mod:`.fit` (whether an adapter fits the model), :mod:`.loading` (load, unload, fuse),
:mod:`.selection` (the adapters and scales of the next run), :mod:`.layers` (where
adapters are), :mod:`.errors`.
"""

from dlo_worker.pipeline.lora.errors import LoraSetupError
from dlo_worker.pipeline.lora.files import (
    check_files,
    device_bytes,
    fusion_identity,
    weights_file,
)
from dlo_worker.pipeline.lora.fit import check_adapters
from dlo_worker.pipeline.lora.layers import adapted_layers
from dlo_worker.pipeline.lora.loading import (
    fuse_adapters,
    fusion,
    load_adapter,
    load_adapters,
    unload_adapter,
)
from dlo_worker.pipeline.lora.selection import AdapterSelection, select_adapters, selection

__all__ = [
    "AdapterSelection",
    "LoraSetupError",
    "adapted_layers",
    "check_adapters",
    "check_files",
    "device_bytes",
    "fuse_adapters",
    "fusion",
    "fusion_identity",
    "load_adapter",
    "load_adapters",
    "select_adapters",
    "selection",
    "unload_adapter",
    "weights_file",
]
