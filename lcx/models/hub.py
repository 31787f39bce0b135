"""Hugging Face Hub model ids: `org/name[@revision][:file.gguf]`, resolved through the Hub cache.

    load_model("HuggingFaceTB/SmolLM2-135M")              # branch main
    load_model("HuggingFaceTB/SmolLM2-135M@v1.0")         # a branch, a tag or a commit
    load_model("bartowski/SmolLM2-135M-GGUF:SmolLM2-135M-Q4_K_M.gguf")   # one file of a GGUF repo

An id resolves as transformers resolves one (`huggingface_hub.snapshot_download` /
`hf_hub_download`), into the same cache and with the same settings:

- the cache: `HF_HUB_CACHE`, else `HUGGINGFACE_HUB_CACHE`, else `$HF_HOME/hub`, else
  `$XDG_CACHE_HOME/huggingface/hub`, else `~/.cache/huggingface/hub` -- read when the id is
  resolved, so a process that changes them meets the cache it names;
- the revision: a branch or tag maps to a commit through `<cache>/models--org--name/refs/<name>`;
  a 40-hex commit is used as is; the default is `main`;
- offline: `HF_HUB_OFFLINE` (or `TRANSFORMERS_OFFLINE`) set to 1/true/yes/on: nothing is
  downloaded, the cached snapshot is used or a `HubModelNotFoundError` names the id, the
  revision, the cache directory and the offline flag (and lists what is cached for that repo);
- online: only the files a model needs are downloaded (config, tokenizer, `*.safetensors`; the
  `*.bin` weights of a repo without safetensors); if the Hub cannot be reached, the cache is used,
  as in transformers;
- the token: `HF_TOKEN` or the token `hf auth login` stored (huggingface_hub's own lookup).

What a repo holds decides what it is:
- `config.json` at its top: a Hugging Face model directory -> `("hf", <snapshot dir>)`;
- otherwise its `.gguf` files: one is taken; several need the id to name one,
  `org/name:file.gguf` (the message lists them) -> `("gguf", <snapshot path of the file>)`, which
  lcx dequantizes once into its cache like any `.gguf` (`lcx.models.gguf`). `:file` also picks a
  GGUF from a repo that has a config.json as well.

Precedence (`lcx.models.resolve_source`): an existing path, then a preset (`lcx models`), then a
Hub id. A local directory `org/name` relative to the working directory wins over the Hub id, as in
transformers; preset names have no `/`, so a preset never shadows an id.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

# What transformers reads of an HF model repo besides the weights: config and generation config,
# tokenizer files (fast tokenizer, its config and special tokens, a SentencePiece model, vocab and
# merges files, tiktoken files, a chat template) and the weights' shard indexes. Downloaded online;
# offline only config.json is required (a repo fetched with a narrower pattern, e.g. by vLLM, still
# loads if its tokenizer is there).
CONFIG_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                "special_tokens_map.json", "added_tokens.json", "tokenizer.model", "spiece.model", "vocab.json",
                "vocab.txt", "merges.txt", "*.tiktoken", "chat_template.jinja", "chat_template.json",
                "model.safetensors.index.json", "pytorch_model.bin.index.json")
# The weights transformers loads, in its order: safetensors, else PyTorch pickles (loaded with
# weights_only); each a single file or the shards its index names. Nothing else (a repo's
# `consolidated.safetensors` or ONNX export is not downloaded).
WEIGHTS = (("model.safetensors", "model.safetensors.index.json"),
           ("pytorch_model.bin", "pytorch_model.bin.index.json"))

_TRUE = {"1", "true", "yes", "on"}
# huggingface_hub's repo id rules (`validate_repo_id`): [A-Za-z0-9_.-], a name part of at most 96
# characters that neither starts nor ends with '-' or '.', no '--' or '..'.
_PART = re.compile(r"[A-Za-z0-9_](?:[\w.-]{0,94}[A-Za-z0-9_])?")


class HubModelNotFoundError(FileNotFoundError):
    """A Hub model id whose files cannot be had: not in the cache while offline, or a repository,
    revision or file the Hub does not have (or lets this token see)."""


@dataclass(frozen=True)
class HubId:
    """A parsed `org/name[@revision][:file]`. `revision` None means `main`."""

    repo_id: str
    revision: str | None = None
    filename: str | None = None

    def __str__(self) -> str:
        return (self.repo_id + (f"@{self.revision}" if self.revision else "")
                + (f":{self.filename}" if self.filename else ""))


def parse_hub_id(name: str) -> HubId | None:
    """`name` as a Hub id, or None when it does not have the form `org/name[@revision][:file]`
    (a bare name, a path with more than one `/`, an absolute or `./` path, ...).

    The file comes after the first `:` (repo ids and git revisions cannot contain one), the
    revision after the `@` of what precedes it. Raises `ValueError` for an id whose form is right
    but whose parts are not (an empty revision, a file path that leaves the repo)."""
    name = str(name)
    repo_rev, sep, filename = name.partition(":")
    repo, at, revision = repo_rev.partition("@")
    org, slash, model = repo.partition("/")
    if not slash or not all(_PART.fullmatch(p) and "--" not in p and ".." not in p for p in (org, model)):
        return None
    if (at and not revision) or (sep and not filename):
        raise ValueError(f"Hub id {name!r}: empty {'revision after @' if at and not revision else 'file after :'}"
                         " (the form is org/name[@revision][:file.gguf])")
    if sep and (filename.startswith("/") or ".." in Path(filename).parts):
        raise ValueError(f"Hub id {name!r}: the file {filename!r} must be a path inside the repository")
    if sep and not filename.lower().endswith(".gguf"):
        raise ValueError(f"Hub id {name!r}: the file after ':' must be a .gguf file (a repo with a "
                         "config.json loads without naming a file)")
    return HubId(repo, revision or None, filename or None)


def hub_cache_dir() -> Path:
    """The Hub cache directory, as huggingface_hub computes it, from the environment now."""
    env = os.environ
    for key in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if env.get(key):
            return Path(os.path.expandvars(env[key])).expanduser()
    if env.get("HF_HOME"):
        return Path(os.path.expandvars(env["HF_HOME"])).expanduser() / "hub"
    xdg = env.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg).expanduser() / "huggingface" / "hub"


def hub_offline() -> bool:
    """`HF_HUB_OFFLINE` (or `TRANSFORMERS_OFFLINE`) is set to 1/true/yes/on, now or when
    huggingface_hub was imported (it reads the flag once, at import)."""
    if any(os.environ.get(k, "").strip().lower() in _TRUE for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")):
        return True
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def resolve_hub_model(hub: HubId | str, *, weights: bool = True) -> tuple[str, Path]:
    """`("hf", snapshot directory)` or `("gguf", snapshot path of the file)` for a Hub id.

    Args:
        hub: a `HubId` or its string form.
        weights: False when only the config and tokenizer are wanted (a tokenizer lookup): an
            HF repo's weights are then neither downloaded nor required. A GGUF holds its
            tokenizer, so a GGUF repo's file is always needed.

    Raises:
        HubModelNotFoundError: the files cannot be had (see the class); the message names the
            id, the revision, the cache directory and the offline flag.
        ValueError: a repo that is no model lcx loads (no config.json, no .gguf file), or one
            with several .gguf files and none named.
    """
    if isinstance(hub, str):
        parsed = parse_hub_id(hub)
        if parsed is None:
            raise ValueError(f"{hub!r} is not a Hub model id (org/name[@revision][:file.gguf])")
        hub = parsed
    from huggingface_hub import errors, hf_hub_download, snapshot_download

    cache, offline = hub_cache_dir(), hub_offline()
    not_found = tuple(getattr(errors, n) for n in (
        "LocalEntryNotFoundError", "EntryNotFoundError", "RepositoryNotFoundError", "RevisionNotFoundError",
        "GatedRepoError", "IncompleteSnapshotError") if hasattr(errors, n))
    common = dict(repo_id=hub.repo_id, revision=hub.revision, cache_dir=str(cache), local_files_only=offline)
    try:
        if hub.filename is not None:
            return "gguf", Path(hf_hub_download(filename=hub.filename, **common))
        snap = Path(snapshot_download(allow_patterns=["config.json"] if offline else list(CONFIG_FILES), **common))
        if not (snap / "config.json").is_file():
            ggufs = _gguf_files(hub, snap, cache, offline)
            if len(ggufs) != 1:
                raise ValueError(_gguf_choice_message(hub, snap, ggufs))
            # the snapshot path (a symlink into blobs/) keeps the file's name, which transformers
            # and lcx's GGUF cache read
            return "gguf", Path(hf_hub_download(filename=ggufs[0], **common))
        if not weights:
            return "hf", snap
        for single, index in WEIGHTS:
            names = _shards(snap / index) if (snap / index).is_file() else [single]
            # online: downloads them (nothing if the repo has none); offline: huggingface_hub's
            # completeness check where it cached the repo's file list
            snap = Path(snapshot_download(allow_patterns=names, **common))
            missing = [n for n in names if not (snap / n).is_file()]
            if not missing:
                return "hf", snap
            if (snap / index).is_file():
                raise HubModelNotFoundError(_describe(
                    hub, cache, offline, f"the snapshot {snap} misses {len(missing)} of the {len(names)} "
                    f"weight shards its {index} names ({', '.join(missing[:3])})"))
        raise HubModelNotFoundError(_describe(
            hub, cache, offline, f"the snapshot {snap} holds config.json but no weights (model.safetensors, "
            "pytorch_model.bin or the shards of their index)" + (": only part of the repo is cached" if offline else "")))
    except not_found as e:
        if isinstance(e, errors.LocalEntryNotFoundError) and not isinstance(e, getattr(errors, "IncompleteSnapshotError", ())):
            # huggingface_hub's text speaks of its own arguments (local_files_only); say what is missing
            what = (f"{hub.filename} is not cached for revision {hub.revision or 'main'!r}" if hub.filename
                    else f"no snapshot of revision {hub.revision or 'main'!r} is cached")
            cause = what if offline else f"{what}, and the Hub could not be reached ({_first_line(e)})"
        else:
            cause = f"{type(e).__name__}: {_first_line(e)}"
        raise HubModelNotFoundError(_describe(hub, cache, offline, cause)) from e


def _gguf_files(hub: HubId, snap: Path, cache: Path, offline: bool) -> list[str]:
    """The repo's .gguf files: the Hub's listing online, the cached snapshot's files offline or
    when the Hub cannot be reached."""
    cached = sorted(str(p.relative_to(snap)) for p in snap.rglob("*.gguf"))
    if offline:
        return cached
    from huggingface_hub import errors, snapshot_download

    try:  # a listing, nothing downloaded; the revision as given, so an unreachable Hub fails fast
        infos = snapshot_download(hub.repo_id, revision=hub.revision, cache_dir=str(cache), allow_patterns=["*.gguf"],
                                  dry_run=True)
    except errors.DryRunError:
        return cached
    return sorted(i.filename for i in infos)


def _gguf_choice_message(hub: HubId, snap: Path, ggufs: list[str]) -> str:
    if not ggufs:
        return (f"Hub model {str(hub)!r} has neither a config.json nor a .gguf file (snapshot {snap}): "
                "not a model lcx loads")
    return (f"Hub model {str(hub)!r} holds {len(ggufs)} .gguf files; name one as "
            f"{hub.repo_id}{'@' + hub.revision if hub.revision else ''}:FILE, one of {ggufs}")


def _shards(index: Path) -> list[str]:
    """The weight files a sharded checkpoint's index names."""
    return sorted(set(json.loads(index.read_text()).get("weight_map", {}).values()))


def cached_revisions(repo_id: str, cache: Path | None = None) -> dict[str, str]:
    """What the cache holds of `repo_id`: `{ref name: commit}` for the refs, and each snapshot
    commit no ref points to as `{commit: commit}`."""
    folder = (cache or hub_cache_dir()) / ("models--" + repo_id.replace("/", "--"))
    out: dict[str, str] = {}
    refs = folder / "refs"
    if refs.is_dir():
        for f in sorted(p for p in refs.rglob("*") if p.is_file()):
            out[str(f.relative_to(refs))] = f.read_text().strip()
    snaps = folder / "snapshots"
    if snaps.is_dir():
        for s in sorted(p.name for p in snaps.iterdir() if p.is_dir()):
            if s not in out.values():
                out[s] = s
    return out


def _describe(hub: HubId, cache: Path, offline: bool, cause: str) -> str:
    rev = hub.revision or "main"
    have = cached_revisions(hub.repo_id, cache)
    cached = ("the cache holds " + ", ".join(k if k == v else f"{k} -> {v[:12]}" for k, v in have.items())
              if have else "the cache holds nothing of this repo")
    if offline:
        how = ("HF_HUB_OFFLINE=1: nothing is downloaded; download it where the network is reachable "
               f"(`hf download {hub.repo_id}{' ' + hub.filename if hub.filename else ''}"
               f"{' --revision ' + rev if hub.revision else ''}`) into this cache, "
               "or point HF_HUB_CACHE / HF_HOME at a cache that holds it")
    else:
        how = ("HF_HUB_OFFLINE=0: check the id and revision, the network, and for a gated or private repo "
               "a token with access (HF_TOKEN or `hf auth login`)")
    return (f"Hugging Face model {str(hub)!r} (revision {rev!r}) is not available: {cause.rstrip('.')}. "
            f"Cache {cache}: {cached}. {how}.")


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__

