"""``dlo-worker launch`` with its SIGTERM landing where torchrun loses track of its ranks.

torchrun records its ranks' handles only once it has started all of them; a SIGTERM
that lands after the last fork and before that record makes it shut down none of them.
On a loaded machine the kubelet's SIGTERM can land there by chance. This entry point
makes it land there every time: it sends the signal from inside real torchrun, right
after the last rank is forked, and writes the ranks' pids to ``$DLO_TEST_RANK_PIDS`` so a
test can check that none outlives the launcher.

Usage: ``python -m tests.support.signalled_launch <torchrun arguments>``.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

import torch.distributed.elastic.multiprocessing.api as multiprocessing_api
from torch.distributed.run import determine_local_world_size, parse_args

from dlo_worker.cli.launch import launch

RANK_PIDS_ENV = "DLO_TEST_RANK_PIDS"


def main() -> int:
    arguments = sys.argv[1:]
    ranks = determine_local_world_size(parse_args(arguments).nproc_per_node)
    start_rank = multiprocessing_api.get_subprocess_handler
    pids: list[int] = []

    def start_rank_then_signal(**kwargs: Any) -> Any:
        handler = start_rank(**kwargs)
        pids.append(handler.proc.pid)
        Path(os.environ[RANK_PIDS_ENV]).write_text(" ".join(map(str, pids)))
        if len(pids) == ranks:
            os.kill(os.getpid(), signal.SIGTERM)
        return handler

    multiprocessing_api.get_subprocess_handler = start_rank_then_signal
    return launch(arguments)


if __name__ == "__main__":
    sys.exit(main())
