"""One worker process: its topology, devices and numerics, the composition root that
loads the model and enables offload, and the ordered shutdown."""
