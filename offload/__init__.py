"""Offloading: memory profiles, the memory planner and its cost model, the prefetcher (streams,
events, staging buffers), the offloaded KV cache, tensor-parallel setup.

Import the submodules you need; planning (profiles, planner, cost_model) needs no torch."""
