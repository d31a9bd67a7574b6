"""Where adapters are: the names loaded in a pipeline (or a model) and the PEFT tuner
layers that carry one."""

from __future__ import annotations

from typing import Any

from torch import nn


def loaded_names(target: object) -> set[str]:
    """Every adapter name loaded in any component of a pipeline, or in a model."""
    if isinstance(target, nn.Module):
        return set(getattr(target, "peft_config", {}))
    listed = getattr(target, "get_list_adapters", None)
    if listed is None:
        return set()
    return {name for names in listed().values() for name in names}


def adapted_layers(pipeline: object, name: str) -> int:
    """How many layers of the pipeline's components carry adapter ``name``."""
    return len(adapter_layers(pipeline, name))


def adapter_layers(
    pipeline: object, name: str, skip_components: frozenset[str] = frozenset()
) -> list[Any]:
    """The PEFT tuner layers carrying adapter ``name`` in the pipeline's components but
    ``skip_components`` (or in a model given instead of a pipeline)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    components = (
        {"model": pipeline}
        if isinstance(pipeline, nn.Module)
        else getattr(pipeline, "components", {})
    )
    return [
        module
        for component_name, component in components.items()
        if isinstance(component, nn.Module) and component_name not in skip_components
        for module in component.modules()
        if isinstance(module, BaseTunerLayer) and name in getattr(module, "lora_A", {})
    ]
