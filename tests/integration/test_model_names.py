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


# ---- issue 71: names are not paths ---------------------------------------------------------------
@pytest.fixture
def planted(names):
    """Copies of the store's manifest and snapshot planted where a name read as a path would reach
    them, each leading to the default GGUF outside the stores (a load there exits 0)."""
    from triforce.model.default_model import ensure_gguf

    ollama, hub = names / "ollama", names / "hub"
    manifest = (ollama / "manifests" / "registry.ollama.ai" / "library" / "smollm2" / "135m").read_text()
    outside = names / "outside.gguf"
    if not outside.exists():
        outside.symlink_to(ensure_gguf())
    for where in (ollama / "evil" / "latest", ollama / "manifests" / "evil" / "latest"):
        where.parent.mkdir(parents=True, exist_ok=True)
        where.write_text(manifest)
    for name, digest in (("relative", "../../outside.gguf"), ("absolute", str(outside)),
                         ("prefixed", "sha256:../../outside.gguf")):
        forged = ollama / "manifests" / "registry.ollama.ai" / "library" / name / "latest"
        forged.parent.mkdir(parents=True, exist_ok=True)
        forged.write_text(json.dumps({"layers": [{"mediaType": "application/vnd.ollama.image.model", "digest": digest}]}))
    snapshot = hub / "outside-snapshot"
    snapshot.mkdir(exist_ok=True)
    if not (snapshot / "model.gguf").exists():
        (snapshot / "model.gguf").symlink_to(ensure_gguf())
    (hub / "x").write_text("../../outside-snapshot")  # read by the hub as refs/../../x
    return names


@pytest.mark.parametrize("name, fragments", [
    ("ollama:../../evil", ["is not an Ollama model name"]),
    ("ollama:smollm2:../../../evil/latest", ["is not an Ollama model name"]),
    ("ollama:library/../../evil", ["is not an Ollama model name"]),
    ("ollama:/abs/model", ["is not an Ollama model name"]),
    ("ollama:relative", ["names the layer '../../outside.gguf', not a digest sha256:<64 hex digits>"]),
    ("ollama:absolute", ["not a digest sha256:<64 hex digits>"]),
    ("ollama:prefixed", ["not a digest sha256:<64 hex digits>"]),
    ("triforce-test/smollm2-gguf@../../x", ["'../../x' is not a revision"]),
    ("triforce-test/smollm2-gguf@.", ["'.' is not a revision"]),
    ("triforce-test/smollm2-gguf@..", ["'..' is not a revision"]),
    ("triforce-test/smollm2-gguf@main/../../../x", ["is not a revision"]),
])
def test_a_name_never_reaches_a_file_outside_its_store(capsys, planted, name, fragments):
    code, _, err = run_cli(capsys, "generate", "--model", name, "--prompt", "hi", "--max-new-tokens", "1")
    assert_one_line_error(code, err, *fragments)


def test_a_ref_that_leads_out_of_the_snapshots_is_refused(capsys, planted):
    ref = planted / "hub" / "models--triforce-test--smollm2-gguf" / "refs" / "forged"
    ref.write_text("../../outside-snapshot")
    code, _, err = run_cli(capsys, "generate", "--model", "triforce-test/smollm2-gguf@forged", "--prompt", "hi")
    assert_one_line_error(code, err, "holds no commit hash")


def test_a_snapshot_linked_outside_its_blobs_is_refused(capsys, planted):
    snapshot = planted / "hub" / "models--triforce-test--snapped" / "snapshots" / COMMIT
    snapshot.mkdir(parents=True, exist_ok=True)
    (snapshot.parents[1] / "refs").mkdir(exist_ok=True)
    (snapshot.parents[1] / "refs" / "main").write_text(COMMIT)
    if not (snapshot / "model.gguf").exists():
        (snapshot / "model.gguf").symlink_to(planted / "outside.gguf")
    code, _, err = run_cli(capsys, "generate", "--model", "triforce-test/snapped", "--prompt", "hi")
    assert_one_line_error(code, err, "links outside its repo's blobs")


@pytest.mark.parametrize("name, fragment", [
    ("a" * 300, "File name too long"),
    ("ollama:" + "a" * 300, "is not an Ollama model name"),
    ("org/" + "a" * 300, "is not a Hugging Face repo id"),
    ("org/name@" + "b" * 300, "is not a revision"),
])
def test_a_name_too_long_is_one_short_line(capsys, names, name, fragment):
    code, _, err = run_cli(capsys, "generate", "--model", name, "--prompt", "hi")
    assert_one_line_error(code, err, fragment, "characters)")  # the name cut short
    assert len(err) < 600


def test_a_manifest_is_read_with_a_bound(capsys, names):
    """A 3 GiB manifest (sparse: no disk) is refused from its first MiB, not read whole."""
    import tracemalloc

    huge = names / "ollama" / "manifests" / "registry.ollama.ai" / "library" / "huge" / "latest"
    huge.parent.mkdir(parents=True, exist_ok=True)
    with open(huge, "wb") as f:
        f.truncate(3 << 30)
    tracemalloc.start()
    try:
        code, _, err = run_cli(capsys, "generate", "--model", "ollama:huge", "--prompt", "hi")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        huge.unlink()
    assert_one_line_error(code, err, "is larger than 1 MiB")
    assert peak < 64 << 20


def test_ollama_names_with_a_host_and_a_namespace(capsys, names):
    """hf.co/ORG/REPO:TAG is how Ollama keeps a model pulled from the Hub; `models` lists it."""
    from triforce.model.model_names import OllamaName

    store = names / "ollama" / "manifests"
    source = store / "registry.ollama.ai" / "library" / "smollm2" / "135m"
    pulled = store / "hf.co" / "bartowski" / "SmolLM2-135M-GGUF" / "Q4_1"
    pulled.parent.mkdir(parents=True, exist_ok=True)
    pulled.write_text(source.read_text())
    assert OllamaName.parse("hf.co/bartowski/SmolLM2-135M-GGUF:Q4_1").manifest(names / "ollama") == pulled
    assert str(OllamaName.parse("me/smollm2")) == "me/smollm2:latest"
    code, out, _ = run_cli(capsys, "models", "--json")
    found = {m["model"]: m for m in json.loads(out)}
    assert found["ollama:hf.co/bartowski/SmolLM2-135M-GGUF:Q4_1"]["runs"]
    assert found["ollama:smollm2:135m"]["runs"]
