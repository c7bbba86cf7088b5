"""Decoding: the engine, its tiers, verification math, sampling, the drafting tiers' graph runner."""
