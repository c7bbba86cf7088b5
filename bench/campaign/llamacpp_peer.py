"""llama.cpp's llama-bench on a GGUF file, as the campaign's peer: prefill and decode at context
depths for each KV type, on a card capped as a 24 GB one would be (llama.cpp allocates outside
PyTorch, so the cap is kept by placement: every layer on the card where weights and KV fit,
else the KV on the host with attention on the CPU (-nkvo), or the most layers that fit).

    python -m triforce.bench.campaign.llamacpp_peer --model FILE.gguf --depths 32768,131072 \\
        --kv f16,q8_0 --prefill 32768 --placement card --json

Where filling a deep context cannot fit a lease (KV on the host: llama.cpp attends on the CPU, a
128K prompt there takes hours), decoding is timed at two shallow depths and --extrapolate adds
rows at the deep ones on the line through them (decoding reads the weights once and the KV in
proportion to its depth), each labelled with the depths it came from.

The binary: --llama-bench, default .device-kit/llamacpp-cuda/llama-bench (bench/build_llamacpp_cuda.sh);
the card's torch brings the libcublas.so.13 it links (found through the nvidia package)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import click

DEFAULT_BINARY = ".device-kit/llamacpp-cuda/llama-bench"
KV_BYTES = {"f16": 2.0, "q8_0": 34 / 32}  # bytes per KV element


def library_path() -> str:
    """LD_LIBRARY_PATH with the nvidia wheels' CUDA 13 libraries (cuBLAS) first, where installed."""
    try:
        import nvidia
        extra = [str(Path(p) / "cu13" / "lib") for p in nvidia.__path__]
    except ImportError:
        extra = []
    return ":".join([*extra, os.environ.get("LD_LIBRARY_PATH", "")]).strip(":")


def unpacked(binary: str) -> str:
    """The binary, unpacked from its .xz beside it where only that is there (the kit carries the .xz)."""
    if Path(binary).is_file():
        return binary
    packed = Path(binary + ".xz")
    if not packed.is_file():
        raise click.ClickException(f"no llama-bench at {binary} (bash bench/build_llamacpp_cuda.sh builds one)")
    import lzma
    import tempfile

    out = Path(tempfile.gettempdir()) / "triforce-llama-bench"
    with lzma.open(packed) as src, open(out, "wb") as dst:
        while chunk := src.read(1 << 24):
            dst.write(chunk)
    out.chmod(0o755)
    return str(out)


def layers_that_fit(model: str, cap_gib: float, depth: int, kv: str) -> int:
    """The most layers whose weights and KV at `depth` fit `cap_gib` with the embedding, head and
    a 1.5 GiB margin for llama.cpp's compute buffers (assumed)."""
    from gguf import GGUFReader

    reader = GGUFReader(model)
    arch = reader.fields["general.architecture"].contents()
    layers = int(reader.fields[f"{arch}.block_count"].contents())
    kv_heads = int(reader.fields[f"{arch}.attention.head_count_kv"].contents())
    key_len = int(reader.fields[f"{arch}.attention.key_length"].contents())
    per_layer = sum(int(t.n_bytes) for t in reader.tensors if t.name.startswith("blk.")) / layers
    rest = sum(int(t.n_bytes) for t in reader.tensors if not t.name.startswith("blk."))
    kv_per_layer = 2 * kv_heads * key_len * depth * KV_BYTES[kv]
    room = cap_gib * 2**30 - rest - 1.5 * 2**30
    return max(0, min(layers, int(room // (per_layer + kv_per_layer))))


def run_bench(binary: str, model: str, args: list[str], repeats: int) -> list[dict]:
    cmd = [binary, "-m", model, "-fa", "on", "-r", str(repeats), "-o", "json", *args]
    done = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, LD_LIBRARY_PATH=library_path()))
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise RuntimeError(f"llama-bench exited {done.returncode}: {' | '.join(tail)}")
    return json.loads(done.stdout)


def rows_for(binary: str, model: str, kv: str, placement: list[str], depths: list[int], prefill: list[int],
             new_tokens: int, repeats: int) -> list[dict]:
    common = ["-ctk", kv, "-ctv", kv, *placement]
    found = []
    if prefill:
        found += run_bench(binary, model, [*common, "-p", ",".join(map(str, prefill)), "-n", "0"], repeats)
    found += run_bench(binary, model, [*common, "-p", "0", "-n", str(new_tokens), "-d", ",".join(map(str, depths))],
                       repeats)
    rows = []
    for r in found:
        decode = r["n_gen"] > 0
        rate = float(r["avg_ts"])
        rows.append({"kv": kv, "placement": " ".join(placement), "test": "decode" if decode else "prefill",
                     "depth": int(r.get("n_depth", 0)), "tokens": int(r["n_gen"] or r["n_prompt"]),
                     "tokens_per_s": round(rate, 2), "spread": round(float(r.get("stddev_ts", 0.0)), 2),
                     "ms_per_token" if decode else "seconds": round(1000 / rate, 3) if decode
                     else round(r["n_prompt"] / rate, 3)})
    return rows


def extrapolated(rows: list[dict], depths: list[int]) -> list[dict]:
    """Decode rows at `depths` on the least-squares line of ms/token against depth through each
    KV type and placement's measured decode rows (two depths or more), labelled as such."""
    out = []
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        if r["test"] == "decode" and "extrapolated_from" not in r:
            groups.setdefault((r["kv"], r["placement"]), []).append(r)
    for (kv, placement), measured in groups.items():
        xs = [r["depth"] for r in measured]
        if len(set(xs)) < 2:
            continue
        ys = [r["ms_per_token"] for r in measured]
        mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
        slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / sum((x - mean_x) ** 2 for x in xs)
        for depth in depths:
            ms = mean_y + slope * (depth - mean_x)
            out.append({"kv": kv, "placement": placement, "test": "decode", "depth": depth,
                        "tokens": measured[0]["tokens"], "tokens_per_s": round(1000 / ms, 2), "spread": None,
                        "ms_per_token": round(ms, 3), "extrapolated_from": sorted(set(xs))})
    return out


@click.command()
@click.option("--model", required=True, help="The GGUF file.")
@click.option("--llama-bench", "binary", default=DEFAULT_BINARY, show_default=True)
@click.option("--depths", default="32768,131072", show_default=True, help="Context depths decoded at.")
@click.option("--kv", default="f16,q8_0", show_default=True, help="KV cache types (llama.cpp's -ctk/-ctv).")
@click.option("--prefill", default="32768", show_default=True,
              help="Prompt lengths prefilled, comma-separated (0: none).")
@click.option("--extrapolate", default="", help="Deeper depths to add decode rows at, on the line through the "
                                                "measured ones (labelled extrapolated).")
@click.option("--new-tokens", type=int, default=32, show_default=True)
@click.option("--repeats", type=int, default=2, show_default=True)
@click.option("--placement", default="card", show_default=True,
              help="card: every layer on the card (-ngl 99); host-kv: KV on the host, attention on the CPU "
                   "(-ngl 99 -nkvo 1); fit:GiB: the most layers that fit a card of that size at the deepest depth; "
                   "cpu: no card (-ngl 0). Several, comma-separated: each is run and its rows kept.")
@click.option("--threads", type=int, default=None, help="CPU threads (llama-bench -t; default: its own).")
@click.option("--json", "as_json", is_flag=True)
def main(model, binary, depths, kv, prefill, extrapolate, new_tokens, repeats, placement, threads, as_json):
    """llama-bench on MODEL at each depth and KV type (see the module docstring)."""
    if not Path(model).is_file():
        raise click.ClickException(f"no GGUF file at {model} (the campaign's desktop-file steps write them)")
    binary = unpacked(binary)
    depth_list = [int(d) for d in depths.split(",")]
    prefills = [n for n in (int(p) for p in prefill.split(",")) if n > 0]
    deeper = [int(d) for d in extrapolate.split(",") if d.strip()]
    rows, failures = [], []
    for kind in kv.split(","):
        for place in placement.split(","):
            if place.startswith("fit:"):
                n = layers_that_fit(model, float(place[4:]), max(depth_list + deeper), kind)
                flags = ["-ngl", str(n)]
            else:
                flags = {"card": ["-ngl", "99"], "host-kv": ["-ngl", "99", "-nkvo", "1"], "cpu": ["-ngl", "0"]}[place]
            flags += ["-t", str(threads)] if threads else []
            try:
                rows += rows_for(binary, model, kind, flags, depth_list, prefills, new_tokens, repeats)
            except (RuntimeError, ValueError, KeyError) as e:  # out of memory at a depth is a result
                failures.append({"kv": kind, "placement": " ".join(flags), "error": str(e)})
            print(f"llama-bench {kind} {' '.join(flags)}: {len(rows)} rows, {len(failures)} failures", file=sys.stderr)
    rows += extrapolated(rows, deeper)
    result = {"peer": "llama.cpp", "binary": binary, "model": model, "rows": rows, "failures": failures}
    if as_json:
        print(json.dumps(result))
    else:
        for r in rows:
            print(r)
    if not rows:
        sys.exit(1)


if __name__ == "__main__":
    main()
