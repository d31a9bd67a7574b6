"""Which compiled Flux-class outputs are bitwise equal, and why some are not: DLO against
resident, CUDA graphs against plain compiled blocks, and one model against itself
compiled again in the same process. Max abs differences (0 = bitwise), one GPU.

``forwards`` (one process, one size): the resident model compiled (``--compile``), then
with CUDA graphs (``--compile-mode reduce-overhead``), then the DLO model the same two
ways, each after ``torch._dynamo.reset()``; every CUDA graph forward is compared with
the others and counted in captures (CUDA graph recordings), which must stop.

``recompile`` (one process): DLO compiled, then compiled again after a reset, then the
resident model compiled three times (after a disable, and after two resets): whether a
model compiled again in the same process still writes its first output.

    python bench/flux_compile_determinism.py forwards --resolution 1024
    python bench/flux_compile_determinism.py recompile --resolution 1024
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from flux_dlo import build_flux, flux_inputs, release

from dlo_worker.config import CompileMode
from dlo_worker.offload import enable_dlo
from dlo_worker.pipeline.compilation import compile_blocks

_captures = [0]


@contextmanager
def counting_captures() -> Iterator[None]:
    """Count CUDA graph captures (torch's graph trees record through ``torch.cuda.graph``)."""
    enter = torch.cuda.graphs.graph.__enter__

    def counted(self: torch.cuda.graphs.graph) -> None:
        _captures[0] += 1
        enter(self)

    torch.cuda.graphs.graph.__enter__ = counted  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.cuda.graphs.graph.__enter__ = enter  # type: ignore[method-assign]


@torch.inference_mode()
def forwards(model: torch.nn.Module, inputs: dict, count: int) -> tuple[list, list[int]]:
    outputs, captures = [], []
    for _ in range(count):
        before = _captures[0]
        outputs.append(model(**inputs).sample.float().cpu())
        captures.append(_captures[0] - before)
    return outputs, captures


def difference(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def compiled(model: torch.nn.Module, mode: CompileMode, device: torch.device) -> None:
    torch._dynamo.reset()
    compile_blocks(model, mode, device)


def dlo_model(device: torch.device) -> tuple[torch.nn.Module, object]:
    model = build_flux(device).to("cpu")
    release(device)
    return model, enable_dlo(model, device=device, use_allgather=False)


def per_forward(resolution: int, device: torch.device) -> dict:
    inputs = flux_inputs(resolution, device)
    model = build_flux(device)
    compile_blocks(model, CompileMode.DEFAULT, device)
    resident, _ = forwards(model, inputs, 2)
    compiled(model, CompileMode.REDUCE_OVERHEAD, device)
    resident_graphs, resident_captures = forwards(model, inputs, 6)
    del model
    release(device)
    model, backend = dlo_model(device)
    compiled(model, CompileMode.DEFAULT, device)
    dlo, _ = forwards(model, inputs, 2)
    compiled(model, CompileMode.REDUCE_OVERHEAD, device)
    dlo_graphs, dlo_captures = forwards(model, inputs, 6)
    backend.disable()  # type: ignore[attr-defined]
    return {
        "resident compiled, forward 1 vs 2": difference(resident[0], resident[1]),
        "resident cuda graphs vs resident compiled, per forward": [
            difference(x, resident[0]) for x in resident_graphs
        ],
        "resident cuda graph captures, per forward": resident_captures,
        "dlo compiled vs resident compiled": difference(dlo[0], resident[0]),
        "dlo cuda graphs vs resident cuda graphs, per forward": [
            difference(x, y) for x, y in zip(dlo_graphs, resident_graphs, strict=True)
        ],
        "dlo cuda graphs vs its last forward, per forward": [
            difference(x, dlo_graphs[-1]) for x in dlo_graphs
        ],
        "dlo cuda graphs vs dlo compiled, per forward": [difference(x, dlo[0]) for x in dlo_graphs],
        "dlo cuda graph captures, per forward": dlo_captures,
    }


def recompile(resolution: int, device: torch.device) -> dict:
    inputs = flux_inputs(resolution, device)
    outputs = {}
    model, backend = dlo_model(device)
    compile_blocks(model, CompileMode.DEFAULT, device)
    outputs["dlo"] = forwards(model, inputs, 1)[0][0]
    compiled(model, CompileMode.DEFAULT, device)
    outputs["dlo after a reset"] = forwards(model, inputs, 1)[0][0]
    backend.disable()  # type: ignore[attr-defined]
    del model, backend
    release(device)
    model = build_flux(device)
    compile_blocks(model, CompileMode.DEFAULT, device)
    outputs["resident"] = forwards(model, inputs, 1)[0][0]
    for attempt in ("after a reset", "after a second reset"):
        compiled(model, CompileMode.DEFAULT, device)
        outputs[f"resident {attempt}"] = forwards(model, inputs, 1)[0][0]
    names = list(outputs)
    return {
        f"{a} vs {b}": difference(outputs[a], outputs[b])
        for i, a in enumerate(names)
        for b in names[i + 1 :]
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("experiment", choices=["forwards", "recompile"])
    parser.add_argument("--resolution", type=int, default=1024)
    args = parser.parse_args()
    device = torch.device("cuda", 0)
    with counting_captures():
        run = per_forward if args.experiment == "forwards" else recompile
        report = {"resolution": args.resolution, args.experiment: run(args.resolution, device)}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
