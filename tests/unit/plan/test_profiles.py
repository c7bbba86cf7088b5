"""Memory profiles: the shipped ones load, sizes parse, bad files name the bad field."""
import pytest

from triforce.offload.errors import OffloadError
from triforce.plan.profiles import (MemoryProfile, format_size, list_profiles, load_profile, parse_size,
                                    profile_to_toml)

SHIPPED = {"rtx4090-24g", "rtx4090-24g-display", "2x-rtx4090-24g", "rtx3090-24g", "rtx4080-16g", "h100-80g", "cpu"}


def test_every_shipped_profile_loads():
    profiles = {p.name: p for p in list_profiles()}
    assert SHIPPED <= set(profiles)
    assert profiles["2x-rtx4090-24g"].num_gpus == 2 and profiles["cpu"].num_gpus == 0
    card = profiles["rtx4090-24g"]
    assert card.gpu_bytes == 24 * 2**30 and card.device_budget_bytes == card.gpu_bytes - card.reserved_bytes
    assert round(profiles["rtx4090-24g-display"].device_budget_bytes / 2**30, 1) == 22.3  # a 4090 driving a display


@pytest.mark.parametrize("text,expected", [
    ("24GiB", 24 * 2**30), ("600MB", 600 * 10**6), ("1.5 GiB", int(1.5 * 2**30)), (4096, 4096), ("0", 0),
])
def test_sizes_parse(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["lots", "12 parsecs", "-3GB", True])
def test_bad_sizes_are_refused(bad):
    with pytest.raises(OffloadError, match="size"):
        parse_size(bad, "--device-budget")


def write(tmp_path, body):
    path = tmp_path / "mine.toml"
    path.write_text(body)
    return str(path)


GOOD = 'num_gpus = 1\ngpu_bytes = "8GiB"\nhost_bytes = "32GiB"\npcie_h2d_gbps = 12.5\nhbm_gbps = 400\n'


def test_a_profile_file_loads_and_round_trips(tmp_path):
    profile = load_profile(write(tmp_path, GOOD + "staging_block_bytes = 4096\nhost_attention_gbps = 40.0\n"
                                               "host_attention_tflops = 0.8\nblock_gbps = { q4_k = 700, q8_0 = 900.5 }\n"))
    assert profile.host_attention_gbps == 40.0 and profile.host_attention_tflops == 0.8
    assert profile.block_gbps == (("q4_k", 700.0), ("q8_0", 900.5)) and profile.block_tflops == ()
    assert profile.name == "mine" and profile.pcie_d2h_gbps == 12.5 and profile.reserved_bytes == 0
    again = load_profile(write(tmp_path, profile_to_toml(profile)))
    assert again.__dict__ | {"source": ""} == profile.__dict__ | {"source": ""}


@pytest.mark.parametrize("body,field", [
    (GOOD.replace('gpu_bytes = "8GiB"\n', ""), "gpu_bytes"),
    (GOOD.replace('"8GiB"', '"eight"'), "gpu_bytes"),
    (GOOD.replace("12.5", '"fast"'), "pcie_h2d_gbps"),
    (GOOD.replace("hbm_gbps = 400", "hbm_gbps = 0"), "hbm_gbps"),
    (GOOD.replace("num_gpus = 1", "num_gpus = -1"), "num_gpus"),
    (GOOD + 'reserved_bytes = "9GiB"\n', "reserved_bytes"),
    (GOOD + "host_attention_gbps = -3.0\n", "host_attention_gbps"),
    (GOOD + "block_gbps = { q4_k = 0 }\n", "block_gbps"),
    (GOOD + "block_tflops = 3.0\n", "block_tflops"),
])
def test_bad_fields_are_named(tmp_path, body, field):
    with pytest.raises(OffloadError, match=f"'{field}'"):
        load_profile(write(tmp_path, body))


def test_unknown_profile_and_broken_toml(tmp_path):
    with pytest.raises(OffloadError, match="unknown profile 'nope'.*rtx4090-24g"):
        load_profile("nope")
    with pytest.raises(OffloadError, match="not valid TOML"):
        load_profile(write(tmp_path, "num_gpus = = 1"))


def test_device_budget_override_and_formatting():
    p = load_profile("rtx4090-24g").with_device_budget(600 * 10**6)
    assert p.device_budget_bytes == 600 * 10**6
    assert format_size(3 * 2**30) == "3.00 GiB" and format_size(512) == "512 B"
    with pytest.raises(OffloadError):
        MemoryProfile("x", "", 1, 10, 0, 10, 0.0, 1.0, 1.0, 1)


def test_a_profile_missing_required_fields_names_them_all(tmp_path):
    body = GOOD.replace('gpu_bytes = "8GiB"\n', "").replace("hbm_gbps = 400\n", "")
    with pytest.raises(OffloadError, match="missing fields 'gpu_bytes', 'hbm_gbps'"):
        load_profile(write(tmp_path, body))


def test_a_write_cut_short_leaves_the_old_file(tmp_path, monkeypatch):
    import os

    from triforce.paths import write_atomically

    target = tmp_path / "p.toml"
    target.write_text("old")

    def full_disk(fd):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(OSError, match="No space"):
        write_atomically(target, "new " * 1000)
    assert target.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["p.toml"]
    monkeypatch.undo()
    write_atomically(target, "new")
    assert target.read_text() == "new"
