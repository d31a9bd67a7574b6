"""CPU results that do not depend on where a tensor sits in memory.

MKL, torch's CPU BLAS, picks kernels by pointer alignment, so the same weights at two
addresses (a checkpoint mapping for a resident model, an aligned DLO slot for a streamed
one) can round differently in the last bit. Its strict Conditional Numerical
Reproducibility mode removes that dependence; without it a resident and an offloaded
run on the CPU differ by ~1e-7 (measured on the Flux demo), which is enough to change a
pixel. GPUs are unaffected: cuBLAS does not read this variable.
"""

from __future__ import annotations

import os

MKL_REPRODUCIBILITY_ENV = "MKL_CBWR"
STRICT_MODE = "AUTO,STRICT"


def pin_cpu_blas_numerics() -> None:
    """Select MKL's strict reproducible mode unless the user chose one; must run before
    torch loads MKL, and child ranks inherit it through the environment."""
    os.environ.setdefault(MKL_REPRODUCIBILITY_ENV, STRICT_MODE)
