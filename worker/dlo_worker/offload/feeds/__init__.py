"""Per-block feeds: how a streamed block's bytes get from host memory into a device
slot (a pinned arena, packing through staging buffers or a cache-sized ring, or the
driver reading registered mappings directly)."""
