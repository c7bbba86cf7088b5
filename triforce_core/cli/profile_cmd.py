"""`triforce profile list|show`: the memory profiles the planner plans against."""
from __future__ import annotations

import json

import click


@click.group("profile")
def profile_group():
    """Memory profiles: GPU count and bytes, host bytes, bandwidths (see `triforce plan`)."""


@profile_group.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print the profiles as JSON.")
def list_cmd(as_json):
    """The shipped profiles."""
    from triforce.offload.profiles import format_size, list_profiles

    profiles = list_profiles()
    if as_json:
        print(json.dumps({"profiles": [_as_dict(p) for p in profiles]}))
        return
    print(f"{'name':16s} {'gpus':>4s} {'per GPU':>10s} {'host':>10s} {'PCIe GB/s':>9s}  description")
    for p in profiles:
        print(f"{p.name:16s} {p.num_gpus:4d} {format_size(p.gpu_bytes):>10s} {format_size(p.host_bytes):>10s} "
              f"{p.pcie_h2d_gbps:9.1f}  {p.description}")


@profile_group.command("show")
@click.argument("profile")
@click.option("--json", "as_json", is_flag=True, help="Print the profile as JSON.")
def show_cmd(profile, as_json):
    """One profile, by name or .toml file, with every field."""
    from triforce.offload.profiles import format_size, load_profile

    p = load_profile(profile)
    if as_json:
        print(json.dumps(_as_dict(p)))
        return
    for key, value in _as_dict(p).items():
        if key.endswith("_bytes"):
            value = f"{format_size(value)} ({value} bytes)"
        print(f"{key:18s} {value}")


def _as_dict(p) -> dict:
    from dataclasses import asdict

    out = asdict(p)
    out["extras"] = dict(p.extras)
    out["device_budget_bytes"] = p.device_budget_bytes
    return out
