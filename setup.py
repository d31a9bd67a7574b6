"""The one compiled part of diffusion-dlo; everything else is in pyproject.toml.

The staging ring's packers and copy feeder are plain C loaded with ctypes (no Python
API). The extension is optional: without a C compiler the install still succeeds, and the
worker stages through block buffers with one warning saying why (``--dlo-staging ring``
is then refused). The worker image builds it in its build stage.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "dlo_worker.offload.feeds._staging_ring",
            sources=["worker/dlo_worker/offload/feeds/_staging_ring.c"],
            extra_compile_args=["-O3", "-pthread"],
            extra_link_args=["-pthread"],
            optional=True,
        )
    ]
)
