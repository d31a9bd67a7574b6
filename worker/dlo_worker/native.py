"""Where the worker's one optional compiled part is, found without importing it.

The staging ring's packers and copy feeder are a C library (``_staging_ring.c``) that
``pip install`` builds only where a C compiler is present (``setup.py``). The
configuration asks whether it was built to choose the staging default (without importing
torch), and the offload backend loads it from the path found here.
"""

from __future__ import annotations

import importlib.machinery
from pathlib import Path

STAGING_RING_FILE_STEM = "_staging_ring"
_FEEDS = Path(__file__).parent / "offload" / "feeds"


def staging_ring_library() -> Path | None:
    """The built staging ring library of this installation, or ``None`` when the install
    had no C compiler (the worker then stages through block buffers)."""
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        candidate = _FEEDS / f"{STAGING_RING_FILE_STEM}{suffix}"
        if candidate.is_file():
            return candidate
    return None


NOT_BUILT = (
    "the native staging ring was not built (installing diffusion-dlo builds it where a C "
    "compiler is present: install gcc, then reinstall)"
)
"""Why a start stages through block buffers although the ring is the default."""
