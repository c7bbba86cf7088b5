"""A profile that `profile tune` began to write but did not finish is refused by name."""
from test_cli import assert_one_line_error, run_cli
from triforce.plan.profiles import TUNED_FOOTER, TUNED_HEADER, load_profile, profile_to_toml


def write(tmp_path, body):
    path = tmp_path / "mine.toml"
    path.write_text(body)
    return str(path)


def test_a_tuned_profile_cut_short_is_refused_through_the_cli(tmp_path, capsys):
    """A write of `profile tune` cut after its cpu_threads line: every required field is there,
    yet `plan --profile` refuses it, naming what is absent (it took defaults before)."""
    whole = TUNED_HEADER + profile_to_toml(load_profile("rtx4090-24g")) + TUNED_FOOTER
    assert load_profile(write(tmp_path, whole)).hbm_gbps == load_profile("rtx4090-24g").hbm_gbps
    cut = whole[:whole.index("\n", whole.index("cpu_threads")) + 1]
    code, _, err = run_cli(capsys, "plan", "--arch", "llama2-7b-128k", "--context", "8192",
                           "--profile", write(tmp_path, cut))
    assert_one_line_error(code, err, "cut short", "fields absent: measured, compute_tflops", "profile tune --out")
