"""Sequence parallelism (diffusers' Ulysses context parallelism) with DLO, in real gloo
worlds: SP=2 with DLO rank-local and with AllGather over the SP group, and DP=2 x SP=2
(4 processes) with AllGather over the DP group, each bitwise equal to the same SP
configuration without DLO, for tiny Flux and Wan DiTs; then ``generate`` and ``serve``
under torchrun on the Flux demo."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from dlo_worker.config import ParallelOptions, ShardingGroup
from dlo_worker.offload import enable_dlo
from dlo_worker.pipeline import sequence_parallel
from dlo_worker.process.topology import group_ranks, rank_coordinates
from tests.support.generate import ENV, digest, generate_command
from tests.support.launch import rank_logs, torchrun_command
from tests.support.ports import free_port
from tests.support.ranks import spawn_ranks
from tests.support.serving import Server, serve_command
from tests.support.serving import digest as digest_bytes
from tests.support.tiny_models import tiny_flux, tiny_wan

CPU = torch.device("cpu")
BUILDERS = {"flux": tiny_flux, "wan": tiny_wan}


def _groups(rank: int, parallel: ParallelOptions) -> dict[ShardingGroup, dist.ProcessGroup]:
    """This rank's DP and SP groups, built by every rank in the same order."""
    groups = {}
    for kind, rank_lists in group_ranks(parallel).items():
        for ranks in rank_lists:
            group = dist.new_group(ranks)
            if rank in ranks:
                groups[kind] = group
    return groups


def _output(
    name: str, parallel: ParallelOptions, data_parallel_rank: int, sp_first: bool = False, **dlo
) -> torch.Tensor:
    """One forward of the tiny DiT ``name`` under SP (and DLO when ``dlo`` is given, enabled
    before SP as the worker does, or after it as a library user may); each DP replica gets
    its own input, every replica the same weights."""
    case = BUILDERS[name](0)
    case.inputs["hidden_states"] = case.inputs["hidden_states"] + data_parallel_rank
    pipeline = SimpleNamespace(components={"transformer": case.model})
    if sp_first:
        sequence_parallel.apply(pipeline, parallel, CPU, ("transformer",))
    backend = enable_dlo(case.model, device=CPU, **dlo) if dlo else None
    if not sp_first:
        sequence_parallel.apply(pipeline, parallel, CPU, ("transformer",))
    try:
        with torch.no_grad():
            return case.model(**case.inputs, return_dict=False)[0]
    finally:
        if backend is not None:
            stats = backend.stats()
            backend.disable()
            if dlo.get("use_allgather"):
                size = dist.get_world_size(dlo["process_group"])
                assert stats.shards == size, (name, stats)


def _rank(rank: int, world_size: int, store: str, data_parallel: int) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
    torch.set_num_threads(1)
    parallel = ParallelOptions(
        data_parallel_size=data_parallel, sequence_parallel_size=world_size // data_parallel
    )
    dp_rank = rank_coordinates(rank, parallel).data_parallel_rank
    groups = _groups(rank, parallel)
    # The worker's rule (dlo_worker.config.dlo_sharding_group): DP when DP > 1, else SP.
    sharding = ShardingGroup.DATA_PARALLEL if data_parallel > 1 else ShardingGroup.SEQUENCE_PARALLEL
    try:
        for name in BUILDERS:
            expected = _output(name, parallel, dp_rank)
            rank_local = _output(name, parallel, dp_rank, use_allgather=False)
            allgather = _output(
                name, parallel, dp_rank, use_allgather=True, process_group=groups[sharding]
            )
            sp_first = _output(
                name,
                parallel,
                dp_rank,
                sp_first=True,
                use_allgather=True,
                process_group=groups[sharding],
            )
            assert torch.equal(rank_local, expected), name
            assert torch.equal(allgather, expected), name
            assert torch.equal(sp_first, expected), name
            # Every SP rank ends with the whole output; DP replicas differ.
            whole = [torch.empty_like(expected) for _ in range(world_size)]
            dist.all_gather(whole, expected.contiguous())
            same_replica = [
                r for r in range(world_size) if r // parallel.sequence_parallel_size == dp_rank
            ]
            assert all(torch.equal(whole[r], expected) for r in same_replica), name
            if data_parallel > 1:
                other = (dp_rank + 1) % data_parallel * parallel.sequence_parallel_size
                assert not torch.equal(whole[other], expected), name
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(("world_size", "data_parallel"), [(2, 1), (4, 2)], ids=["sp2", "dp2-sp2"])
def test_sp_with_dlo_is_bitwise_equal_to_sp_without_dlo(
    world_size: int, data_parallel: int, tmp_path: Path
) -> None:
    spawn_ranks(_rank, (world_size, str(tmp_path / "store"), data_parallel), world_size)


# --- the worker as users run it: torchrun, the CLI, HTTP ----------------------------------

FOX = ["--prompt", "a red fox", "--width", "64", "--height", "64"]


def run_generate(model: Path, out: Path, log_dir: Path, *flags: str) -> dict[int, str]:
    """``dlo-worker generate`` as 2 torchrun ranks with SP=2; returns the rank logs."""
    command = generate_command(model, out, 5, "--sequence-parallel-size", "2", *FOX, *flags)
    command[command.index("--steps") + 1] = "2"
    result = subprocess.run(
        torchrun_command(command, log_dir),
        env=ENV,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return rank_logs(log_dir)


def test_generate_with_sp_writes_the_same_bytes_with_and_without_dlo(
    flux_model_dir: Path, tmp_path: Path
) -> None:
    run_generate(flux_model_dir, tmp_path / "sp.png", tmp_path / "sp-logs")
    logs = run_generate(
        flux_model_dir,
        tmp_path / "dlo.png",
        tmp_path / "dlo-logs",
        "--enable-distributed-layerwise-offload",
    )
    assert digest(tmp_path / "dlo.png") == digest(tmp_path / "sp.png")
    # One SP group makes one image: no second DP output beside it.
    assert sorted(p.name for p in tmp_path.glob("*.png")) == ["dlo.png", "sp.png"]
    for log in logs.values():
        assert 'msg="sequence parallelism enabled"' in log
        assert "mode=ulysses" in log
        assert "transfer_mode=allgather" in log  # DP=1: DLO shards over the SP group
        assert "shards=2" in log


def test_an_sp_engine_serves_the_generated_bytes_and_refuses_sizes_that_do_not_split(
    flux_model_dir: Path, tmp_path: Path
) -> None:
    run_generate(flux_model_dir, tmp_path / "sp.png", tmp_path / "generate-logs")
    port, log_dir = free_port(), tmp_path / "logs"
    arguments = serve_command(
        flux_model_dir,
        port,
        "--enable-distributed-layerwise-offload",
        "--sequence-parallel-size",
        "2",
    )
    server = Server(torchrun_command(arguments, log_dir), port)
    try:
        server.wait_ready()
        body = {"prompt": "a red fox", "width": 64, "height": 64, "seed": 5, "steps": 2}
        response = server.generate(body)
        assert response.status_code == 200, response.text
        assert digest_bytes(response.content) == digest(tmp_path / "sp.png")
        # The demo's patches are 8x8 pixels: 40x40 is 25 of them, which 2 SP ranks cannot
        # split (diffusers would fail inside the forward).
        refused = server.generate({**body, "width": 40, "height": 40})
        assert refused.status_code == 422
        assert "do not split evenly over the 2 sequence-parallel ranks" in refused.text
    finally:
        output = server.stop()
    logs = rank_logs(log_dir)
    assert sorted(logs) == [0, 1], output
    for log in logs.values():
        # Both ranks of the SP group ran the request in slot 0 of one wave.
        assert re.search(r'msg="request done".* lane=0 wave=1', log), log
        assert log.index('msg="dlo disabled"') < log.index('msg="process groups destroyed"')
