"""Module discovery: which modules of a pipeline are DiTs, and which of their blocks stream.

A per-class registry names the block lists of known DiTs in execution order; an
unknown DiT falls back to its homogeneous ``nn.ModuleList`` children; the
configuration can name the lists explicitly. Everything that is not a streamed
block (embedders, norms, encoders, the VAE) stays on the device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from dlo_worker.errors import UserFixableError

# Block lists per DiT class, nested ones included, in the order the forward pass runs them
# (the schedule learns the real order anyway; this is its first guess).
BLOCK_LISTS_BY_CLASS: dict[str, tuple[str, ...]] = {
    "FluxTransformer2DModel": ("transformer_blocks", "single_transformer_blocks"),
    "HunyuanVideoTransformer3DModel": (
        "context_embedder.token_refiner.refiner_blocks",
        "transformer_blocks",
        "single_transformer_blocks",
    ),
    "ChromaTransformer2DModel": (
        "distilled_guidance_layer.layers",
        "transformer_blocks",
        "single_transformer_blocks",
    ),
    "DiTTransformer2DModel": ("transformer_blocks",),
    "PixArtTransformer2DModel": ("transformer_blocks",),
    "SD3Transformer2DModel": ("transformer_blocks",),
    "SanaTransformer2DModel": ("transformer_blocks",),
    "QwenImageTransformer2DModel": ("transformer_blocks",),
    "CogVideoXTransformer3DModel": ("transformer_blocks",),
    "LTXVideoTransformer3DModel": ("transformer_blocks",),
    "WanTransformer3DModel": ("blocks",),
}

# Text encoders DLO may stream (``text_encoders``): their blocks share the DiTs' slots.
TEXT_ENCODER_BLOCK_LISTS: dict[str, tuple[str, ...]] = {
    "T5EncoderModel": ("encoder.block",),
}

# Submodules inside blocks that the DiT also calls outside the block's forward; they
# stay resident on the device (DiT and Transformer2DModel condition their output
# projection on block 0's timestep/class embedder).
RESIDENT_PATHS_BY_CLASS: dict[str, tuple[str, ...]] = {
    "DiTTransformer2DModel": ("transformer_blocks.0.norm1.emb",),
    "Transformer2DModel": ("transformer_blocks.0.norm1.emb",),
}

# Pipeline attributes that hold DiTs; they share DLO's two device slots.
DIT_ATTRIBUTES = ("transformer", "transformer_2")


_FIX = "name the DiT's block lists with block_paths (--dlo-block-paths, e.g. transformer_blocks)"


class DiscoveryError(ValueError, UserFixableError):
    """No streamable block list could be identified."""


@dataclass(frozen=True)
class DiTPlan:
    """One DiT and its streamed blocks in execution order."""

    name: str
    module: nn.Module
    block_paths: tuple[str, ...]
    blocks: tuple[tuple[str, nn.Module], ...]
    """``(qualified name, block)`` pairs, e.g. ``("transformer_blocks.3", block)``."""
    resident_modules: tuple[nn.Module, ...] = ()
    """Submodules of blocks that never stream (used outside their block's forward)."""


@dataclass(frozen=True)
class OffloadPlan:
    """Every DiT of a pipeline (or a single module) with its block lists."""

    dits: tuple[DiTPlan, ...]

    @property
    def block_count(self) -> int:
        return sum(len(dit.blocks) for dit in self.dits)


def _homogeneous_block_lists(module: nn.Module) -> tuple[str, ...]:
    """Direct non-empty ``nn.ModuleList`` children whose entries share one class and hold
    weights (a list of activations or dropouts has nothing to stream)."""
    paths = []
    for name, child in module.named_children():
        if (
            isinstance(child, nn.ModuleList)
            and len({type(b) for b in child}) == 1
            and _holds_parameters(child)
        ):
            paths.append(name)
    return tuple(paths)


def _holds_parameters(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def block_paths_for(module: nn.Module, override: Sequence[str] | None = None) -> tuple[str, ...]:
    """The block-list attribute paths of a DiT: override, else registry, else fallback."""
    if override:
        return tuple(override)
    registered = BLOCK_LISTS_BY_CLASS.get(type(module).__name__)
    if registered is not None:
        return registered
    fallback = _homogeneous_block_lists(module)
    if not fallback:
        raise DiscoveryError(
            f"{type(module).__name__} has no known block lists and no homogeneous "
            "nn.ModuleList child holding weights; name them with block_paths "
            "(--dlo-block-paths, e.g. transformer_blocks)"
        )
    return fallback


def _plan_dit(name: str, module: nn.Module, override: Sequence[str] | None) -> DiTPlan:
    paths = block_paths_for(module, override)
    registered = not override and type(module).__name__ in BLOCK_LISTS_BY_CLASS
    if registered:
        # A registered nested list is optional (a config may leave it out).
        paths = tuple(path for path in paths if _has_submodule(module, path))
    blocks: list[tuple[str, nn.Module]] = []
    for path in paths:
        try:
            block_list = module.get_submodule(path)
        except AttributeError:
            raise DiscoveryError(
                f"{type(module).__name__} has no module at {path!r} (block paths "
                f"{list(paths)}); {_FIX}"
            ) from None
        if not isinstance(block_list, nn.ModuleList):
            raise DiscoveryError(
                f"{type(module).__name__}.{path} is a {type(block_list).__name__}, "
                f"not an nn.ModuleList of blocks; {_FIX}"
            )
        blocks.extend((f"{path}.{index}", block) for index, block in enumerate(block_list))
    if not any(_holds_parameters(block) for _, block in blocks):
        what = "are empty" if not blocks else "hold no parameters"
        raise DiscoveryError(
            f"{name} ({type(module).__name__}): its block lists {list(paths)} {what}, so DLO "
            "would stream nothing; name the lists that hold the DiT's blocks with block_paths "
            "(--dlo-block-paths), or run without DLO"
        )
    resident = tuple(
        module.get_submodule(path)
        for path in RESIDENT_PATHS_BY_CLASS.get(type(module).__name__, ())
        if _has_submodule(module, path)
    )
    return DiTPlan(
        name=name, module=module, block_paths=paths, blocks=tuple(blocks), resident_modules=resident
    )


def _has_submodule(module: nn.Module, path: str) -> bool:
    try:
        module.get_submodule(path)
    except AttributeError:
        return False
    return True


def dit_modules(model_or_pipeline: object) -> list[tuple[str, nn.Module]]:
    """The DiTs of a pipeline (``transformer``, ``transformer_2``), or the module itself."""
    if isinstance(model_or_pipeline, nn.Module):
        return [("model", model_or_pipeline)]
    dits = [
        (name, module)
        for name in DIT_ATTRIBUTES
        if isinstance(module := getattr(model_or_pipeline, name, None), nn.Module)
    ]
    if not dits:
        raise DiscoveryError(
            f"{type(model_or_pipeline).__name__} has no DiT: expected an nn.Module or a "
            "pipeline with a 'transformer' component"
        )
    return dits


def text_encoder_modules(
    model_or_pipeline: object, names: Sequence[str]
) -> list[tuple[str, nn.Module]]:
    """The pipeline's text encoders ``names``, each a class with registered block lists."""
    found = []
    for name in names:
        module = getattr(model_or_pipeline, name, None)
        if not isinstance(module, nn.Module):
            raise DiscoveryError(
                f"--dlo-stream-text-encoders names {name!r}, which "
                f"{type(model_or_pipeline).__name__} does not have; name one of its text "
                "encoder components (e.g. text_encoder_2)"
            )
        if type(module).__name__ not in TEXT_ENCODER_BLOCK_LISTS:
            raise DiscoveryError(
                f"--dlo-stream-text-encoders names {name!r}, a {type(module).__name__}, whose "
                "blocks DLO does not know how to stream (it streams "
                f"{', '.join(sorted(TEXT_ENCODER_BLOCK_LISTS))}); drop it from the list"
            )
        found.append((name, module))
    return found


def discover(
    model_or_pipeline: object,
    block_paths: Sequence[str] | None = None,
    text_encoders: Sequence[str] = (),
) -> OffloadPlan:
    """Build the :class:`OffloadPlan` of a pipeline or module: its DiTs (``block_paths``
    overrides their lists), then the ``text_encoders`` streamed through the same slots."""
    dits = [_plan_dit(name, module, block_paths) for name, module in dit_modules(model_or_pipeline)]
    encoders = [
        _plan_dit(name, module, TEXT_ENCODER_BLOCK_LISTS[type(module).__name__])
        for name, module in text_encoder_modules(model_or_pipeline, text_encoders)
    ]
    return OffloadPlan(tuple(dits + encoders))
