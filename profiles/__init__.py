"""Named memory profiles as TOML files, read by triforce.offload (offload issue)."""
