"""The host-sync budget of a decoding run, shared by the simulated card's test
(tests/cuda_semantics/test_sync_budget.py) and the GPU's (tests/gpu/test_offload_cuda.py).

One sync per drafted token (the drafting tier picks it on the host), two per full verify (its
verdict or token, and one wait for the host KV writes before the CPU reads them), REBUILD per
retrieval rebuild, and ONCE per run (the rope table's first copy and the like). Not per layer of
a pass, not per draft of a verdict.
A rebuild over host KV scores every chunk on the device (host chunks' means copied over from
pinned memory) and waits once for every layer's chosen indices, which the CPU gathers host KV by
(cache.offloaded.OffloadedKVCache.gather_layers: one wait a group of layers whose host staging fits 64 MiB,
one group for these tests' models). Before issue 73 it waited 5 times a layer (the query to the
host, scores back, the indices, and the gathered keys and values back blocking), then once a layer."""
from importlib import resources

REBUILD = 1
ONCE = 4
PROMPT = "the cat sat on the mat. the cat sat on the hat. the cat and the dog sat on the log. the cat sat on" * 8


def small_block_profile(folder) -> str:
    """An RTX 4090's rates (the hybrid verify on) with blocks small enough that a tiny model's
    host KV spans several per layer (so the CPU takes some): the profile file's path."""
    text = resources.files("triforce.profiles").joinpath("rtx4090-24g.toml").read_text()
    path = folder / "small-blocks.toml"
    path.write_text(text.replace('name = "rtx4090-24g"', 'name = "small-blocks"') + "staging_block_bytes = 32768\n")
    return str(path)


def allowed_syncs(report: dict) -> int:
    """The budget of a `generate --json --count-syncs` report."""
    drafted = sum(report["proposed"].values())
    return drafted + 2 * report["full_verifies"] + REBUILD * report["rebuilds"] + ONCE
