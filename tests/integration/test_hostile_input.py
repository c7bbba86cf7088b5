"""Careless input is refused before any expensive work, and a computed result is never lost.
Each case asserts the exit code, a single `triforce: error:` line and no traceback."""
import json

import pytest

from test_cli import assert_one_line_error, run_cli


@pytest.fixture
def no_work(monkeypatch):
    """Fail the test if a run gets as far as loading a model or starting ranks."""
    def refuse(*args, **kwargs):
        raise AssertionError("expensive work started before validation")

    monkeypatch.setattr("triforce.app.runtime.Runtime.__init__", refuse)
    monkeypatch.setattr("triforce.app.ranks.launch", refuse)


TP_CASES = [  # (command line after the model flag, fragment of the error, cores this machine claims)
    (["generate", "--prompt", "hi", "--tp", "99"], "core per rank", None),
    (["chat", "--tp", "99"], "core per rank", None),
    (["generate", "--prompt", "hi", "--tp", "8"], "KV heads", 64),
    (["chat", "--tp", "8"], "KV heads", 64),
]


@pytest.mark.parametrize("args,fragment,cores", TP_CASES)
def test_tp_is_checked_before_any_rank_starts(capsys, tiny_model_dir, monkeypatch, no_work, args, fragment, cores):
    model = str(tiny_model_dir("llama-gqa"))
    capsys.readouterr()  # making the tiny model prints progress
    if cores is not None:
        monkeypatch.setattr("os.cpu_count", lambda: cores)
    code, _, err = run_cli(capsys, args[0], "--model", model, *args[1:])
    assert_one_line_error(code, err, fragment)


def test_bench_tp_is_checked_against_the_architecture(capsys, monkeypatch, no_work):
    monkeypatch.setattr("os.cpu_count", lambda: 64)
    code, _, err = run_cli(capsys, "bench", "offload", "--arch", "tiny-test", "--context", "64", "--draft", "lookup",
                           "--methods", "ar-offload", "--tp", "16")
    assert_one_line_error(code, err, "KV heads")


def output_cases(tmp_path):
    folder = tmp_path / "a-folder"
    folder.mkdir()
    missing = tmp_path / "missing" / "out.json"
    return [
        (["generate", "--prompt", "hi", "--record-acceptance", str(folder)], "is a directory"),
        (["generate", "--prompt", "hi", "--record-acceptance", str(missing)], "does not exist"),
        (["bench", "offload", "--context", "64", "--plot", str(folder)], "is a directory"),
        (["bench", "offload", "--context", "64", "--plot", str(missing)], "does not exist"),
    ]


@pytest.mark.parametrize("case", range(4))
def test_output_paths_are_checked_before_the_work(capsys, tiny_model_dir, tmp_path, no_work, case):
    args, fragment = output_cases(tmp_path)[case]
    model = str(tiny_model_dir("llama-gqa"))
    capsys.readouterr()
    split = 2 if args[0] == "bench" else 1
    code, _, err = run_cli(capsys, *args[:split], "--model", model, *args[split:])
    assert_one_line_error(code, err, fragment)


def test_a_trace_that_cannot_be_written_after_the_run_keeps_the_result(capsys, tiny_model_dir, tmp_path, monkeypatch):
    from triforce.errors import UserError

    def disk_full(*args, **kwargs):
        raise UserError("cannot write the acceptance trace: No space left on device")

    monkeypatch.setattr("triforce.decoding.acceptance_trace.save_trace", disk_full)
    model = str(tiny_model_dir("llama-gqa"))
    capsys.readouterr()
    code, out, err = run_cli(capsys, "generate", "--model", model, "--prompt", "the cat",
                             "--max-new-tokens", "4", "--method", "retrieval", "--budget", "32", "--chunk-size", "4",
                             "--record-acceptance", str(tmp_path / "trace.json"), "--json")
    assert_one_line_error(code, err, "No space left")
    assert len(json.loads(out)["tokens"]) == 4  # the run's result was printed all the same


def file_cases(tmp_path):
    folder = tmp_path / "folder"
    folder.mkdir()
    huge = tmp_path / "huge.txt"
    huge.write_text("the cat sat on the mat. " * 2000)  # 48 KB: far beyond a 128-token context
    bad = tmp_path / "latin1.txt"
    bad.write_bytes(b"caf\xe9 au lait")
    return [
        (str(tmp_path / "nope.txt"), "does not exist"),
        (str(folder), "is a directory"),
        ("/dev/zero", "not a regular file"),
        (str(huge), "too long for the model's 128-token context"),
        (str(bad), "not UTF-8"),
    ]


@pytest.mark.parametrize("case", range(5))
def test_prompt_files_are_refused_by_kind_and_size_before_being_read(capsys, tiny_model_dir, tmp_path, monkeypatch,
                                                                      case):
    path, fragment = file_cases(tmp_path)[case]
    model = str(tiny_model_dir("llama-gqa"))
    capsys.readouterr()
    read = []
    real_open = open
    monkeypatch.setattr("builtins.open", lambda f, *a, **k: read.append(str(f)) or real_open(f, *a, **k))
    code, _, err = run_cli(capsys, "generate", "--model", model, "--prompt-file", path)
    assert_one_line_error(code, err, fragment)
    assert path not in read or fragment == "not UTF-8"  # refused by its size or kind, unread


@pytest.mark.parametrize("case", range(4))
def test_chat_load_refuses_what_cannot_fit_and_keeps_the_session(tiny_model_dir, tmp_path, case):
    from triforce.app.chat import Chat
    from triforce.errors import UserError
    from triforce.model.loading import load_model

    path, fragment = file_cases(tmp_path)[case]
    fragment = fragment.replace("the model's 128-token context", "the whole 40-token context (start the chat with")
    chat = Chat(load_model(str(tiny_model_dir("llama-gqa")), dtype="float32", device="cpu"), 40)
    with pytest.raises(UserError, match=__import__("re").escape(fragment)):
        chat.load_document(__import__("pathlib").Path(path))
    assert chat.messages == [] and chat.full.tokens == []


def _chat(tiny_model_dir, max_len):
    from triforce.app.chat import Chat
    from triforce.model.loading import load_model

    return Chat(load_model(str(tiny_model_dir("llama-gqa")), dtype="float32", device="cpu"), max_len)


def test_chat_says_reset_only_where_a_reset_helps(tiny_model_dir, tmp_path):
    from triforce.config import SamplingParams
    from triforce.errors import UserError

    chat = _chat(tiny_model_dir, 120)
    first, second = tmp_path / "first.txt", tmp_path / "second.txt"
    first.write_text("the cat sat on the mat. " * 3)  # ~75 tokens: fits alone, not twice
    second.write_text("the dog sat on the log. " * 3)
    chat.load_document(first)
    with pytest.raises(UserError, match="/reset to start over"):
        chat.load_document(second)
    with pytest.raises(UserError, match="this message alone is .* larger --max-context"):
        chat.ask("why " * 60, SamplingParams(), 4)
    chat.reset()
    chat.load_document(second)  # the reset did help


def test_an_interrupted_load_leaves_the_conversation_and_its_stats(tiny_model_dir, tmp_path):
    chat = _chat(tiny_model_dir, 120)
    doc = tmp_path / "doc.txt"
    doc.write_text("the cat sat on the mat. " * 3)
    before = chat.stats()["context_tokens"]

    def interrupt(tokens):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        chat.load_document(doc, progress=interrupt)
    assert chat.messages == [] and chat.stats()["context_tokens"] == before
    chat.load_document(doc)  # and the next load works
    assert chat.stats()["context_tokens"] > before


@pytest.mark.parametrize("weights_fit,fragment", [(False, "the model in float32 needs"),
                                                  (True, "the caches and buffers of a")])
def test_host_memory_is_checked_before_allocating(capsys, tiny_model_dir, monkeypatch, weights_fit, fragment):
    monkeypatch.setattr("triforce.model.host_memory.available_bytes", lambda: 1024)  # a nearly full host
    if weights_fit:
        monkeypatch.setattr("triforce.model.host_memory.meta_model_bytes", lambda model, dtype: 0)
    built = []
    monkeypatch.setattr("triforce.app.runtime.build_kv_cache", lambda *a, **k: built.append(a))
    model = str(tiny_model_dir("llama-gqa"))
    capsys.readouterr()
    code, _, err = run_cli(capsys, "generate", "--model", model, "--prompt", "the cat", "--max-new-tokens", "4")
    assert_one_line_error(code, err, fragment, "GiB of host memory")
    assert not built


def test_bench_refuses_random_weights_the_host_cannot_hold(capsys, monkeypatch):
    monkeypatch.setattr("triforce.model.host_memory.available_bytes", lambda: 1 << 30)
    monkeypatch.setattr("torch.nn.Module.to_empty", lambda *a, **k: pytest.fail("allocated before the check"))
    code, _, err = run_cli(capsys, "bench", "offload", "--arch", "llama2-7b-128k", "--context", "130000",
                           "--methods", "ar-offload")
    assert_one_line_error(code, err, "llama2-7b-128k in float32 needs")


FIT_CASES = [  # (plan flags, fragments the error has, fragments it must not have)
    (["--arch", "llama2-7b-128k", "--context", "130000", "--profile", "cpu"], ["does not fit"],
     ["--tp", "two-GPU"]),
    (["--arch", "llama2-7b-128k", "--context", "130000", "--profile", "rtx4090-24g", "--device-budget", "10GB"],
     ["a two-GPU profile with --tp 2"], ["--gamma2"]),
    (["--arch", "llama2-7b-128k", "--context", "130000", "--profile", "2x-rtx4090-24g", "--device-budget", "10GB"],
     ["try --tp 2"], ["two-GPU"]),
    (["--arch", "llama2-7b-128k", "--context", "120000", "--profile", "rtx4090-24g", "--gamma2", "60000",
      "--method", "retrieval"], ["a smaller --gamma2"], []),
    (["--arch", "llama2-7b-128k", "--context", "64", "--profile", "cpu", "--tp", "3"], ["core per rank"], []),
    (["--arch", "tiny-test", "--context", "64", "--tp", "3"], ["cannot split the model's 2 KV heads"], []),
    (["--arch", "tiny-test", "--context", "64", "--gamma2", "100000"], ["below the model's context"], []),
]


@pytest.mark.parametrize("flags,has,lacks", FIT_CASES)
def test_fit_errors_only_give_advice_that_can_work(capsys, flags, has, lacks):
    code, _, err = run_cli(capsys, "plan", *flags)
    assert_one_line_error(code, err, *has)
    assert not any(fragment in err for fragment in lacks), err


def test_asking_for_a_gpu_with_the_cpu_build_of_torch_says_so(capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.version, "cuda", None)  # the build this suite installs; said as it is
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code, _, err = run_cli(capsys, "generate", "--prompt", "hi", "--device", "cuda")
    assert_one_line_error(code, err, "CPU-only build", "install a CUDA build")
    monkeypatch.setattr(torch.version, "cuda", "12.8")  # a CUDA build on a machine without a card
    code, _, err = run_cli(capsys, "generate", "--prompt", "hi", "--device", "cuda:0")
    assert_one_line_error(code, err, "no CUDA device is available", "driver")
