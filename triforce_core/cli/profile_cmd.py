"""`triforce profile list|show`: the memory profiles the planner plans against."""
from __future__ import annotations

import json
import sys

import click

from triforce.cli.options import threads_option


@click.group("profile")
def profile_group():
    """Memory profiles: GPU count and bytes, host bytes, bandwidths (see `triforce plan`)."""


@profile_group.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print the profiles as JSON.")
def list_cmd(as_json):
    """The shipped profiles."""
    from triforce.plan.profiles import HOST_UNBOUNDED, format_size, list_profiles

    profiles = list_profiles()
    if as_json:
        print(json.dumps({"profiles": [_as_dict(p) for p in profiles]}))
        return
    print(f"{'name':16s} {'gpus':>4s} {'per GPU':>10s} {'host':>10s} {'PCIe GB/s':>9s}  description")
    for p in profiles:
        host = "machine's" if p.host_bytes == HOST_UNBOUNDED else format_size(p.host_bytes)
        print(f"{p.name:16s} {p.num_gpus:4d} {format_size(p.gpu_bytes):>10s} {host:>10s} "
              f"{p.pcie_h2d_gbps:9.1f}  {p.description}")


@profile_group.command("show")
@click.argument("profile")
@click.option("--json", "as_json", is_flag=True, help="Print the profile as JSON.")
def show_cmd(profile, as_json):
    """One profile, by name or .toml file, with every field."""
    from triforce.plan.profiles import format_size, load_profile

    p = load_profile(profile)
    if as_json:
        print(json.dumps(_as_dict(p)))
        return
    for key, value in _as_dict(p).items():
        if key == "host_bytes" and value is None:
            value = "read from the machine that runs (or `plan --host-memory`)"
        elif key.endswith("_bytes"):
            value = f"{format_size(value)} ({value} bytes)"
        print(f"{key:18s} {value}")


def _as_dict(p) -> dict:
    from dataclasses import asdict

    out = asdict(p)
    out["extras"] = dict(p.extras)
    out["block_gbps"], out["block_tflops"] = dict(p.block_gbps), dict(p.block_tflops)
    out["device_budget_bytes"] = p.device_budget_bytes
    from triforce.plan.profiles import HOST_UNBOUNDED

    if p.host_bytes == HOST_UNBOUNDED:  # a card's profile: the machine's memory decides (plan.host_limits)
        out["host_bytes"] = None
    return out


@profile_group.command("tune")
@click.option("--out", default="profile.toml", show_default=True, help="TOML file to write.")
@click.option("--name", default=None, help="Profile name (default: tuned-<hostname>).")
@click.option("--acceptance", "acceptance_file", default=None,
              help="JSON from `triforce eval acceptance --json` to store with the profile; the cost model "
                   "then chooses the budget, chunk size and gammas from it.")
@threads_option
def tune_cmd(out, name, acceptance_file, threads):
    """Measure this machine and write a profile: memory per GPU (NVML) and on the host, pinned
    host-to-device and device-to-host bandwidth, device memory bandwidth (a copy and a
    matrix-vector product), matmul rate at decode shapes, the per-layer overhead and attention
    rate of one-token forwards of a 135M-parameter decoder (random weights, built locally), the
    arithmetic rate of a verify pass's attention, the CPU attention kernel's rate, and the block
    kernels' rates per GGUF format (one row and a 16-row verify pass; on a GPU with triton), all in the
    dtype `--dtype auto` picks here (bfloat16 on CUDA and on CPUs with native bfloat16). Without CUDA it measures the CPU and writes a usable CPU profile."""
    from tqdm import tqdm

    from triforce.errors import UserError
    from triforce.plan.profiles import TUNED_FOOTER, TUNED_HEADER, load_profile, profile_to_toml
    from triforce.paths import write_atomically
    from triforce.app.tuning import STEPS, tune

    rows = _acceptance_rows(acceptance_file) if acceptance_file else []
    from triforce.app.threads import use_threads
    use_threads(threads)  # the rates measured are those of this many threads (cpu_threads in the profile)
    with tqdm(total=len(STEPS), desc="measuring", file=sys.stderr, leave=False) as bar:
        def progress(step):
            if step != STEPS[0]:
                bar.update(1)
            bar.set_postfix_str(step)

        profile = tune(name, rows, progress)
    try:
        write_atomically(out, TUNED_HEADER + profile_to_toml(profile) + TUNED_FOOTER)
    except OSError as e:
        raise UserError(f"cannot write {out}: {e.strerror}") from None
    load_profile(out)  # what was written reads back
    extras = dict(profile.extras)
    print(f"wrote {out}: {profile.description}; host-to-device {profile.pcie_h2d_gbps} GB/s, weights read "
          f"{profile.hbm_gbps} GB/s (copy {extras['copy_gbps']}), attention {profile.attention_gbps} GB/s, "
          f"matmul {profile.compute_tflops} TFLOP/s at decode shapes, verify-pass attention "
          f"{profile.attention_tflops} TFLOP/s, {profile.layer_overhead_us} us per layer ({extras['measured_dtype']}), "
          f"CPU attention over host KV {profile.host_attention_gbps} GB/s and {profile.host_attention_tflops} TFLOP/s"
          + (f", block-quantized weights read {_rates(profile.block_gbps)} GB/s" if profile.block_gbps else "")
          + (f", {len(rows)} acceptance figures" if rows else ""))


def _rates(pairs) -> str:
    return ", ".join(f"{kind} {rate}" for kind, rate in pairs)


def _acceptance_rows(path: str) -> list[dict]:
    from triforce.errors import UserError

    try:
        data = json.loads(open(path, encoding="utf-8").read())
        if "tiers" in data:  # `eval acceptance --drafts`: each tier's acceptance in the decoding loop
            keep = ("draft", "temperature", "prompt_tokens", "budget", "gamma1", "gamma2", "acceptance_rates",
                    "per_token_rates")
            return [{k: r[k] for k in keep if k in r} for r in data["tiers"] if "draft" in r and "per_token_rates" in r]
        rows = data["results"]
        keep = ("policy", "budget", "chunk_size", "greedy_match", "expected_accept")
        return [{k: r[k] for k in keep if k in r} for r in rows if "policy" in r and "expected_accept" in r]
    except FileNotFoundError:
        raise UserError(f"acceptance file '{path}' does not exist") from None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(f"{path} is not the JSON of `triforce eval acceptance --json` ({e})") from None
