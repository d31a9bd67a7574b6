"""Flux-class DLO benchmark: one denoising step of the real FluxTransformer2DModel configuration.

Random bf16 weights (11.9 B parameters, 57 blocks). Every figure is measured in this
process and printed as ratios against the limits of ``docs/limits.md``:

- resident: all weights on the GPU;
- transfer bound: streamed block bytes / pinned H2D bandwidth measured here;
- DLO (rank-local, or AllGather under torchrun);
- diffusers group offloading, the peer, in its strongest configurations (block level and
  leaf level, both with ``use_stream`` and ``record_stream``); the best of them is the one
  compared, and every configuration's step time and peak HBM are printed;
- diffusers' model-level offload (``--enable-cpu-offload``): steps at the resident speed
  once the whole DiT moved in, plus one move in and one out per image;
- with ``--budgets``: DLO with ``gpu_memory_budget_gib`` (streamed bytes spread evenly
  through the order), each against its own bound max(resident step, streamed bytes / H2D)
  and against the resident step beside copies of the same bytes;

Each step is timed two ways: synchronized before and after each step (the median), and
back to back (the mean of steps run with no synchronization between them, as a denoising
loop runs them), each against the limit built from the resident step timed the same way.
DLO starts copying the next step's first streamed blocks as a step ends; back to back
these copies overlap the next step, synchronized they are waited for at the step's end.

A row that fails (out of memory, say) is recorded as ``{"failed": "..."}`` with its
reason and printed as such; the rows before and after it are kept.

One GPU:   python bench/flux_dlo.py --resolutions 1024 2048 --budgets 4 8 12 16 20 24
Two GPUs:  torchrun --nproc-per-node 2 bench/flux_dlo.py --resolutions 1024 --shard-buffers 2 4 6
           (DP=2 AllGather; each shard-ring depth against the same bound)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

FLUX_DEV_CONFIG = {
    "patch_size": 1,
    "in_channels": 64,
    "num_layers": 19,
    "num_single_layers": 38,
    "attention_head_dim": 128,
    "num_attention_heads": 24,
    "joint_attention_dim": 4096,
    "pooled_projection_dim": 768,
    "guidance_embeds": True,
    "axes_dims_rope": (16, 56, 56),
}
TEXT_TOKENS = 512


def build_flux(device: torch.device, seed: int = 0) -> torch.nn.Module:
    """The real Flux configuration with random bf16 weights, materialized directly on ``device``."""
    from diffusers import FluxTransformer2DModel

    with torch.device("meta"):
        model = FluxTransformer2DModel(**FLUX_DEV_CONFIG)
    model = model.to(dtype=torch.bfloat16).to_empty(device=device).eval()
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0.0, 0.02, generator=generator)
    return model


def flux_inputs(resolution: int, device: torch.device) -> dict[str, torch.Tensor]:
    tokens = (resolution // 16) ** 2  # 8x VAE downsampling, then 2x2 packing
    generator = torch.Generator(device=device).manual_seed(1)
    bf16 = torch.bfloat16
    return {
        "hidden_states": torch.randn(1, tokens, 64, device=device, dtype=bf16, generator=generator),
        "encoder_hidden_states": torch.randn(
            1, TEXT_TOKENS, 4096, device=device, dtype=bf16, generator=generator
        ),
        "pooled_projections": torch.randn(1, 768, device=device, dtype=bf16, generator=generator),
        "timestep": torch.tensor([1.0], device=device, dtype=bf16),
        "guidance": torch.tensor([3.5], device=device, dtype=bf16),
        "img_ids": torch.zeros(tokens, 3, device=device),
        "txt_ids": torch.zeros(TEXT_TOKENS, 3, device=device),
    }


@torch.inference_mode()
def step_seconds(model: torch.nn.Module, inputs: dict, repeats: int, warmup: int = 2) -> float:
    """Median wall time of one transformer forward (= one Flux-dev denoising step)."""
    times = []
    for index in range(warmup + repeats):
        torch.cuda.synchronize()
        started = time.perf_counter()
        model(**inputs)
        torch.cuda.synchronize()
        if index >= warmup:
            times.append(time.perf_counter() - started)
    return statistics.median(times)


@torch.inference_mode()
def back_to_back_step_seconds(
    model: torch.nn.Module, inputs: dict, repeats: int, warmup: int = 2
) -> float:
    """Mean wall time of one forward among ``repeats`` run back to back, synchronized only
    before and after: as a denoising loop runs them (no host sync between steps), so
    copies DLO starts for the next step overlap this step's end."""
    for _ in range(warmup):
        model(**inputs)
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(repeats):
        model(**inputs)
    torch.cuda.synchronize()
    return (time.perf_counter() - started) / repeats


def pinned_h2d_gbps(device: torch.device, nbytes: int = 2**30, repeats: int = 10) -> float:
    source = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    target = torch.empty(nbytes, dtype=torch.uint8, device=device)
    target.copy_(source, non_blocking=True)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        target.copy_(source, non_blocking=True)
    end.record()
    end.synchronize()
    return nbytes * repeats / (start.elapsed_time(end) / 1e3) / 1e9


def h2d_of_each_rank_alone(device: torch.device) -> float:
    """Pinned H2D of this rank while the other ranks wait (the slowest rank's figure)."""
    alone = 0.0
    for rank in range(dist.get_world_size()):
        dist.barrier()
        if rank == dist.get_rank():
            alone = pinned_h2d_gbps(device)
        torch.cuda.synchronize()
    slowest = torch.tensor([alone], device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MIN)
    return slowest.item()


def allgather_seconds(nbytes: int, device: torch.device, repeats: int = 10) -> float:
    world = dist.get_world_size()
    shard = torch.empty(nbytes // world // 2, dtype=torch.bfloat16, device=device)
    full = torch.empty(shard.numel() * world, dtype=torch.bfloat16, device=device)
    dist.all_gather_into_tensor(full, shard)
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(repeats):
        dist.all_gather_into_tensor(full, shard)
    torch.cuda.synchronize()
    return (time.perf_counter() - started) / repeats


def resident_beside_copies_seconds(
    model: torch.nn.Module, inputs: dict, nbytes: int, repeats: int, warmup: int = 2
) -> float:
    """Median step of the resident model while a side stream copies ``nbytes`` host-to-device.

    The floor for a residency point: DLO overlaps its copies with compute, and on this
    hardware concurrent copies slow compute without any DLO code involved (the kernels'
    launches share the PCIe link the copies saturate).
    """
    return copies_beside_resident(model, inputs, nbytes, repeats, warmup)[0]


@torch.inference_mode()
def copies_beside_resident(
    model: torch.nn.Module, inputs: dict, nbytes: int, repeats: int, warmup: int = 2
) -> tuple[float, float]:
    """Median step (s) of the resident model while a side stream copies ``nbytes``
    host-to-device, and the median rate (GB/s) of those copies, timed on the side stream.

    All copies are issued before the step: the best any streaming schedule could overlap
    them with compute, with unlimited device memory. The step is that schedule's floor,
    and the rate is what the copy engine reaches beside this model's compute.
    """
    device = next(model.parameters()).device
    chunk = min(nbytes, 2**30)
    source = torch.empty(chunk, dtype=torch.uint8, pin_memory=True)
    target = torch.empty(chunk, dtype=torch.uint8, device=device)
    side = torch.cuda.Stream(device)
    times, rates = [], []
    for index in range(warmup + repeats):
        copy_started = torch.cuda.Event(enable_timing=True)
        copy_finished = torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        started = time.perf_counter()
        with torch.cuda.stream(side):
            copy_started.record()
            remaining = nbytes
            while remaining > 0:
                length = min(chunk, remaining)
                target[:length].copy_(source[:length], non_blocking=True)
                remaining -= length
            copy_finished.record()
        model(**inputs)
        torch.cuda.synchronize()
        if index >= warmup:
            times.append(time.perf_counter() - started)
            rates.append(nbytes / (copy_started.elapsed_time(copy_finished) / 1e3) / 1e9)
    return statistics.median(times), statistics.median(rates)


def rss_gib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024 / 2**30
    return float("nan")


def peak_gib(device: torch.device) -> float:
    return torch.cuda.max_memory_allocated(device) / 2**30


def release(device: torch.device) -> None:
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)


def attempt(what: str, measure: Callable[[], Any], cleanup: Callable[[], None]) -> Any:
    """``measure()``, or ``{"failed": reason}`` when it raises: one row's failure (out of
    memory in the largest configuration, say) must not lose the rows measured before it.
    ``cleanup`` runs once the failure's traceback, and the tensors its frames hold, are
    gone."""
    try:
        return measure()
    except Exception as error:  # any failure of a row is recorded, not raised
        lines = str(error).strip().splitlines()
        failure = {"failed": f"{type(error).__name__}: {lines[0] if lines else ''}"[:300]}
    print(f"# {what}: {failure['failed']}", file=sys.stderr)
    cleanup()
    return failure


def failed(row: object) -> bool:
    return isinstance(row, dict) and "failed" in row


def resident_rows(
    model: torch.nn.Module, inputs: dict, args: argparse.Namespace, device: torch.device
) -> dict:
    """Per size: the resident step (synchronized), its peak and its back-to-back step."""
    rows = {}
    for resolution in args.resolutions:
        release(device)
        rows[resolution] = attempt(
            f"resident {resolution}x{resolution}",
            lambda resolution=resolution: (
                step_seconds(model, inputs[resolution], args.repeats),
                peak_gib(device),
                back_to_back_step_seconds(model, inputs[resolution], args.repeats),
            ),
            lambda: release(device),
        )
    return rows


def run(args: argparse.Namespace) -> dict:
    from dlo_worker.offload import enable_dlo

    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if distributed:
        local_rank = int(os.environ["LOCAL_RANK"])
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
        world = dist.get_world_size()
    else:
        device, world = torch.device("cuda", 0), 1
    report: dict = {
        "gpu": torch.cuda.get_device_name(device),
        "world_size": world,
        "torch": torch.__version__,
        "results": {},
    }
    bandwidth = pinned_h2d_gbps(device)
    if distributed:
        # The DP bound uses the per-GPU H2D while every GPU copies at once (what DLO
        # AllGather does); the bandwidth of one GPU copying alone is reported beside it.
        report["pinned_h2d_alone_gbps"] = h2d_of_each_rank_alone(device)
        dist.barrier()
        bandwidth = pinned_h2d_gbps(device)
    report["pinned_h2d_gbps"] = bandwidth

    model = build_flux(device)
    inputs = {r: flux_inputs(r, device) for r in args.resolutions}
    resident = resident_rows(model, inputs, args, device)

    release(device)
    setup_started = time.perf_counter()
    backend = enable_dlo(
        model,
        device=device,
        use_allgather=distributed,
        process_group=dist.group.WORLD if distributed else None,
    )
    torch.cuda.synchronize()
    dlo_setup_s = time.perf_counter() - setup_started
    block_bytes = sum(layout.nbytes for layout in backend.block_layouts())
    gather_s = (
        allgather_seconds(max(layout.nbytes for layout in backend.block_layouts()), device)
        if distributed
        else 0.0
    )
    for resolution in args.resolutions:
        release(device)
        bound_s = block_bytes / (world * bandwidth * 1e9) + gather_s
        if failed(resident[resolution]):
            reason = resident[resolution]["failed"]
            report["results"][resolution] = {"failed": f"resident: {reason}"}
            continue
        report["results"][resolution] = attempt(
            f"DLO {resolution}x{resolution}",
            lambda resolution=resolution, bound_s=bound_s, model=model: dlo_row(
                model, inputs[resolution], args.repeats, resident[resolution], bound_s
            ),
            lambda: release(device),
        )
    stats = backend.stats()
    report["dlo"] = {
        "setup_s": dlo_setup_s,
        "block_gib": block_bytes / 2**30,
        "host_gib": stats.host_bytes / 2**30,
        "process_rss_gib": rss_gib(),
        "slot_gib": stats.device_slot_bytes / 2**30,
        "exposed_wait_s_per_block": stats.exposed_wait_seconds_per_block,
        "achieved_h2d_gbps": stats.h2d_gbps,
        "allgather_s_largest_block": gather_s,
    }
    backend.disable()
    del model, backend
    release(device)

    def section(what: str, measure: Callable[[], Any]) -> Any:
        return attempt(what, measure, lambda: release(device))

    if not distributed and args.budgets:
        report["budgets"] = section(
            "budgets", lambda: residency_curve(device, inputs, args, resident, bandwidth)
        )
    if not distributed and not args.skip_diffusers:
        report["diffusers"] = diffusers_group_offload(device, inputs, args, report["results"])
        report["diffusers_model_offload"] = diffusers_model_cpu_offload(device, inputs, args)
    if distributed and args.shard_buffers:
        report["shard_buffers"] = section(
            "shard buffers", lambda: shard_ring_curve(device, inputs, args, resident, bandwidth)
        )
    if distributed:
        dist.destroy_process_group()
    return report


def dlo_row(
    model: torch.nn.Module,
    inputs: dict,
    repeats: int,
    resident: tuple[float, float, float],
    bound_s: float,
) -> dict:
    """DLO's step against the resident step and the transfer bound, both ways of timing:
    synchronized around each step, and back to back (the limit then uses the resident
    model's back-to-back step)."""
    dlo_s = step_seconds(model, inputs, repeats)
    dlo_peak = peak_gib(torch.device("cuda", torch.cuda.current_device()))
    dlo_back_to_back_s = back_to_back_step_seconds(model, inputs, repeats)
    resident_s, resident_peak, resident_back_to_back_s = resident
    return {
        "resident_s": resident_s,
        "resident_peak_gib": resident_peak,
        "transfer_bound_s": bound_s,
        "dlo_s": dlo_s,
        "dlo_peak_gib": dlo_peak,
        "dlo_over_resident": dlo_s / resident_s,
        "dlo_over_transfer_bound": dlo_s / bound_s,
        "dlo_over_limit": dlo_s / max(resident_s, bound_s),
        "resident_back_to_back_s": resident_back_to_back_s,
        "dlo_back_to_back_s": dlo_back_to_back_s,
        "dlo_back_to_back_over_limit": dlo_back_to_back_s / max(resident_back_to_back_s, bound_s),
    }


def shard_ring_curve(device, inputs, args, resident, bandwidth) -> list[dict]:
    """DLO AllGather with each depth of the shard ring, against the same two-GPU bound."""
    from dlo_worker.offload import enable_dlo

    rows = []
    world = dist.get_world_size()
    for depth in args.shard_buffers:
        model = build_flux(device)
        release(device)
        backend = enable_dlo(
            model,
            device=device,
            process_group=dist.group.WORLD,
            allgather_shard_buffers=depth,
        )
        layouts = backend.block_layouts()
        gather_s = allgather_seconds(max(layout.nbytes for layout in layouts), device)
        bound_base = sum(layout.nbytes for layout in layouts) / (world * bandwidth * 1e9)
        for resolution in args.resolutions:
            release(device)
            step = step_seconds(model, inputs[resolution], args.repeats)
            peak = peak_gib(device)
            back_to_back = back_to_back_step_seconds(model, inputs[resolution], args.repeats)
            limit = max(resident[resolution][0], bound_base + gather_s)
            back_to_back_limit = max(resident[resolution][2], bound_base + gather_s)
            rows.append(
                {
                    "shard_buffers": depth,
                    "resolution": resolution,
                    "step_s": step,
                    "limit_s": limit,
                    "step_over_limit": step / limit,
                    "back_to_back_s": back_to_back,
                    "back_to_back_over_limit": back_to_back / back_to_back_limit,
                    "peak_gib": peak,
                    "slot_and_shard_gib": backend.stats().device_slot_bytes / 2**30,
                }
            )
        backend.disable()
        del model, backend
        release(device)
    return rows


def residency_curve(device, inputs, args, resident, bandwidth) -> list[dict]:
    """DLO under each GPU memory budget, against the bound of the residency it chose."""
    from dlo_worker.offload import enable_dlo

    rows = []
    beside_copies: dict[tuple[int, int], float] = {}
    for budget in args.budgets:
        model = build_flux(device)
        release(device)
        backend = enable_dlo(
            model, device=device, use_allgather=False, gpu_memory_budget_gib=budget
        )
        streamed_bytes = sum(layout.nbytes for layout in backend.block_layouts())
        for resolution in args.resolutions:
            release(device)
            step = step_seconds(model, inputs[resolution], args.repeats)
            peak = peak_gib(device)
            back_to_back = back_to_back_step_seconds(model, inputs[resolution], args.repeats)
            bound = max(resident[resolution][0], streamed_bytes / (bandwidth * 1e9))
            back_to_back_bound = max(resident[resolution][2], streamed_bytes / (bandwidth * 1e9))
            beside_copies[budget, resolution] = streamed_bytes
            rows.append(
                {
                    "budget_gib": budget,
                    "resolution": resolution,
                    "resident_blocks": backend.stats().resident_blocks,
                    "streamed_gib": streamed_bytes / 2**30,
                    "step_s": step,
                    "bound_s": bound,
                    "step_over_bound": step / bound,
                    "back_to_back_s": back_to_back,
                    "back_to_back_bound_s": back_to_back_bound,
                    "back_to_back_over_bound": back_to_back / back_to_back_bound,
                    "peak_gib": peak,
                }
            )
        backend.disable()
        del model, backend
        release(device)
    # The same bytes copied beside the resident model: the floor with copy interference.
    model = build_flux(device)
    for row in rows:
        release(device)
        streamed_bytes = beside_copies[row["budget_gib"], row["resolution"]]
        floor = max(
            row["bound_s"],
            resident_beside_copies_seconds(
                model, inputs[row["resolution"]], streamed_bytes, args.repeats
            )
            if streamed_bytes
            else row["bound_s"],
        )
        row["floor_with_copies_s"] = floor
        row["step_over_floor"] = row["step_s"] / floor
    del model
    release(device)
    return rows


PEER_CONFIGURATIONS = {
    "block_level": {"offload_type": "block_level", "num_blocks_per_group": 1},
    "leaf_level": {"offload_type": "leaf_level"},
}
"""diffusers' group offloading, each with use_stream=True and record_stream=True."""


def diffusers_group_offload(device, inputs, args, results) -> dict:
    from diffusers.hooks import apply_group_offloading

    peer: dict = {}
    for name, options in PEER_CONFIGURATIONS.items():
        model = build_flux(device).to("cpu")
        release(device)
        started = time.perf_counter()
        apply_group_offloading(
            model, onload_device=device, use_stream=True, record_stream=True, **options
        )
        peer[name] = {"setup_s": time.perf_counter() - started}
        for resolution in args.resolutions:
            release(device)
            peer[name][resolution] = attempt(
                f"diffusers {name} {resolution}x{resolution}",
                lambda resolution=resolution, model=model: {
                    "step_s": step_seconds(model, inputs[resolution], args.repeats),
                    "peak_gib": peak_gib(device),
                },
                lambda: release(device),
            )
        peer[name]["process_rss_gib"] = rss_gib()
        del model
        release(device)
    for resolution in args.resolutions:
        measured = [name for name in PEER_CONFIGURATIONS if not failed(peer[name][resolution])]
        row = results[resolution]
        if not measured or failed(row):
            continue
        best = min(measured, key=lambda name: peer[name][resolution]["step_s"])
        row["diffusers_best"] = best
        row["diffusers_s"] = peer[best][resolution]["step_s"]
        row["diffusers_peak_gib"] = peer[best][resolution]["peak_gib"]
        row["dlo_over_diffusers"] = row["dlo_s"] / row["diffusers_s"]
        row["diffusers_over_limit"] = row["diffusers_s"] / max(
            row["resident_s"], row["transfer_bound_s"]
        )
    return peer


def diffusers_model_cpu_offload(device, inputs, args) -> dict:
    """diffusers' model-level offload (``--enable-cpu-offload``): ``enable_model_cpu_offload``
    puts accelerate's ``cpu_offload_with_hook`` on each component, so the whole DiT moves in
    before the first step of an image and out when the next component runs. Its steps run
    at the resident speed and each image pays one move in and one out; it needs the HBM of
    the whole DiT, which DLO exists to avoid."""
    from accelerate import cpu_offload_with_hook

    model = build_flux(device).to("cpu")
    release(device)
    model, hook = cpu_offload_with_hook(model, device)

    def one_image(resolution: int, model: torch.nn.Module, hook: Any) -> dict:
        torch.cuda.synchronize()
        started = time.perf_counter()
        model(**inputs[resolution])
        torch.cuda.synchronize()
        first = time.perf_counter() - started
        step = step_seconds(model, inputs[resolution], args.repeats)
        started = time.perf_counter()
        hook.offload()
        torch.cuda.synchronize()
        return {
            "first_step_s": first,
            "step_s": step,
            "move_out_s": time.perf_counter() - started,
            "peak_gib": peak_gib(device),
        }

    def offload_and_release(hook: Any) -> None:
        hook.offload()
        release(device)

    result: dict = {}
    for resolution in args.resolutions:
        result[resolution] = attempt(
            f"diffusers model-level offload {resolution}x{resolution}",
            lambda resolution=resolution, model=model, hook=hook: one_image(
                resolution, model, hook
            ),
            lambda hook=hook: offload_and_release(hook),
        )
    del model, hook
    release(device)
    return result


def failures(report: dict) -> list[tuple[str, str]]:
    """Every failed row of ``report``: where it sits, and why."""
    found: list[tuple[str, str]] = []

    def visit(where: str, node: object) -> None:
        if failed(node):
            found.append((where, node["failed"]))  # type: ignore[index]
        elif isinstance(node, dict):
            for key, value in node.items():
                visit(f"{where} {key}".strip(), value)

    visit("", report)
    return found


def print_report(report: dict) -> None:
    print(
        f"# {report['gpu']} x{report['world_size']}, torch {report['torch']}, "
        f"pinned H2D {report['pinned_h2d_gbps']:.1f} GB/s"
        + (
            f" per GPU with all GPUs copying ({report['pinned_h2d_alone_gbps']:.1f} GB/s alone)"
            if "pinned_h2d_alone_gbps" in report
            else ""
        )
    )
    for what, failure in failures(report):
        print(f"{what}: failed ({failure})")
    dlo = report["dlo"]
    print(
        f"# blocks {dlo['block_gib']:.2f} GiB; DLO host {dlo['host_gib']:.2f} GiB per rank, "
        f"RSS {dlo['process_rss_gib']:.1f} GiB, slots {dlo['slot_gib']:.2f} GiB, "
        f"setup {dlo['setup_s']:.1f} s, achieved H2D {dlo['achieved_h2d_gbps']:.1f} GB/s, "
        f"exposed wait {dlo['exposed_wait_s_per_block'] * 1e3:.2f} ms/block"
    )
    for resolution, row in report["results"].items():
        if failed(row):
            continue
        line = (
            f"{resolution}x{resolution}: resident {row['resident_s']:.3f} s "
            f"(peak {row['resident_peak_gib']:.1f} GiB) | bound {row['transfer_bound_s']:.3f} s "
            f"| DLO {row['dlo_s']:.3f} s (peak {row['dlo_peak_gib']:.1f} GiB) = "
            f"{row['dlo_over_limit']:.3f}x limit, {row['dlo_over_resident']:.2f}x resident, "
            f"{row['dlo_over_transfer_bound']:.2f}x bound | back to back: resident "
            f"{row['resident_back_to_back_s']:.3f} s, DLO {row['dlo_back_to_back_s']:.3f} s = "
            f"{row['dlo_back_to_back_over_limit']:.3f}x limit"
        )
        if "diffusers_s" in row:
            line += (
                f" | diffusers best ({row['diffusers_best']}) {row['diffusers_s']:.3f} s "
                f"(peak {row['diffusers_peak_gib']:.1f} GiB) = "
                f"{row['diffusers_over_limit']:.3f}x limit; "
                f"DLO/diffusers {row['dlo_over_diffusers']:.3f}"
            )
        print(line)
    for name, peer in report.get("diffusers", {}).items():
        steps = ", ".join(
            f"{r}x{r} {v['step_s']:.3f} s (peak {v['peak_gib']:.2f} GiB)"
            for r, v in peer.items()
            if isinstance(v, dict) and not failed(v)
        )
        print(f"diffusers {name} (use_stream, record_stream): {steps}")
    for resolution, row in report.get("diffusers_model_offload", {}).items():
        if failed(row):
            continue
        print(
            f"diffusers model-level offload, {resolution}x{resolution}: step {row['step_s']:.3f} s"
            f" after a first step of {row['first_step_s']:.3f} s (moves the DiT in), move out "
            f"{row['move_out_s']:.3f} s per image (peak {row['peak_gib']:.1f} GiB)"
        )
    for row in [] if failed(report.get("shard_buffers")) else report.get("shard_buffers", []):
        print(
            f"AllGather, {row['shard_buffers']} shard buffers, "
            f"{row['resolution']}x{row['resolution']}: step {row['step_s']:.3f} s = "
            f"{row['step_over_limit']:.3f}x limit {row['limit_s']:.3f} s; back to back "
            f"{row['back_to_back_s']:.3f} s = {row['back_to_back_over_limit']:.3f}x "
            f"(slots + shard buffers "
            f"{row['slot_and_shard_gib']:.2f} GiB, peak {row['peak_gib']:.1f} GiB)"
        )
    for row in [] if failed(report.get("budgets")) else report.get("budgets", []):
        print(
            f"budget {row['budget_gib']:g} GiB, {row['resolution']}x{row['resolution']}: "
            f"{row['resident_blocks']} resident, {row['streamed_gib']:.2f} GiB streamed | "
            f"step {row['step_s']:.3f} s, bound {row['bound_s']:.3f} s = "
            f"{row['step_over_bound']:.3f}x; back to back {row['back_to_back_s']:.3f} s, bound "
            f"{row['back_to_back_bound_s']:.3f} s = {row['back_to_back_over_bound']:.3f}x "
            f"| resident beside the same copies "
            f"{row['floor_with_copies_s']:.3f} s, step = {row['step_over_floor']:.3f}x that "
            f"(peak {row['peak_gib']:.1f} GiB)"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--resolutions", type=int, nargs="+", default=[1024, 2048])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--skip-diffusers", action="store_true")
    parser.add_argument(
        "--budgets",
        type=float,
        nargs="*",
        default=[],
        help="GPU memory budgets (GiB) for the residency curve (one GPU only).",
    )
    parser.add_argument(
        "--shard-buffers",
        type=int,
        nargs="*",
        default=[],
        help="Under torchrun: also run DLO AllGather with each of these shard-ring depths.",
    )
    parser.add_argument("--json", type=Path, help="Also write the report as JSON here.")
    args = parser.parse_args()
    report = run(args)
    if int(os.environ.get("RANK", "0")) == 0:
        print_report(report)
        if args.json:
            args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
