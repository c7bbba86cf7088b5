"""KV caches: the full cache contract, the resident cache, sparse and streaming caches, selection policies."""
