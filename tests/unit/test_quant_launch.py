"""How the block kernels are launched on a card (triforce.kernels.cuda.quant_launch), planned
without a card: every projection of the models people run on a 24 GB card keeps every SM of a
4090 (128) and an H100/H200 (132) loading, at every pass size a run takes."""
import pytest

from triforce.config.model import ModelConfig
from triforce.kernels.cuda.quant_launch import GEMV_ROWS, Tiles, plan, too_small_to_split
from triforce.model.architectures import arch_hf_config

ARCHS = ("llama3.1-8b", "qwen3-8b-128k", "qwen3-32b-128k", "gemma3-27b")
ROWS = (1, 2, 3, 4, 5, 8, 16, 17, 32, 64)
SMS = (128, 132)


def projections(arch: str) -> dict[str, tuple[int, int]]:
    """[out, in] of every projection a layer runs, fused where a file's formats allow and apart
    where they do not (a Q4_K_M file's q6_k value projections), and the logits."""
    cfg = ModelConfig.from_hf(arch_hf_config(arch))
    q, kv, h, f = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.hidden_size, cfg.intermediate_size
    return {"q": (q, h), "k": (kv, h), "v": (kv, h), "qkv": (q + 2 * kv, h), "o": (h, q), "gate": (f, h),
            "gate_up": (2 * f, h), "down": (h, f), "logits": (cfg.vocab_size, h)}


def starved(launch, k: int, sms: int) -> bool:
    return launch.programs < 2 * sms and not too_small_to_split(launch, k)


@pytest.mark.parametrize("arch", ARCHS)
def test_every_projection_fills_the_card_twice_at_every_pass_size(arch):
    misses = [f"{name} {n}x{k} rows {m} float32={f32} sms {sms}: {launch}"
              for name, (n, k) in projections(arch).items() for m in ROWS for f32 in (False, True)
              for sms in SMS if starved(launch := plan(m, n, k, f32, sms), k, sms)]
    assert not misses, misses[:5]


def test_the_tiles_shipped_before_left_the_card_idle():
    """What the check above catches: split 1 and 32-row tiles gave a 4096-row projection 128
    programs (the H200's q4_k o projection at one row: 10.6x its floor)."""
    before = Tiles(32, 8, 4, 3, 1)
    assert starved(plan(1, 4096, 4096, False, 132, before), 4096, 132)
    assert starved(plan(16, 1024, 4096, False, 128, before), 4096, 128)


def test_a_short_pass_splits_by_its_matrix_alone_and_decoding_takes_no_dot():
    """float32's greedy equality with ar on a card needs a row summed in one order in a decoding
    step and in a verify pass: one kernel and one split for every width up to 64."""
    for n, k in ((1024, 4096), (4096, 14336), (128256, 4096)):
        float32 = {plan(m, n, k, True, 132).tiles for m in (1, 3, 16, 64)}
        assert len(float32) == 1 and plan(1, n, k, True).kernel == "dot"
    assert {plan(m, 4096, 4096, False).kernel for m in range(1, GEMV_ROWS + 1)} == {"gemv"}
    assert plan(GEMV_ROWS + 1, 4096, 4096, False).kernel == "dot"
    assert plan(1, 4096, 4096, False).block_m == 1 and plan(3, 4096, 4096, False).block_m == 4


def test_a_split_keeps_whole_steps_and_enough_columns_per_program():
    for n, k in ((64, 256), (16, 4096), (1024, 4096), (5120, 25600)):
        launch = plan(1, n, k, False, 132)
        blocks_per_program = -(-(k // 32) // launch.tiles.split)
        assert launch.tiles.split == 1 or blocks_per_program >= 8
        assert launch.tiles.split <= -(-(k // 32) // launch.tiles.step)
    tall = plan(4096, 4096, 4096, False, 132)  # a prefill has programs enough without a split
    assert tall.kernel == "dot" and tall.block_m == 64 and tall.tiles.split == 1
    assert plan(2, 4096, 4096, False, 132, Tiles.parse("8:8:4:3:2")).grid == (1, 512, 2)


def test_a_sweep_makes_table_entries_a_card_plans_with(tmp_path):
    """bench kernels --tiles ... --write-table: the fastest tiles per kernel, format and shape,
    merged under the card's capability; plan takes them for short passes of that shape only."""
    from triforce.bench.quant_kernels import fastest_tiles, write_table
    from triforce.kernels.cuda.quant_launch import measured_tiles

    def row(tiles, ms, rows=1, kind="q4_k"):
        launch = plan(rows, 4096, 4096, False, 128, Tiles.parse(tiles))
        return {"matrix": "o", "shape": [4096, 4096], "weights": kind, "rows": rows, "ms": ms, "tiles": tiles,
                "kernel": launch.kernel, "launch_tiles": str(launch.tiles)}

    rows = [row("16:8:4:3:auto", 0.020), row("32:8:4:3:4", 0.015), row("64:8:8:3:2", 0.03, rows=16),
            row("32:8:4:3:auto", 0.02, rows=16), row("16:8:4:3:8", 0.01, kind="q6_k"),
            {"matrix": "o", "shape": [4096, 4096], "weights": "float", "rows": 1, "ms": 0.001}]
    entries = fastest_tiles(rows)
    assert entries == {"dot q4_k 4096x4096": "32:8:4:3:2", "gemv q4_k 4096x4096": "32:8:4:3:4",
                       "gemv q6_k 4096x4096": "16:8:4:3:8"}
    path = tmp_path / "tile_table.json"
    write_table(path, "9.0", {"gemv q4_k 14336x4096": "16:4:4:3:2"})
    write_table(path, "8.9", entries)
    write_table(path, "9.0", entries)
    table = measured_tiles("9.0", path)
    assert len(table) == 4 and measured_tiles("7.5", path) == {} and measured_tiles("9.0", tmp_path / "none") == {}
    assert plan(1, 4096, 4096, False, 132, kind="q4_k", table=table).tiles == Tiles(32, 8, 4, 3, 4)
    assert plan(3, 4096, 4096, False, 132, kind="q6_k", table=table).tiles == Tiles(16, 8, 4, 3, 8)
    assert plan(1, 4096, 4096, False, 132, kind="q8_0", table=table).tiles == plan(1, 4096, 4096, False, 132).tiles
    assert plan(4096, 4096, 4096, False, 132, kind="q4_k", table=table).tiles.block_n == 32  # prefill: defaults


def test_the_plan_holds_the_block_kernels_split_sums(capsys):
    """Issue 74: every byte a run allocates is in its plan, the block kernels' scratch too: their
    largest buffer of split sums (3 MiB for Llama-3.1-8B), which blocks_linear makes as
    [split, rows, out] float32 for a pass whose columns are split."""
    import json

    from triforce.cli.main import main
    from triforce.kernels.cuda.quant_launch import SHORT_PASS, split_sums_bytes

    def workspaces(*flags):
        with pytest.raises(SystemExit):
            main(["plan", "--arch", "llama3.1-8b", "--context", "32K", "--profile", "rtx4090-24g", "--json", *flags])
        return json.loads(capsys.readouterr().out)["breakdown"]["matmul_workspaces"]

    shapes = projections("llama3.1-8b").values()
    expected = split_sums_bytes(shapes, (1, 4, SHORT_PASS, 1024))
    launch = plan(SHORT_PASS, 6144, 4096, False)  # the fused q/k/v at the widest verify: split in two
    assert launch.tiles.split == 2 and expected >= 2 * SHORT_PASS * 6144 * 4
    assert workspaces("--quantize", "q4_k") - workspaces() == expected == 3 << 20
