"""`--model` by name, offline: ORG/NAME[@REVISION] from a Hugging Face cache and ollama:NAME[:TAG]
from an Ollama store, each laid out here as the hub and Ollama lay them out around the default
model's GGUF file; a missing name is one error line; `triforce models` lists what runs."""
import hashlib
import json

import pytest

from test_cli import assert_one_line_error, run_cli

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def stores(tmp_path_factory, default_model_dir):
    """A Hugging Face cache holding the default GGUF as repo triforce-test/smollm2-gguf (a snapshot
    file linked to its blob), a second repo with a model type triforce does not run, and an Ollama
    store holding it as smollm2:135m. Every link ends at the one default file, so the tokenizer
    and config are read once for both."""
    from triforce.model.default_model import ensure_gguf

    gguf = ensure_gguf()
    root = tmp_path_factory.mktemp("stores")
    repo = root / "hub" / "models--triforce-test--smollm2-gguf"
    (repo / "blobs").mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    blob = repo / "blobs" / hashlib.sha256(gguf.name.encode()).hexdigest()
    blob.symlink_to(gguf)
    (repo / "snapshots" / COMMIT).mkdir(parents=True)
    (repo / "snapshots" / COMMIT / gguf.name).symlink_to(blob)
    other = root / "hub" / "models--triforce-test--an-encoder" / "snapshots" / COMMIT
    other.mkdir(parents=True)
    (other / "config.json").write_text(json.dumps({"model_type": "bert"}))
    (other.parents[1] / "refs").mkdir()
    (other.parents[1] / "refs" / "main").write_text(COMMIT)
    ollama = root / "ollama"
    digest = "sha256:" + "ab" * 32
    (ollama / "blobs").mkdir(parents=True)
    (ollama / "blobs" / digest.replace(":", "-")).symlink_to(gguf)
    manifest = ollama / "manifests" / "registry.ollama.ai" / "library" / "smollm2" / "135m"
    manifest.parent.mkdir(parents=True)
    manifest.write_text(json.dumps({"schemaVersion": 2, "layers": [
        {"mediaType": "application/vnd.ollama.image.model", "digest": digest, "size": gguf.stat().st_size},
        {"mediaType": "application/vnd.ollama.image.template", "digest": "sha256:" + "cd" * 32, "size": 10}]}))
    return root


@pytest.fixture
def names(stores, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(stores / "hub"))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(stores / "hub"))
    monkeypatch.setenv("OLLAMA_MODELS", str(stores / "ollama"))
    return stores


def _tokens(capsys, model):
    code, out, err = run_cli(capsys, "generate", "--model", model, "--prompt", "The capital of France is",
                             "--max-new-tokens", "4", "--temperature", "0", "--json")
    assert code == 0, err
    return json.loads(out)["tokens"]


def test_a_model_is_found_by_its_hub_name_and_its_ollama_name(capsys, names):
    from triforce.model.default_model import ensure_gguf

    by_path = _tokens(capsys, str(ensure_gguf()))
    assert _tokens(capsys, "triforce-test/smollm2-gguf") == by_path
    assert _tokens(capsys, f"triforce-test/smollm2-gguf@{COMMIT}") == by_path
    assert _tokens(capsys, "ollama:smollm2:135m") == by_path


@pytest.mark.parametrize("name, fragments", [
    ("triforce-test/not-here", ["'triforce-test/not-here' is neither a path here nor in the Hugging Face cache",
                                "hf download"]),
    ("triforce-test/smollm2-gguf@" + "f" * 40, ["nor in the Hugging Face cache", "--revision"]),
    ("ollama:smollm2", ["'smollm2:latest' is not in Ollama's store", "ollama pull smollm2:latest"]),
    ("ollama:", ["needs a name"]),
])
def test_a_name_that_is_not_there_says_where_it_looked(capsys, names, name, fragments):
    code, _, err = run_cli(capsys, "generate", "--model", name, "--prompt", "hi")
    assert_one_line_error(code, err, *fragments)


def test_models_lists_what_runs_here(capsys, names):
    code, out, _ = run_cli(capsys, "models", "--json")
    found = {m["model"]: m for m in json.loads(out)}
    assert code == 0 and found["default"]["runs"]
    assert found["triforce-test/smollm2-gguf"]["runs"] and found["triforce-test/smollm2-gguf"]["note"] == "llama"
    assert found["ollama:smollm2:135m"]["runs"] and found["ollama:smollm2:135m"]["bytes"] > 90e6
    assert not found["triforce-test/an-encoder"]["runs"] and "bert" in found["triforce-test/an-encoder"]["note"]
    code, out, _ = run_cli(capsys, "models")
    assert code == 0 and "ollama:smollm2:135m" in out and "does not run: model_type bert" in out
