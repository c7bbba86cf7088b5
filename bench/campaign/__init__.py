"""The GPU campaign's steps, their estimates and its report (the entry point is
triforce.bench.gpu_campaign)."""
