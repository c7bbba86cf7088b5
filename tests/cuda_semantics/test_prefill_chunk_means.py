"""A prefill through the offloaded cache averages the retrieval tier's chunks on the card as each
layer's keys go home (cache.offloaded.OffloadedKVCache.summarize_home). Before (issue 73) the
rebuild after a prefill read every host key back on the CPU, layer by layer, to average them
again: at 32K on the H200 that re-read was a suspect of the 6.17 s prefill against ~1.5 s of
FLOPs and copies."""
import pytest

from cli_json import run_json
from sync_budget import ONCE, PROMPT, REBUILD, small_block_profile
from triforce.decoding import engine
from triforce.cache.offloaded import OffloadedKVCache


LAYERS = 4


@pytest.fixture(scope="module")
def folder(tiny_model_dir):
    return str(tiny_model_dir("llama-gqa", max_position_embeddings=1024, num_layers=LAYERS))


def generate(capsys, card, folder, profile, monkeypatch, summarize: bool):
    """generate on the card, triforce with the KV offloaded; the host keys read back on the CPU
    while the prompt was prefilled and its retrieval cache built."""
    reads, prefilling, syncs = [], [], []
    read_keys, set_sequence = OffloadedKVCache._host_keys, engine.Engine.set_sequence

    def counted_read(self, layer, start, end):
        if prefilling:
            reads.append((layer, start, end))
        return read_keys(self, layer, start, end)

    def counted_prefill(self, *args, **kwargs):
        prefilling.append(True)
        before = len(tensors.syncs)
        try:
            return set_sequence(self, *args, **kwargs)
        finally:
            prefilling.clear()
            syncs.append(len(tensors.syncs) - before)

    with monkeypatch.context() as patch, card.placement() as tensors:  # the card's own patches stay
        patch.setattr(OffloadedKVCache, "_host_keys", counted_read)
        patch.setattr(engine.Engine, "set_sequence", counted_prefill)
        if not summarize:
            patch.setattr(OffloadedKVCache, "summarize_home", lambda *args: None)
        report = run_json(capsys, "generate", "--model", folder, "--prompt", PROMPT, "--device", "cuda",
                          "--max-new-tokens", 12, "--ignore-eos", "--json", "--budget", "48", "--chunk-size", "4",
                          "--method", "triforce", "--draft", "lookup", "--dtype", "float32", "--device-budget",
                          "3.0MB", "--profile", profile, "--temperature", "0")
    report["prefill_syncs"] = syncs[0]
    return report, reads


def test_a_prefill_averages_its_host_chunks_on_the_card(capsys, card, checked, folder, tmp_path, monkeypatch):
    profile = small_block_profile(tmp_path)
    on_card, reads = generate(capsys, card, folder, profile, monkeypatch, summarize=True)
    from_host, host_reads = generate(capsys, card, folder, profile, monkeypatch, summarize=False)
    print(f"prefill syncs: {on_card['prefill_syncs']} (host keys read back without the averaging: {len(host_reads)})")
    assert on_card["plan"]["offloaded"] and host_reads, "the run must have host KV for the rebuild to average"
    assert reads == [], f"the prefill's rebuild read host keys back on the CPU: {reads[:4]}"
    # one wait for every layer's chosen indices (the CPU gathers host KV by them), the rope table,
    # the prefetcher's one wait for the writes: 5 a layer at first, then one a layer (6 here)
    assert on_card["prefill_syncs"] <= REBUILD + ONCE, on_card["prefill_syncs"]
    # the same means (the same arithmetic on the same keys): the same selections, drafts and tokens
    assert on_card["tokens"] == from_host["tokens"]
    assert on_card["accepted"] == from_host["accepted"] and on_card["proposed"] == from_host["proposed"]
