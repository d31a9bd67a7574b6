"""LoRA adapters on streamed blocks: they live on the device beside the streamed weights.

diffusers loads LoRA adapters with PEFT, which wraps each targeted layer of a block
(``to_q``, ...) in a tuner layer holding the original layer (``base_layer``) and the
adapters' small matrices (``lora_A``, ``lora_B``). DLO streams the base layers' weights
and never the adapters': their parameters stay on the device for as long as DLO is
enabled, so loading, switching or scaling adapters adds no host-to-device bytes and
leaves the host weights (possibly shared read-only mappings) untouched.

- Adapters loaded before DLO is enabled are left out of every streamed block's layout
  and moved to the device with the rest of the model.
- Adapters loaded after it are created where PEFT creates them, beside their base
  layer's weight: a streamed weight's placeholder is on the device and has its shape
  (:mod:`~dlo_worker.offload.block`), so they land on the device too.
- Fusing an adapter writes it into the base weights, which DLO repoints into a slot at
  every run and whose host copy may be a shared mapping: ``fuse_lora`` and
  ``unfuse_lora`` on a streamed DiT, and so a pipeline's ``fuse_lora``, raise
  :class:`AdapterFusingError` at the call instead of leaving a model that would run
  without the adapter. (A pipeline's ``unfuse_lora`` unmerges layer by layer, which has
  nothing to undo when nothing could be fused.)
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, NoReturn

from torch import nn

from dlo_worker.offload.errors import AdapterFusingError

FUSING_METHODS = ("fuse_lora", "unfuse_lora")
"""The DiT methods (diffusers' ``PeftAdapterMixin``) that write adapters into weights;
a pipeline's ``fuse_lora`` and ``unfuse_lora`` call them on each component."""


def adapter_parameters(block: nn.Module) -> list[nn.Parameter]:
    """The parameters of the PEFT adapters inside ``block`` (none without PEFT)."""
    try:
        from peft.tuners.tuners_utils import BaseTunerLayer
    except ImportError:
        return []
    parameters: list[nn.Parameter] = []
    for module in block.modules():
        if isinstance(module, BaseTunerLayer):
            for container_name in module.adapter_layer_names:
                container = getattr(module, container_name, None)
                if isinstance(container, nn.Module):
                    parameters.extend(container.parameters())
    return parameters


def _refuse_fusing(name: str) -> Any:
    def refuse(*_args: object, **_kwargs: object) -> NoReturn:
        raise AdapterFusingError(
            f"{name}() on a DiT whose blocks DLO streams: fusing would write the adapter "
            "into weights DLO repoints at every run (and whose host copy may be a shared "
            "mapping); keep the adapter unfused (set_adapters chooses it and its scale, at "
            "no extra transfer), or fuse it before enabling DLO"
        )

    return refuse


def refuse_fusing(dits: Iterable[nn.Module]) -> None:
    """Make ``fuse_lora``/``unfuse_lora`` of each DiT raise (instance attributes shadow the
    methods, for these DiTs only)."""
    for dit in dits:
        for name in FUSING_METHODS:
            object.__setattr__(dit, name, _refuse_fusing(name))


def allow_fusing(dits: Iterable[nn.Module]) -> None:
    """Give each DiT its own ``fuse_lora``/``unfuse_lora`` back."""
    for dit in dits:
        for name in FUSING_METHODS:
            dit.__dict__.pop(name, None)
