"""What the worker does to a loaded diffusers pipeline: diffusers' own offload modes,
FP8 quantization, sequence parallelism, and the embedded demo model."""
