"""Planning: where the bytes go and how to decode. The memory planner (weights, caches and KV on
the device, the rest on the host), the cost model that prices a step, the memory profiles, the
choices of method, speculation and batch made from them, the advice when a model does not fit,
and the measurements that tune them. offload/ below it moves the bytes it plans."""
