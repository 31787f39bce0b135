"""`lcx train build`: a bundled model kept as a recipe (lcx/assets/<dir>/ with weights.json, no
weights) is put into the lcx cache, restored bitwise from git's history or retrained from its
train_config.json; until then its preset names the command."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from lcx.train.build import PROVENANCE, RECIPE_FILES, WEIGHTS, build, recipe_dir, recipes

ROOT = Path(__file__).resolve().parents[2]
RECIPES = recipes()  # every model kept as a recipe: each gets every test below


def test_tiny_swat_and_tiny_5m_are_recipes():
    assert {"tiny-swat-5m", "tiny-5m"} <= set(RECIPES)


@pytest.mark.parametrize("name", RECIPES)
def test_a_recipe_is_complete_and_ships_no_weights(name):
    from lcx.models.loading import MODELS

    recipe = recipe_dir(name)
    for f in RECIPE_FILES:
        assert (recipe / f).is_file(), f"{recipe.name}/{f}"
    assert not list(recipe.glob(f"{WEIGHTS}*")), "a recipe's weights are built, not shipped"
    prov = json.loads((recipe / PROVENANCE).read_text())
    assert len(prov[WEIGHTS]["sha256"]) == 64 and prov[WEIGHTS]["dtype"] in ("bfloat16", "float16", "float32")
    assert len(prov["git"]["commit"]) == 40 and prov["git"]["path"].startswith("lcx/assets/")
    assert f"lcx train build {name}" in MODELS[name].how_to_get
    tracked = subprocess.run(["git", "ls-files", str(recipe.relative_to(ROOT))], cwd=ROOT, capture_output=True,
                             text=True).stdout.split()
    assert not [t for t in tracked if Path(t).name.startswith(WEIGHTS)], tracked


@pytest.mark.parametrize("name", RECIPES)
def test_an_unbuilt_recipe_names_the_build_command(name, tmp_path, monkeypatch):
    from lcx.models import load_model

    monkeypatch.setenv("LCX_CACHE_DIR", str(tmp_path))
    with pytest.raises(FileNotFoundError, match=f"lcx train build {name}"):
        load_model(name)
    with pytest.raises(ValueError, match="not a model lcx keeps as a recipe"):
        recipe_dir("tiny-ret-5m")  # (ships its weights)


def _git_has(prov: dict) -> bool:
    r = subprocess.run(["git", "cat-file", "-e", f"{prov['git']['commit']}:{prov['git']['path']}"], cwd=ROOT,
                       capture_output=True)
    return r.returncode == 0


@pytest.mark.parametrize("name", RECIPES)
def test_build_restores_the_committed_weights_from_git(name, tmp_path, monkeypatch, capsys):
    from lcx.models import load_model

    from lcx.train.build import committed_weights

    prov = json.loads((recipe_dir(name) / PROVENANCE).read_text())
    data, why = committed_weights(recipe_dir(name), prov)  # a shallow clone fetches the commit here
    if data is None:
        pytest.skip(f"this checkout's git cannot give {prov['git']['commit'][:12]}: {why}")
    monkeypatch.setenv("LCX_CACHE_DIR", str(tmp_path))
    entry = build(name)
    record = json.loads((entry / "build.json").read_text())
    assert record["how"] == "restored" and record["identical_to_committed"] is True
    assert record["sha256"] == prov[WEIGHTS]["sha256"] and "bitwise the committed weights" in capsys.readouterr().out
    assert sorted(p.name for p in entry.iterdir()) == sorted([*RECIPE_FILES, WEIGHTS, "build.json"])
    model, _ = load_model(name)
    recorded = json.loads((recipe_dir(name) / "config.json").read_text()).get("lcx_attention")
    assert model.config.to_dict().get("lcx_attention") == recorded  # the method the model was trained with
    with pytest.raises(ValueError, match="--force"):
        build(name)
    assert not list(tmp_path.joinpath("built").glob(".*"))  # no temporary directory left behind


@pytest.mark.parametrize("name", RECIPES)
def test_a_shallow_clone_fetches_the_commit_that_holds_the_weights(name, tmp_path):
    """`git clone --depth 1` (as a CI checkout may be) lacks the commit the weights are in:
    `committed_weights` fetches that one commit from origin and restores them, sha256 checked;
    with no origin to fetch from it says why, and nothing is restored."""
    from lcx.train.build import committed_weights

    prov = json.loads((recipe_dir(name) / PROVENANCE).read_text())
    if not _git_has(prov):
        pytest.skip(f"this checkout's git has no {prov['git']['commit'][:12]} to clone from (itself shallow)")
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "--quiet", "--depth", "1", f"file://{ROOT}", str(clone)], check=True)
    recipe = clone / recipe_dir(name).relative_to(ROOT)
    shallow_prov = json.loads((recipe / PROVENANCE).read_text())
    run = dict(cwd=clone, capture_output=True, text=True)
    assert subprocess.run(["git", "rev-parse", "--is-shallow-repository"], **run).stdout.strip() == "true"
    assert subprocess.run(["git", "cat-file", "-e", f"{prov['git']['commit']}:{prov['git']['path']}"],
                          **run).returncode != 0  # the clone does not hold the weights' commit

    subprocess.run(["git", "remote", "remove", "origin"], check=True, **run)
    data, why = committed_weights(recipe, shallow_prov)
    assert data is None and "git does not have" in why and "fetching it from origin" in why, why

    subprocess.run(["git", "remote", "add", "origin", f"file://{ROOT}"], check=True, **run)
    data, why = committed_weights(recipe, shallow_prov)
    assert data is not None and "fetched from origin into this shallow clone" in why, why
    import hashlib
    assert hashlib.sha256(data).hexdigest() == prov[WEIGHTS]["sha256"]


def test_restore_only_never_retrains(tmp_path, monkeypatch, capsys):
    """`--restore-only` (what scripts/setup.sh runs): where git does not hold the committed weights
    (a recipe pointing at a commit no git has), exit 2 naming why, nothing built, no training."""
    import shutil

    import lcx.train.build as b

    fake = tmp_path / "assets" / "tiny-swat-5m"
    shutil.copytree(recipe_dir("tiny-swat-5m"), fake)
    prov = json.loads((fake / PROVENANCE).read_text())
    prov["git"]["commit"] = "0" * 40
    (fake / PROVENANCE).write_text(json.dumps(prov))
    monkeypatch.setattr(b, "recipe_dir", lambda name: fake)
    monkeypatch.setattr(b, "retrain", lambda *a, **k: pytest.fail("--restore-only retrained"))
    monkeypatch.setenv("LCX_CACHE_DIR", str(tmp_path / "cache"))
    from lcx.cli import main

    assert main(["train", "build", "tiny-swat-5m", "--restore-only"]) == 2
    err = capsys.readouterr().err
    assert "not restored" in err and "git does not have" in err
    assert not (tmp_path / "cache" / "built" / "tiny-swat-5m").exists()
    assert main(["train", "build", "tiny-swat-5m", "--restore-only", "--retrain"]) == 2


@pytest.mark.slow
def test_retrain_runs_the_recipe_and_says_it_is_not_the_committed_model(tmp_path, monkeypatch, capsys):
    """The retrain path end to end on a few steps (~1 min: most of it encodes the corpus)."""
    from lcx.models import load_model

    monkeypatch.setenv("LCX_CACHE_DIR", str(tmp_path))
    entry = build("tiny-swat-5m", progress=False, overrides=dict(steps=2, batch_size=2, eval_every=2, val_windows=2,
                                                                 ckpt_every=2, warmup_steps=0))
    record = json.loads((entry / "build.json").read_text())
    assert record["how"] == "retrained" and record["identical_to_committed"] is False
    assert "NOT bitwise the committed weights" in capsys.readouterr().out
    log = json.loads((entry / "build_train_log.json").read_text())
    assert log["step"][-1] == 2
    model, _ = load_model("tiny-swat-5m")
    assert model.config.to_dict()["lcx_attention"]["type"] == "swat"
