"""`triforce bench kernels` on a CPU: each vector width given by --lanes is timed as a row of its
own and runs the kernel of that width; a width the CPU lacks, or a bad one, is a one-line error."""
import json

import pytest

from triforce.cli.main import main
from triforce.kernels.cpu.linear import blocks
from triforce.kernels.cpu.linear.block_dot import WIDE_BLOCKS
from triforce.kernels.cpu.simd.f32_dot import HAS_F32_FMA

pytestmark = pytest.mark.skipif(not HAS_F32_FMA, reason="the block kernels' vectors need FMA and AVX2")


def _bench(capsys, *flags):
    with pytest.raises(SystemExit) as done:
        main(["bench", "kernels", "--arch", "smollm2-135m", "--rows", "1", "--formats", "q4_1", "--repeats", "2",
              "--json", *flags])
    assert done.value.code in (0, None)
    return json.loads(capsys.readouterr().out)


def test_each_width_is_a_row_and_runs_its_own_kernel(capsys, monkeypatch):
    ran = []
    for name in ("linear_q4_fma", "linear_q4_wide"):
        kernel = getattr(blocks, name)
        monkeypatch.setattr(blocks, name, lambda *args, kernel=kernel, name=name: ran.append(name) or kernel(*args))
    widths = [8, 16] if WIDE_BLOCKS else [8]
    out = _bench(capsys, "--lanes", ",".join(map(str, widths)))
    q4 = [r for r in out["rows"] if r["weights"] == "q4_1"]
    assert [r["lanes"] for r in q4] == widths * 4  # four projections
    assert all("lanes" not in r for r in out["rows"] if r["weights"] == "float")
    assert set(ran) == {("linear_q4_wide" if w == 16 else "linear_q4_fma") for w in widths}


@pytest.mark.parametrize("lanes, message", [("12", "'12' is not a vector width"),
                                            ("16", None if WIDE_BLOCKS else "no 16-lane block kernels")])
def test_bad_widths_are_refused(capsys, lanes, message):
    if message is None:
        pytest.skip("this CPU runs 16 lanes")
    with pytest.raises(SystemExit) as stop:
        main(["bench", "kernels", "--arch", "smollm2-135m", "--formats", "q4_1", "--lanes", lanes])
    assert stop.value.code == 2
    assert message in capsys.readouterr().err
