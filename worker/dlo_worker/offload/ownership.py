"""Which DiTs a backend may take (pure checks on the modules, no state of its own).

A DiT is refused when another backend streams it, when another offload strategy's hooks
manage it (diffusers' group offloading, accelerate's), or when a streamed parameter is
tied to a parameter elsewhere: streaming it would leave the other user reading a
placeholder. Each DiT a backend streams carries the backend in :data:`MARK` (as diffusers
marks modules with hooks) until the backend lets it go.
"""

from __future__ import annotations

from torch import nn

from dlo_worker.offload.errors import OffloadSetupError
from dlo_worker.offload.params import modules_of, walk_except
from dlo_worker.offload.plan import OffloadPlan

MARK = "_dlo_backend"
"""Attribute set on every DiT a backend streams."""
FOREIGN_HOOKS = {
    "_diffusers_hook": "diffusers hooks (group offloading, layerwise casting, caching)",
    "_hf_hook": "accelerate hooks (enable_model_cpu_offload, device_map)",
}
CONTEXT_PARALLEL_HOOK_PREFIXES = ("cp_input---", "cp_output---")
"""diffusers' context-parallel hooks (sequence parallelism) split and gather activations
and never touch weights, so DLO streams a DiT that carries them."""


def _only_context_parallel(hooks: object) -> bool:
    names = getattr(hooks, "hooks", None)
    return isinstance(names, dict) and all(
        name.startswith(CONTEXT_PARALLEL_HOOK_PREFIXES) for name in names
    )


def check_not_taken(plan: OffloadPlan, owner: object) -> None:
    """Refuse a DiT another backend streams, or that carries foreign offload hooks."""
    for dit in plan.dits:
        marked = getattr(dit.module, MARK, None)
        if marked is not None and marked is not owner:
            raise OffloadSetupError(
                f"{dit.name} ({type(dit.module).__name__}) is already streamed by another "
                "DLO backend; call its disable() first (and load the model again)"
            )
        for module_name, module in dit.module.named_modules():
            for attribute, what in FOREIGN_HOOKS.items():
                hooks = getattr(module, attribute, None)
                if hooks is not None and not _only_context_parallel(hooks):
                    where = f"{dit.name}.{module_name}".rstrip(".")
                    raise OffloadSetupError(
                        f"{where} carries {what}; DLO cannot stream a DiT another offload "
                        "strategy manages: remove those hooks (or load the pipeline "
                        "without them) before enabling DLO"
                    )


def mark(module: nn.Module, owner: object) -> None:
    setattr(module, MARK, owner)


def unmark(module: nn.Module, owner: object) -> None:
    if getattr(module, MARK, None) is owner:
        delattr(module, MARK)


def check_parameters_are_not_shared(
    model_or_pipeline: object,
    streamed: list[tuple[str, nn.Module]],
    resident_parameter_ids: set[int],
) -> None:
    """Refuse a streamed parameter used by two blocks, or also outside the streamed blocks."""
    owners: dict[int, str] = {}
    for name, block in streamed:
        for parameter in block.parameters():
            if id(parameter) in resident_parameter_ids:
                continue
            if id(parameter) in owners and owners[id(parameter)] != name:
                raise OffloadSetupError(
                    f"a parameter is shared by {owners[id(parameter)]} and {name}; "
                    "tied weights cannot be streamed"
                )
            owners[id(parameter)] = name
    streamed_ids = {id(block) for _, block in streamed}
    for module in modules_of(model_or_pipeline):
        for submodule in walk_except(module, streamed_ids):
            for parameter in submodule.parameters(recurse=False):
                if id(parameter) in owners:
                    raise OffloadSetupError(
                        f"a parameter of {owners[id(parameter)]} is also used outside the "
                        "streamed blocks; tied weights cannot be streamed"
                    )
