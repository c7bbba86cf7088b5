"""Offloading from the command line: plan, profile, generate on a device budget that forces
offloading (the real default model), acceptance traces and `bench offload`."""
import json

import pytest

from triforce.cli.main import main
from triforce.config import SamplingParams, SpecParams
from triforce.decoding.acceptance_trace import ReplayVerifier, load_trace
from triforce.decoding.engine import Engine
from triforce.decoding.hooks import EngineHooks
from triforce.model.loading import load_model
from test_cli import assert_one_line_error, run_cli


def test_plan_json_for_an_architecture(capsys):
    code, out, _ = run_cli(capsys, "plan", "--arch", "llama2-7b-128k", "--profile", "rtx4090-24g",
                           "--context", "130048", "--json")
    plan = json.loads(out)
    assert code == 0 and plan["feasible"] and plan["offloaded"]
    assert plan["host_kv_bytes"] >= 40 * 2**30 and plan["gpu_bytes_total"] <= plan["gpu_budget_bytes"]
    assert sum(plan["breakdown"].values()) == plan["gpu_bytes_total"]
    assert plan["predictions"]["triforce_ms_per_token"] < plan["predictions"]["ar_offload_ms_per_token"]


def test_plan_table_and_an_infeasible_request(capsys):
    code, out, _ = run_cli(capsys, "plan", "--arch", "llama2-13b-128k", "--profile", "2x-rtx4090-24g", "--tp", "2",
                           "--context", "130048")
    assert code == 0 and "stream from the host" in out and "predicted:" in out
    code, out, err = run_cli(capsys, "plan", "--arch", "llama2-13b-128k", "--profile", "rtx4090-24g",
                             "--context", "130048")
    assert "target_weights" in out
    assert_one_line_error(code, err, "does not fit", "--tp 2")


def test_plan_counts_block_quantized_weights(capsys):
    """Llama-3.1-8B at 128K on a 24 GB card: in bfloat16 its 15 GiB of weights push most of the KV
    to the host; as q4_k blocks (4.75 bits a weight, as the Triton kernels hold them) the whole KV
    stays on the card. The 32B-class north star fits with its KV offloaded."""
    base = ["plan", "--arch", "llama3.1-8b", "--profile", "rtx4090-24g", "--context", "131072", "--json"]
    plain = json.loads(run_cli(capsys, *base)[1])
    code, out, _ = run_cli(capsys, *base, "--quantize", "q4_k")
    q4k = json.loads(out)
    assert code == 0 and plain["offloaded"] and not q4k["offloaded"] and q4k["weight_format"] == "q4_k"
    assert q4k["breakdown"]["target_weights"] < 0.3 * plain["breakdown"]["target_weights"]
    code, out, _ = run_cli(capsys, "plan", "--arch", "qwen2.5-32b-128k", "--profile", "rtx4090-24g", "--context",
                           "131072", "--quantize", "q4_k")
    assert code == 0 and "weights as q4_k blocks" in out and "stream from the host" in out
    code, _, err = run_cli(capsys, *base, "--quantize", "q4_k", "--batch-size", "2")
    assert_one_line_error(code, err, "--quantize is planned for one sequence")


@pytest.mark.parametrize("arch", ["gemma3-4b", "gemma3-12b", "gemma3-27b"])
def test_gemma3_plans_at_its_real_shapes(capsys, arch):
    """Gemma 3 by name: five windowed layers to each global one, the shapes transformers' own config
    gives; each plans for 128K on a 24 GB card as q4_k blocks (the 27B's queries scaled by 1/sqrt(168),
    not its 128-wide heads), the 4B's KV on the card, the larger ones' streamed from the host: every
    layer holds its whole KV so far, windowed ones included."""
    from triforce.config.model import ModelConfig
    from triforce.model.architectures import arch_config, arch_hf_config

    cfg = arch_config(arch)
    assert cfg == ModelConfig.from_hf(arch_hf_config(arch)) and cfg.gemma_norms and cfg.qk_norm
    assert cfg.sliding_windows[:6] == (1024,) * 5 + (None,) and cfg.activation == "gelu_pytorch_tanh"
    assert (cfg.query_scale is None) == (arch != "gemma3-27b")
    code, out, err = run_cli(capsys, "plan", "--arch", arch, "--profile", "rtx4090-24g", "--context", "131072",
                             "--quantize", "q4_k", "--json")
    plan = json.loads(out)
    assert code == 0 and plan["feasible"] and plan["weight_format"] == "q4_k", err
    assert plan["offloaded"] == (arch != "gemma3-4b")


def test_plan_reads_a_real_models_shapes(capsys, default_model_dir):
    code, out, _ = run_cli(capsys, "plan", "--model", "default", "--context", "8192", "--method", "ar", "--json")
    plan = json.loads(out)
    assert code == 0 and plan["feasible"] and not plan["offloaded"] and plan["profile"] == "cpu"


@pytest.mark.parametrize("args,fragment", [
    (["--arch", "nope", "--context", "10"], "unknown architecture"),
    (["--arch", "llama2-7b-128k", "--context", "0"], "--context"),
    (["--arch", "llama2-7b-128k", "--context", "10", "--profile", "nope"], "unknown profile"),
    (["--arch", "llama2-7b-128k", "--context", "10", "--device-budget", "lots"], "--device-budget"),
    (["--context", "10"], "exactly one of --model and --arch"),
])
def test_plan_bad_input(capsys, args, fragment):
    code, _, err = run_cli(capsys, "plan", *args)
    assert_one_line_error(code, err, fragment)


def test_profile_list_and_show(capsys, tmp_path):
    code, out, _ = run_cli(capsys, "profile", "list")
    assert code == 0 and "rtx4090-24g" in out and "2x-rtx4090-24g" in out
    code, out, _ = run_cli(capsys, "profile", "show", "h100-80g", "--json")
    assert code == 0 and json.loads(out)["num_gpus"] == 1
    bad = tmp_path / "bad.toml"
    bad.write_text('num_gpus = 1\ngpu_bytes = "lots"\nhost_bytes = 1\npcie_h2d_gbps = 1.0\nhbm_gbps = 1.0\n')
    code, _, err = run_cli(capsys, "profile", "show", str(bad))
    assert_one_line_error(code, err, "'gpu_bytes'")


@pytest.fixture(scope="module")
def needle_4k(tmp_path_factory, default_model_dir):
    """A ~4K-token needle prompt in natural text, the key early (the 135M model finds a key early in
    a long prompt, not at depth 0.5 or 0.9): (its file, the key)."""
    import contextlib
    import io

    path = tmp_path_factory.mktemp("needle") / "needle.txt"
    printed = io.StringIO()
    with pytest.raises(SystemExit), contextlib.redirect_stdout(printed):
        main(["eval", "needle", "--context", "4000", "--depth", "0.1", "--out", str(path)])
    return str(path), json.loads(printed.getvalue())["key"]


def generate_json(capsys, *args):
    """Float weights (--quantize none): the budgets below were sized for their 538 MB."""
    code, out, err = run_cli(capsys, "generate", "--max-new-tokens", "10", "--temperature", "0", "--quantize", "none",
                             "--json", *args)
    assert code == 0, err
    return json.loads(out)


@pytest.mark.slow
def test_default_model_finds_the_needle_and_offloading_keeps_its_tokens(capsys, needle_4k):
    """The long-prompt acceptance check on the real model: AR finds the key; on a 600 MB budget
    (the default method) most KV lives on the host and the tokens are AR's; triforce with lookup
    drafts, offloaded on 700 MB, gives them too, more than one token per full verify. (One
    prompt for all three: each prefill of 4K tokens takes ~9 s on two cores.)"""
    path, key = needle_4k
    resident = generate_json(capsys, "--prompt-file", path, "--method", "ar")
    assert not resident["plan"]["offloaded"] and key in resident["text"] and resident["prompt_tokens"] > 3800
    small = generate_json(capsys, "--prompt-file", path, "--device-budget", "600MB")
    plan = small["plan"]
    assert plan["offloaded"] and plan["gpu_bytes_total"] <= 600 * 10**6
    assert plan["host_kv_bytes"] > 0.9 * (plan["host_kv_bytes"] + plan["resident_kv_bytes"])
    assert small["tokens"] == resident["tokens"]
    tri = generate_json(capsys, "--prompt-file", path, "--device-budget", "700MB", "--method", "triforce",
                        "--draft", "lookup", "--budget", "256")
    assert tri["plan"]["offloaded"] and tri["tokens"] == resident["tokens"]
    assert tri["mean_tokens_per_full_verify"] > 1


def test_a_budget_below_the_weights_is_a_clear_error(capsys, needle_4k):
    code, _, err = run_cli(capsys, "generate", "--prompt-file", needle_4k[0], "--device-budget", "100MB")
    assert_one_line_error(code, err, "does not fit", "target_weights")


@pytest.fixture(scope="module")
def recorded(tmp_path_factory, tiny_model_dir):
    """A trace recorded from a tiny real model's triforce run, and that run's JSON."""
    folder = tiny_model_dir("llama-gqa", max_position_embeddings=512)
    trace = tmp_path_factory.mktemp("trace") / "trace.json"
    prompt = "the cat sat on the mat. the cat sat on the hat. the cat and the dog. the cat"
    with pytest.raises(SystemExit):
        main(["generate", "--model", str(folder), "--prompt", prompt, "--method", "triforce", "--budget", "24",
              "--chunk-size", "4", "--gamma1", "3", "--gamma2", "5", "--max-new-tokens", "40", "--ignore-eos",
              "--record-acceptance", str(trace), "--json"])
    return folder, trace, prompt


def test_recorded_trace_matches_the_runs_statistics(recorded, capsys):
    folder, trace_path, prompt = recorded
    trace = load_trace(trace_path)
    assert trace["gamma2"] == 5 and set(trace["levels"]) == {"retrieval", "full"}
    full = trace["levels"]["full"]
    assert all(0 <= a <= p <= 5 for p, a in full)
    # replaying the trace reproduces the run's accept/reject sequence
    lm = load_model(str(folder), dtype="float32", device="cpu")
    spec = SpecParams(method="triforce", budget=24, chunk_size=4, gamma1=3, gamma2=5)
    ids = lm.tokenizer(prompt).input_ids
    engine = Engine(lm, spec, len(ids) + 40, "lookup", hooks=EngineHooks(replay=ReplayVerifier(trace)))
    engine.set_sequence(ids)
    engine.generate(40, SamplingParams(), frozenset())
    assert [a for name, _, a in engine.rounds if name == "full"] == [a for _, a in full]


def test_bench_offload_on_a_tiny_architecture(recorded, capsys, tmp_path):
    _, trace, _ = recorded
    plot = tmp_path / "bench.png"
    code, out, err = run_cli(capsys, "bench", "offload", "--arch", "tiny-test", "--context", "600",
                             "--device-budget", "2.5MB", "--acceptance-trace", str(trace), "--draft", "lookup",
                             "--new-tokens", "6", "--budget", "64", "--plot", str(plot), "--json")
    assert code == 0, err
    result = json.loads(out)
    rows = {r["method"]: r for r in result["rows"]}
    assert set(rows) == {"ar-offload", "ar-hybrid", "zero-inference", "triforce"}
    assert all(r["ms_per_token"] > 0 for r in rows.values())
    assert rows["ar-offload"]["resident_tokens"] < 600 and rows["ar-offload"]["pcie_bytes_per_token"] > 0
    assert rows["triforce"]["replayed"] and result["pinned_h2d_gbps"] > 0
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # beside each measured row, what the cost model predicts for this model on a 4090's 25 GB/s link
    assert result["predicted_4090"].startswith("predicted by the cost model on rtx4090-24g (25 GB/s")
    assert all(rows[m]["predicted_4090_ms_per_token"] > 0 for m in ("ar-offload", "ar-hybrid", "triforce"))
    assert rows["zero-inference"].get("predicted_4090_ms_per_token") is None
    # what --method auto would run here, whose measured row is that method's
    assert result["auto_choice"]["method"] in ("ar", "triforce", "retrieval", "naive")
    assert result["auto_choice"]["said"].startswith("method auto: ")


def test_bench_offload_on_a_model_replays_a_trace_on_random_kv(recorded, capsys, tmp_path):
    """A replayed trace needs no prefill (a 128K one of a 32B model would cost a lease minutes): the
    KV is random values; the model's own acceptance still decodes after a real prompt."""
    folder, trace, _ = recorded
    common = ("bench", "offload", "--model", str(folder), "--context", "400", "--device-budget", "20MB",
              "--methods", "ar-offload,triforce", "--new-tokens", "3", "--speculative-tokens", "4", "--repeats", "1",
              "--budget", "24", "--plot", str(tmp_path / "b.png"), "--json")
    code, out, err = run_cli(capsys, *common, "--acceptance-trace", str(trace))
    assert code == 0, err
    replayed = json.loads(out)
    assert replayed["kv_source"].startswith("random values") and replayed["context"] == 400
    assert {r["method"]: r.get("replayed") for r in replayed["rows"]} == {"ar-offload": None, "triforce": True}
    code, out, err = run_cli(capsys, *common)
    assert code == 0, err
    assert json.loads(out)["kv_source"] == "a prefill of a real prompt"


def test_bench_offload_refuses_random_weights_without_a_trace(capsys):
    code, _, err = run_cli(capsys, "bench", "offload", "--arch", "tiny-test", "--context", "100")
    assert_one_line_error(code, err, "--acceptance-trace")


def test_plan_names_every_limit_at_once_and_the_host_it_reads(capsys, monkeypatch):
    from triforce.plan import host_limits

    monkeypatch.setattr(host_limits, "host_memory", lambda override=None: host_limits.planned_host_memory("128GiB"))
    code, out, err = run_cli(capsys, "plan", "--arch", "llama2-7b-128k", "--profile", "rtx4090-24g",
                             "--context", "500000")
    lines = err.strip().splitlines()
    assert code != 0 and len(lines) == 1 and "Traceback" not in err
    assert "(1) 500000 tokens is past the model's 131072-token context" in lines[0] and "(2) does not fit" in lines[0]
    suggested = int(lines[0].split("a context of at most about ")[1].split()[0])
    assert suggested <= 131072  # never a context past the model's own
    assert "note: host memory: 115.20 GiB usable of 128.00 GiB available" in out


@pytest.mark.parametrize("how", ["this machine", "--host-memory"])
def test_the_papers_127k_setting_is_refused_on_a_64_gb_desktop(capsys, monkeypatch, how):
    """Issue 74: `plan --profile rtx4090-24g` said feasible with 62.66 GiB of host memory 'of 96.00
    GiB' (the card's profile claimed the host) on any machine; a 64 GB desktop has ~54 GiB to give."""
    from triforce.plan import host_limits

    flags = ["--host-memory", "64GB"] if how == "--host-memory" else []
    if how == "this machine":
        desktop, real = host_limits.HostMemory(64 * 10**9, 64 * 10**9, "this machine"), host_limits.host_memory
        monkeypatch.setattr(host_limits, "host_memory", lambda override=None: real(override) if override else desktop)
    code, _, err = run_cli(capsys, "plan", "--arch", "llama2-7b-128k", "--context", "130048", "--profile",
                           "rtx4090-24g", *flags)
    assert_one_line_error(code, err, "the offloaded KV needs 62.71 GiB of host memory but 53.64 GiB is usable",
                          "the longest context that fits is about 112640 tokens", "fewer KV heads")
    code, out, _ = run_cli(capsys, "plan", "--arch", "llama2-7b-128k", "--context", "130048", "--profile",
                           "rtx4090-24g", "--host-memory", "128GB")
    assert code == 0 and "--host-memory 128GB" in out

def test_a_cpu_plan_reads_this_machines_memory_and_cores(capsys, monkeypatch):
    """Without --profile a CPU plans with 80% of its memory and the cores it may use (the same
    for every run: the API and the CLI give the same plan); `--profile cpu` stays the shipped
    16 GiB reference."""
    import os
    from collections import namedtuple

    import psutil

    monkeypatch.setattr(psutil, "virtual_memory", lambda: namedtuple("vm", "available total")(3 * 2**30, 10 * 2**30))
    monkeypatch.setattr("triforce.plan.host_limits._cgroup", lambda root: None)  # whatever this container's limit
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2}, raising=False)
    code, out, _ = run_cli(capsys, "plan", "--arch", "smollm2-135m", "--context", "4096", "--json")
    report = json.loads(out)
    assert code == 0 and report["profile"] == "cpu" and report["gpu_budget_bytes"] == int(8 * 2**30)
    assert report["host_note"] == ("profile cpu: CPU only, read from this machine: 8.00 GiB usable (80% of its "
                                   "memory), 3 cores; rates as shipped")
    code, out, _ = run_cli(capsys, "plan", "--arch", "smollm2-135m", "--context", "4096", "--profile", "cpu", "--json")
    report = json.loads(out)
    assert code == 0 and report["gpu_budget_bytes"] == 16 * 2**30 and report["host_note"] is None
    code, out, _ = run_cli(capsys, "plan", "--arch", "llama2-7b-128k", "--context", "131072")
    assert code != 0  # 13.5 GB of weights and 64 GiB of KV in 8 GiB


def test_plan_counts_what_a_run_of_the_model_holds(capsys, default_model_dir):
    """--quantize auto (plan's default, as generate's): the default model's own Q4_1/Q8_0 blocks on
    a CPU, byte for byte what `generate` plans once loaded; `--quantize none` counts the floats."""
    code, out, _ = run_cli(capsys, "plan", "--model", "default", "--context", "4096", "--json")
    planned = json.loads(out)
    code2, out2, _ = run_cli(capsys, "generate", "--prompt", "hi", "--max-new-tokens", "2", "--json")
    ran = json.loads(out2)["plan"]
    from triforce.kernels.cpu.simd.f32_dot import HAS_F32_FMA  # without FMA the run takes floats, and so does plan
    assert code == code2 == 0 and planned["weight_format"] == ran["weight_format"] == (
        "q4_1/q8_0" if HAS_F32_FMA else None)
    assert planned["breakdown"]["target_weights"] == ran["breakdown"]["target_weights"]
    code, out, _ = run_cli(capsys, "plan", "--model", "default", "--context", "4096", "--quantize", "none", "--json")
    floats = json.loads(out)
    assert code == 0 and floats["weight_format"] is None
    assert floats["breakdown"]["target_weights"] > (4 if HAS_F32_FMA else 0.99) * planned["breakdown"]["target_weights"]
