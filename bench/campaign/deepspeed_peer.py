"""DeepSpeed ZeRO-Inference as the campaign's peer, the real one: DeepSpeed from PyPI and the
transformers fork its KV offload needs (the kit bench/build_deepspeed_kit.sh makes), on random
weights of a named architecture, at several prompt lengths; then our `bench offload` rows at each
length it ran, in the same call on the same card.

    python -m triforce.bench.campaign.deepspeed_peer --contexts 4096,8192,16384 --arch llama2-7b-128k \\
        --ours ar-offload,triforce --json [-- BENCH OFFLOAD FLAGS]

The kit's wheels are installed into a folder of their own (--site) that only the peer's process
sees (zero_inference_child.py), so triforce keeps its own transformers. Its prefill attends with
the full score matrix, so long prompts run out of memory: each such length is a result, recorded
with the error; ours run at the lengths it ran (the ratios are measured side by side)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import click

from triforce.bench.campaign.work import TRACE
from triforce.bench.harness import last_json

DEFAULT_KIT = ".device-kit/deepspeed"
# what the card's image lacks beside the kit's wheels is none (its package list has msgpack,
# py-cpuinfo, pydantic, ninja, accelerate); a CPU without them installs them into the site from
# the package index (the CPU rehearsal only)
REHEARSAL_EXTRAS = ("msgpack", "py-cpuinfo")


def installed_site(kit: Path, site: Path) -> Path:
    """The kit's wheels installed into `site` (once per kit version)."""
    version = (kit / "VERSION").read_text() if (kit / "VERSION").is_file() else None
    if version is None or not list((kit / "wheels").glob("*.whl")):
        raise click.ClickException(f"no DeepSpeed kit at {kit} (bash bench/build_deepspeed_kit.sh FORK EXAMPLES "
                                   f"{kit} makes one)")
    stamp = site / ".kit-version"
    if stamp.is_file() and stamp.read_text() == version:
        return site
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile", "--upgrade", "--target", str(site)]
    subprocess.run([*pip, "--no-index", *map(str, sorted((kit / "wheels").glob("*.whl")))], check=True, timeout=600)
    missing = [m for m in REHEARSAL_EXTRAS if not _importable(m.replace("py-", "").replace("-", "_"))]
    if missing:
        subprocess.run([*pip, *missing], check=True, timeout=600)
    stamp.write_text(version)
    return site


def _importable(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def model_folder(arch: str, longest: int, folder: Path) -> Path:
    """A config.json the fork's transformers reads for `arch`'s shape (Llama only), positions for
    `longest` tokens (the fork caches RoPE tables that long in every layer)."""
    from triforce.errors import UserError
    from triforce.model.architectures import arch_config

    try:
        c = arch_config(arch)
    except UserError as e:
        raise click.ClickException(str(e)) from None
    if c.model_type != "llama":
        raise click.ClickException(f"the fork's KV offload is for Llama (and OPT, BLOOM): {arch} is {c.model_type}")
    folder.mkdir(parents=True, exist_ok=True)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": c.vocab_size,
              "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
              "num_hidden_layers": c.num_layers, "num_attention_heads": c.num_heads,
              "num_key_value_heads": c.num_kv_heads, "rms_norm_eps": c.rms_norm_eps,
              "max_position_embeddings": longest, "rope_theta": 10000.0, "hidden_act": "silu",
              "tie_word_embeddings": c.tie_word_embeddings, "bos_token_id": 1, "eos_token_id": 2,
              "torch_dtype": "float16", "use_cache": True}
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    return folder


def run_peer(kit: Path, site: Path, folder: Path, contexts: list[int], new_tokens: int, dtype: str,
             timeout_s: float) -> dict:
    cap = os.environ.get("TRIFORCE_CAP_GB")  # the campaign's cap, kept for the peer's own process
    launcher = ["-m", "triforce.bench.campaign.capped", "--gb", cap, "--"] if cap else []
    cmd = [sys.executable, *launcher, "-m", "triforce.bench.campaign.zero_inference_child", "--model-dir", str(folder),
           "--contexts", ",".join(map(str, contexts)), "--new-tokens", str(new_tokens), "--dtype", dtype]
    path = os.pathsep.join([str(site), str(kit / "zero_inference"), os.environ.get("PYTHONPATH", "")]).strip(os.pathsep)
    env = dict(os.environ, PYTHONPATH=path, PYTHONUNBUFFERED="1", MASTER_PORT=os.environ.get("MASTER_PORT", "29517"))
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        return {"rows": [], "failures": [{"context": None, "error": f"no answer within {timeout_s:.0f} s"}]}
    found = last_json(done.stdout)
    if done.returncode != 0 or found is None:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        return {"rows": [], "failures": [{"context": None, "error": f"exited {done.returncode}: {' | '.join(tail)}"}]}
    return found


def run_ours(arch: str, context: int, methods: str, bench_args: tuple[str, ...], timeout_s: float) -> dict:
    import tempfile

    plot = str(Path(tempfile.gettempdir()) / f"triforce-deepspeed-ours-{context}.png")
    cmd = [sys.executable, "-m", "triforce.cli.main", "bench", "offload", "--arch", arch, "--context", str(context),
           "--methods", methods, "--acceptance-trace", TRACE, "--plot", plot, *bench_args, "--json"]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"context": context, "error": f"no answer within {timeout_s:.0f} s"}
    found = last_json(done.stdout)
    if done.returncode != 0 or found is None:
        return {"context": context, "error": ((done.stderr or done.stdout).strip().splitlines() or ["no output"])[-1]}
    return {"context": context, "rows": [{k: r.get(k) for k in ("method", "ms_per_token", "peak_gpu_bytes")}
                                         for r in found.get("rows", [])]}


@click.command(context_settings={"ignore_unknown_options": True})
@click.option("--contexts", default="4096,8192,16384", show_default=True, help="Prompt lengths, ascending.")
@click.option("--arch", default="llama2-7b-128k", show_default=True, help="The shape (random weights; Llama).")
@click.option("--new-tokens", type=int, default=8, show_default=True, help="Tokens each length decodes.")
@click.option("--ours", default="ar-offload,triforce", show_default=True,
              help="Our `bench offload` methods run at each length the peer ran ('': none).")
@click.option("--kit", default=DEFAULT_KIT, show_default=True, help="bench/build_deepspeed_kit.sh's output.")
@click.option("--site", default=None, help="Where the kit's wheels are installed (default: a folder in /tmp).")
@click.option("--reduced", is_flag=True, help="The CPU rehearsal: float32, our rows on a small budget.")
@click.option("--timeout-s", type=float, default=300, show_default=True, help="Each process's limit.")
@click.option("--json", "as_json", is_flag=True)
@click.argument("bench_args", nargs=-1, type=click.UNPROCESSED)
def main(contexts, arch, new_tokens, ours, kit, site, reduced, timeout_s, as_json, bench_args):
    """DeepSpeed ZeRO-Inference at each length, our rows beside it (see the module docstring)."""
    import tempfile

    lengths = sorted(int(c) for c in contexts.split(","))
    kit_path = Path(kit)
    site_path = installed_site(kit_path, Path(site or Path(tempfile.gettempdir()) / "triforce-deepspeed-site"))
    folder = model_folder(arch, max(lengths) + new_tokens, Path(tempfile.gettempdir()) / f"triforce-deepspeed-{arch}")
    print(f"DeepSpeed ZeRO-Inference on {arch} (random weights) at {lengths} ...", file=sys.stderr, flush=True)
    peer = run_peer(kit_path, site_path, folder, lengths, new_tokens, "float32" if reduced else "float16", timeout_s)
    ran = [r["context"] for r in peer.get("rows", [])]
    flags = bench_args or (("--device-budget", "4.5MB", "--budget", "256", "--draft", "lookup", "--dtype", "float32",
                            "--new-tokens", "4", "--speculative-tokens", "8", "--repeats", "1") if reduced else
                           ("--profile", "rtx4090-24g", "--dtype", "bfloat16", "--new-tokens", "8",
                            "--speculative-tokens", "32", "--repeats", "2"))
    beside = [run_ours(arch, c, ours, flags, timeout_s) for c in ran] if ours else []
    result = {"peer": "deepspeed-zero-inference", "arch": arch, "kit": (kit_path / "VERSION").read_text().strip(),
              "kv_offload": peer.get("kv_offload"), "rows": peer.get("rows", []), "failures": peer.get("failures", []),
              "ours": beside}
    if as_json:
        print(json.dumps(result))
    else:
        print(json.dumps(result, indent=1))
    if not result["rows"] and any(f["context"] is None for f in result["failures"]):
        sys.exit(1)  # the peer never ran (out of memory at a length is a result, not a failure)


if __name__ == "__main__":
    main()
