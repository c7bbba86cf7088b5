"""Memory profiles, the memory planner, the prefetcher and tensor-parallel setup (offload issue)."""
