"""Every rule that combines options: what the design refuses (:func:`combination_errors`,
checked when a configuration is built) and what this release cannot execute although the
options are valid (:func:`execution_errors`). Each message names the flags and the fix."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dlo_worker.config.effective import dlo_sharding_group
from dlo_worker.config.flags import NEGATIVE_FLAGS, flag_for
from dlo_worker.config.values import CompileMode, OffloadPolicy, Quantization, SkipLoad, Staging

if TYPE_CHECKING:
    from dlo_worker.config.schema import OffloadOptions, ParallelOptions, WorkerConfig


def combination_errors(config: WorkerConfig) -> list[str]:
    """Every violated compatibility rule, each naming the options involved and the fix."""
    parallel, offload, quantization = config.parallel, config.offload, config.model.quantization
    errors = (
        _hsdp_errors(parallel)
        + _compile_errors(config)
        + _lora_errors(config)
        + _device_budget_errors(offload)
    )
    if not offload.enable_distributed_layerwise_offload:
        errors += _dlo_options_without_dlo(offload)
        if offload.enable_cpu_offload and offload.enable_layerwise_offload:
            errors.append(
                "--enable-cpu-offload and --enable-layerwise-offload are alternatives; "
                "choose one (or use --enable-distributed-layerwise-offload)"
            )
        return errors

    if offload.dlo_use_allgather:
        errors += _allgather_errors(config)
    _, sharding_size = dlo_sharding_group(parallel, offload.dlo_use_allgather)
    if sharding_size == 1 and (
        offload.dlo_allgather_shard_buffers
        != type(offload).model_fields["dlo_allgather_shard_buffers"].default
    ):
        errors.append(
            "--dlo-allgather-shard-buffers applies only to DLO AllGather over a DP or SP "
            "group of more than one rank (rank-local DLO copies whole blocks into its two "
            "slots); drop it, or use --dlo-use-allgather with --data-parallel-size or "
            "--sequence-parallel-size > 1"
        )
    if offload.dlo_staging == Staging.BUFFERS and offload.dlo_staging_chunk_mib is not None:
        errors.append(
            "--dlo-staging-chunk-mib sizes the staging ring's chunks, but --dlo-staging buffers "
            "packs block-sized buffers; drop one of them"
        )
    if offload.dlo_resident_layers > 0 and offload.dlo_gpu_memory_budget_gib is not None:
        errors.append(
            "--dlo-resident-layers and --dlo-gpu-memory-budget-gib both choose the resident "
            "blocks; set one of them"
        )
    errors += _rank_local_only_errors(offload, sharding_size)
    if offload.dlo_enable_runtime_cache:
        if quantization not in (Quantization.NONE, Quantization.FP8):
            errors.append(
                f"--dlo-enable-runtime-cache rejects --quantization {quantization}: cache "
                "entries hold plain tensors (bf16, or per-tensor FP8 with --quantization "
                "fp8); use --quantization fp8 or none, or drop the runtime cache"
            )
        if parallel.use_hsdp:
            errors.append(
                "--dlo-enable-runtime-cache rejects --use-hsdp: HSDP/DTensor layouts cannot "
                "be cached; drop one of them"
            )
    if offload.dlo_runtime_cache_skip_load != SkipLoad.PREFERRED and not (
        offload.dlo_enable_runtime_cache
    ):
        errors.append(
            "--dlo-runtime-cache-skip-load requires --dlo-enable-runtime-cache: it binds to "
            "runtime-cache entries; add --dlo-enable-runtime-cache or drop it"
        )
    if offload.dlo_runtime_cache_size_budget_gib is not None and not (
        offload.dlo_enable_runtime_cache
    ):
        errors.append(
            "--dlo-runtime-cache-size-budget-gib requires --dlo-enable-runtime-cache: it bounds "
            "the runtime cache; add --dlo-enable-runtime-cache or drop it"
        )
    if offload.dlo_runtime_cache_pin_limit_gib > 0 and sharding_size > 1:
        errors.append(
            "--dlo-runtime-cache-pin-limit-gib > 0 registers the mapped weights of rank-local "
            "DLO, but with DLO AllGather each rank's shard already sits in private pinned "
            "memory; add --dlo-no-use-allgather or set it to 0"
        )
    return errors


def _rank_local_only_errors(offload: OffloadOptions, sharding_size: int) -> list[str]:
    """Options that plan or stream complete blocks on each rank, under DLO AllGather."""
    errors: list[str] = []
    if sharding_size == 1:
        return errors
    if offload.max_gpu_memory_gib is not None:
        errors.append(
            "--max-gpu-memory-gib plans complete blocks on each GPU, but DLO AllGather shards "
            "them over the DP/SP group; add --dlo-no-use-allgather or drop the budget"
        )
    if offload.dlo_stream_text_encoders:
        errors.append(
            "--dlo-stream-text-encoders streams complete rank-local blocks, but DLO AllGather "
            "shards them over the DP/SP group; add --dlo-no-use-allgather or drop it"
        )
    return errors


def _device_budget_errors(offload: OffloadOptions) -> list[str]:
    """``--max-gpu-memory-gib`` plans the DiT's share of the device itself."""
    if offload.max_gpu_memory_gib is None:
        return []
    return [
        f"{flag} and --max-gpu-memory-gib both size the DiT's device memory; "
        f"--max-gpu-memory-gib plans the resident blocks from the whole pipeline: drop {flag}"
        for flag, is_set in (
            ("--dlo-gpu-memory-budget-gib", offload.dlo_gpu_memory_budget_gib is not None),
            ("--dlo-resident-layers", offload.dlo_resident_layers > 0),
        )
        if is_set
    ]


def _allgather_errors(config: WorkerConfig) -> list[str]:
    """Options that cannot run with DLO AllGather (sharded host weights)."""
    parallel, offload, quantization = config.parallel, config.offload, config.model.quantization
    errors: list[str] = []
    if parallel.use_hsdp:
        errors.append(
            "--use-hsdp cannot be combined with DLO AllGather: HSDP already shards the "
            "parameters and DLO would shard them twice; add --dlo-no-use-allgather"
        )
    if quantization not in (Quantization.NONE, Quantization.FP8):
        errors.append(
            f"--quantization {quantization} cannot be combined with DLO AllGather: only "
            "per-tensor fp8 has a validated shard layout; add --dlo-no-use-allgather or "
            "use --quantization fp8 or none"
        )
    if offload.dlo_resident_layers > 0:
        errors.append(
            "--dlo-resident-layers requires --dlo-no-use-allgather: AllGather ranks stream "
            "every block in lockstep; add --dlo-no-use-allgather or set it to 0"
        )
    if offload.dlo_gpu_memory_budget_gib is not None:
        errors.append(
            "--dlo-gpu-memory-budget-gib requires --dlo-no-use-allgather: it keeps blocks "
            "resident, and AllGather ranks stream every block in lockstep; add "
            "--dlo-no-use-allgather or drop it"
        )
    if offload.dlo_enable_runtime_cache:
        errors.append(
            "--dlo-enable-runtime-cache requires --dlo-no-use-allgather: the runtime cache "
            "backs complete rank-local blocks; add --dlo-no-use-allgather"
        )
    return errors


def _lora_errors(config: WorkerConfig) -> list[str]:
    return _quantized_adapter_errors(config, "--lora") if config.model.lora else []


def _quantized_adapter_errors(config: WorkerConfig, flag: str) -> list[str]:
    if config.model.quantization != Quantization.NONE:
        return [
            f"{flag} with --quantization {config.model.quantization}: LoRA adapters wrap the "
            "DiT's nn.Linear layers, which quantization replaces; drop one of them"
        ]
    return []


def _lora_execution_errors(config: WorkerConfig, policy: OffloadPolicy) -> list[str]:
    """``--lora`` runs resident or under DLO, eager or compiled, without sequence
    parallelism."""
    if not config.model.lora:
        return []
    return _adapter_errors(config, policy, "--lora", compiled=True)


def runtime_lora_errors(config: WorkerConfig) -> list[str]:
    """``serve --lora-load-dir`` (adapters loaded at run time) runs where ``--lora`` runs,
    and without a GPU memory budget: the budget plans resident blocks once, at start."""
    flag = "--lora-load-dir"
    errors = _quantized_adapter_errors(config, flag) + _adapter_errors(
        config, config.effective().offload_policy, flag
    )
    for budget_flag, budget in (
        ("--dlo-gpu-memory-budget-gib", config.offload.dlo_gpu_memory_budget_gib),
        ("--max-gpu-memory-gib", config.offload.max_gpu_memory_gib),
    ):
        if budget is not None:
            errors.append(
                f"{flag} with {budget_flag}: the budget plans the resident blocks at start, "
                "and adapters loaded later would be outside it; give the adapters with "
                "--lora (counted in the budget), or drop the budget"
            )
    return errors


def _adapter_errors(
    config: WorkerConfig, policy: OffloadPolicy, flag: str, *, compiled: bool = False
) -> list[str]:
    """Where adapters do not run: diffusers' offload modes, sequence parallelism and,
    unless ``compiled``, ``--compile`` (adapters loaded while serving would change the
    compiled graphs)."""
    errors = []
    if policy in (OffloadPolicy.MODEL_CPU_OFFLOAD, OffloadPolicy.LAYERWISE_OFFLOAD):
        errors.append(
            f"{flag} is not run under diffusers' offload modes by this worker release; "
            "stream the DiT with --enable-distributed-layerwise-offload, or run resident"
        )
    if config.model.compile and not compiled:
        errors.append(
            f"{flag} with --compile is not run by this worker release (an adapter loaded "
            "while serving would change the compiled graphs); give the adapters with --lora, "
            "or drop --compile"
        )
    if config.parallel.sequence_parallel_size > 1:
        errors.append(
            f"{flag} with --sequence-parallel-size > 1 is not run by this worker release; "
            "use data parallelism"
        )
    return errors


def _compile_errors(config: WorkerConfig) -> list[str]:
    model, offload = config.model, config.offload
    if not model.compile:
        if model.compile_mode != CompileMode.DEFAULT:
            return [f"--compile-mode {model.compile_mode} requires --compile; add it"]
        if model.compile_cache_dir is not None:
            return ["--compile-cache-dir requires --compile; add it or drop the directory"]
        return []
    if model.compile_mode == CompileMode.REDUCE_OVERHEAD and model.device == "cpu":
        return [
            "--compile-mode reduce-overhead with --device cpu: CUDA graphs need a CUDA "
            "device; use --compile-mode default on the CPU"
        ]
    if offload.enable_layerwise_offload and not offload.enable_distributed_layerwise_offload:
        return [
            "--compile with --enable-layerwise-offload: diffusers' group offloading loads "
            "weights in hooks torch.compile cannot trace, so a block is never one graph; use "
            "--enable-distributed-layerwise-offload, whose hooks stay outside the compiled "
            "blocks, or drop --compile"
        ]
    return []


def _hsdp_errors(parallel: ParallelOptions) -> list[str]:
    if not parallel.use_hsdp:
        if parallel.hsdp_shard_size != -1 or parallel.hsdp_replicate_size != 1:
            return ["--hsdp-shard-size and --hsdp-replicate-size require --use-hsdp; add it"]
        return []
    if parallel.data_parallel_size > 1 or parallel.tensor_parallel_size > 1:
        return [
            "--use-hsdp cannot be combined with --data-parallel-size > 1 or "
            "--tensor-parallel-size > 1: HSDP only composes with sequence parallelism; "
            "set both to 1 or drop --use-hsdp"
        ]
    world = parallel.world_size
    if world % parallel.hsdp_replicate_size:
        return [
            f"--hsdp-replicate-size {parallel.hsdp_replicate_size} must divide the world "
            f"size {world} (--sequence-parallel-size)"
        ]
    if parallel.effective_hsdp_shard_size * parallel.hsdp_replicate_size != world:
        return [
            f"--hsdp-shard-size {parallel.hsdp_shard_size} x --hsdp-replicate-size "
            f"{parallel.hsdp_replicate_size} must equal the world size {world}; "
            "use --hsdp-shard-size -1 to derive it"
        ]
    return []


def _dlo_options_without_dlo(offload: OffloadOptions) -> list[str]:
    set_dlo_options = [
        NEGATIVE_FLAGS.get(name, flag_for(name))
        for name, field in type(offload).model_fields.items()
        if name.startswith("dlo_") and getattr(offload, name) != field.default
    ]
    if not set_dlo_options:
        return []
    return [
        f"{', '.join(set_dlo_options)} apply only to DLO; add "
        "--enable-distributed-layerwise-offload or drop them"
    ]


def execution_errors(config: WorkerConfig) -> list[str]:
    """What this worker release cannot execute although the options are valid (pure).

    The configuration models the whole design (the operator validates against it), but
    quantization other than per-tensor FP8, TP and HSDP are not implemented, and diffusers'
    offload modes need a CUDA device and run neither under SP nor with FP8. ``generate``,
    ``serve`` and the operator refuse them with these messages (each names what would be
    needed) instead of failing later.
    """
    errors: list[str] = []
    policy = config.effective().offload_policy
    if (
        policy in (OffloadPolicy.MODEL_CPU_OFFLOAD, OffloadPolicy.LAYERWISE_OFFLOAD)
        and config.model.device == "cpu"
    ):
        flag = flag_for(
            "enable_cpu_offload"
            if policy == OffloadPolicy.MODEL_CPU_OFFLOAD
            else "enable_layerwise_offload"
        )
        errors.append(
            f"{flag} moves weights between host memory and a CUDA device, and --device is "
            "cpu: drop the flag (on the CPU everything is in host memory already)"
        )
    errors += _lora_execution_errors(config, policy)
    quantization = config.model.quantization
    if quantization not in (Quantization.NONE, Quantization.FP8):
        errors.append(
            f"--quantization {quantization} is not executed by this worker release; use "
            "--quantization fp8 (per-tensor FP8 weights) or none"
        )
    elif quantization == Quantization.FP8 and policy in (
        OffloadPolicy.MODEL_CPU_OFFLOAD,
        OffloadPolicy.LAYERWISE_OFFLOAD,
    ):
        errors.append(
            "--quantization fp8 is not run under diffusers' offload modes by this worker "
            "release; stream the FP8 weights with --enable-distributed-layerwise-offload, or "
            "run resident"
        )
    parallel = config.parallel
    if parallel.sequence_parallel_size > 1 and policy in (
        OffloadPolicy.MODEL_CPU_OFFLOAD,
        OffloadPolicy.LAYERWISE_OFFLOAD,
    ):
        flag = flag_for(
            "enable_cpu_offload"
            if policy == OffloadPolicy.MODEL_CPU_OFFLOAD
            else "enable_layerwise_offload"
        )
        errors.append(
            f"--sequence-parallel-size {parallel.sequence_parallel_size} with {flag}: "
            "diffusers' offload modes are not run under sequence parallelism by this worker "
            "release; use --enable-distributed-layerwise-offload (DLO shards host weights "
            "over the SP group) or --sequence-parallel-size 1"
        )
    if parallel.tensor_parallel_size > 1:
        errors.append(
            f"--tensor-parallel-size {parallel.tensor_parallel_size}: tensor parallelism needs "
            "every DiT's attention and MLP linears sharded column- and row-wise (diffusers "
            "plans that for a few classes only, as DTensors) and DLO streaming DTensor "
            "shards, which this worker release does not implement; set "
            "--tensor-parallel-size 1 and split work with --sequence-parallel-size or "
            "--data-parallel-size"
        )
    if parallel.use_hsdp:
        errors.append(
            "--use-hsdp: HSDP needs each DiT wrapped in FSDP2 with its own parameter "
            "lifecycle, which this worker does not implement (and DLO never shards an HSDP "
            "group again); drop --use-hsdp and use --data-parallel-size with DLO AllGather, "
            "which shards host weights over DP"
        )
    return errors
