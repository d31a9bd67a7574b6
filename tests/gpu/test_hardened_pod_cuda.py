"""The rendered worker Pod's container on two GPUs, exactly as rendered (``--device cuda``),
as user 65532 with no capabilities, no_new_privs and a read-only root: NCCL initialises
(its shared memory is the Pod's /dev/shm emptyDir), the engine serves and drains."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.support.rendered_pod import assert_served_and_drained, serve_as_rendered_pod


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to apply a Pod's security context")
def test_the_rendered_worker_pod_serves_on_nccl_without_privileges(
    demo_model_dir: Path, tmp_path: Path
) -> None:
    # What the NVIDIA container toolkit and the image put into a real Pod's environment.
    machine = {
        key: value
        for key, value in os.environ.items()
        if key.startswith(("NCCL_", "CUDA_", "NVIDIA_", "TORCH_"))
        or key in ("LD_LIBRARY_PATH", "PYTHONPATH")
    }
    result = serve_as_rendered_pod(
        demo_model_dir, tmp_path, device="cuda", env={"NCCL_NVLS_ENABLE": "0", **machine}
    )
    assert_served_and_drained(result)
