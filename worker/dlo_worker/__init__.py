"""diffusion-dlo worker: load a diffusers pipeline, stream its DiT blocks from host memory, serve.

Importing this package does not import torch; the configuration plane
(:mod:`dlo_worker.config`) stays usable by the torch-free operator.
"""

__version__ = "0.1.0"
