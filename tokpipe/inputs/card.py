"""A hub repo's dataset card (README.md): its YAML `configs:`, read as Hugging Face `datasets` reads them, so that a
manifest holds the files `load_dataset` would read, in the same splits, each once.

A config names its files per split in `data_files` (datasets/utils/metadata.py MetadataConfigs, read at 5.2): a glob
or a list of globs (the train split), or a list of `{split, path}` (path a glob or a list of them), relative to the
repo's root, or to the config's `data_dir`. The config read is the one asked (`--config`, repeatable: several
configs' files, each file once), else the default: a lone config, the one named `default`, or the one marked
`default: true`; with several and none the default, the manifest is refused naming them, as `load_dataset` asks
which. A config with a data_dir and no data_files, and a repo whose card has no `configs:`, are read by the file
names' rules (names.py) under it.

Globs are fsspec's, as `datasets` resolves them: `*` and `?` within a name, `**` across folders; a hidden file or
folder (`.x`), or a special folder (`__x`), matches only a pattern that names it so, with or without a card.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from dataclasses import dataclass

from tokpipe.errors import UserError
from tokpipe.inputs.names import hidden_parts, is_metadata, one_format, splits_of, unrequested

CARD = "README.md"
HIDDEN = "hidden (a name in its path begins with `.`), or in a folder named `__*`: Hugging Face datasets reads neither"
# The splits a manifest holds (train.bin, val.bin, test: docs/design.md); a config's other split names are refused.
SPLITS = ("train", "validation", "test")


@dataclass(frozen=True)
class Chosen:
    """The configs read and each split's globs (over the repo's relpaths), in the card's order."""

    names: tuple[str, ...]
    patterns: dict[str, list[str]]  # split -> globs, relative to the repo's root
    folders: tuple[str, ...] = ()  # data_dirs of configs with no data_files: their files split by their names
    each: tuple[tuple[str, str, tuple[str, ...]], ...] = ()  # (config, split, its globs): each must name a file

    @property
    def hidden(self) -> bool:
        """Whether a glob names a hidden file or folder: only then are hidden folders walked (a clone's .git)."""
        return any(hidden_parts(glob) for _, _, globs in self.each for glob in globs)

    def split_of(self, relpath: str, inferred: dict[str, str]) -> str | None:
        """The split a file is read into (None: no config read names it), `inferred` its split in a data_dir; two
        splits naming it are refused."""
        named = {split for split, globs in self.patterns.items() if any(_match(g, relpath) for g in globs)}
        named = sorted(named | ({inferred[relpath]} if relpath in inferred else set()))
        if len(named) > 1:
            raise UserError(
                f"{relpath} is in the data_files of {' and '.join(named)} of config {', '.join(self.names)}"
                f" ({CARD}), and Hugging Face datasets would read it into each: fix the card's data_files"
            )
        return named[0] if named else None


def splits(chosen: Chosen | None, relpaths: list[str]) -> tuple[dict[str, str], dict[str, str]]:
    """The split each file of data is read into, and why each other is left out: by the configs read (in a data_dir,
    by its files' names), or without a card's configs, by the names (names.splits_of); of those, the files of the
    one format HF datasets reads them in (names.one_format). HF's metadata files are in neither: never data."""
    relpaths = [r for r in relpaths if not is_metadata(r)]
    if chosen is None:
        hidden = {r: HIDDEN for r in relpaths if unrequested(r)}
        placed, left = splits_of([r for r in relpaths if r not in hidden])
        kept, other = one_format(placed)
        return kept, left | other | hidden
    for config, split, globs in chosen.each:  # as load_dataset, which refuses a config of a split with no file
        twice = next((r for r in relpaths if sum(_match(g, r) for g in globs) > 1), None)
        if twice is not None:
            raise UserError(
                f"{twice} is named by two of config {config}'s data_files ({', '.join(globs)}), and Hugging Face"
                f" datasets would read it twice ({CARD}): fix the card's data_files"
            )
        if not any(_match(g, r) for g in globs for r in relpaths):
            named = "data_dir" if split == "" else f"{split} data_files"
            raise UserError(
                f"config {config}'s {named} ({', '.join(globs)}) name no file of data ({CARD}): load_dataset refuses"
                " such a config too; fix the card, or pick another with --config NAME"
            )
    inferred = {}
    for folder in chosen.folders:
        under = [r.removeprefix(f"{folder}/") for r in relpaths if r.startswith(f"{folder}/")]
        under = splits_of([r for r in under if not unrequested(r)])[0]
        inferred |= {f"{folder}/{relpath}": split for relpath, split in under.items()}
    placed = {r: split for r in relpaths if (split := chosen.split_of(r, inferred))}
    kept, other = one_format(placed)
    why = f"not in the data_files of config {', '.join(chosen.names)} ({CARD}'s configs)"
    return kept, {r: why for r in relpaths if r not in placed} | other


def configs_of(card: str) -> dict[str, dict]:
    """The card's configs by name, as its YAML front matter lists them ({} without one)."""
    if not card.startswith("---"):
        return {}
    import yaml  # only where a card has a YAML header

    front = card.split("\n---", 1)[0].removeprefix("---")
    try:
        data = yaml.safe_load(front) or {}
    except yaml.YAMLError as e:
        raise UserError(f"{CARD}'s YAML header does not parse ({' '.join(str(e).split())}): fix the card") from None
    listed = data.get("configs") if isinstance(data, dict) else None
    if listed is None:
        return {}
    if not isinstance(listed, list) or not all(isinstance(c, dict) and "config_name" in c for c in listed):
        raise UserError(f"{CARD}'s configs: is not a list of configs, each with a config_name: fix the card")
    return {str(c["config_name"]): c for c in listed}


def choose(configs: dict[str, dict], asked: tuple[str, ...], where: str) -> Chosen | None:
    """The configs to read: those `asked`, else the default one; None where the card lists none."""
    if not configs:
        if asked:
            raise UserError(f"--config {asked[0]}: {where} has no configs in its {CARD}; leave --config out")
        return None
    names = ", ".join(configs)
    default = [n for n, c in configs.items() if len(configs) == 1 or n == "default" or c.get("default")]
    if len(default) > 1:  # load_dataset refuses the card, whichever config is asked
        raise UserError(f"{where}'s {CARD} marks several configs the default ({', '.join(default)}): fix the card")
    if asked:
        unknown = [name for name in asked if name not in configs]
        if unknown:
            raise UserError(f"--config {unknown[0]}: {where}'s {CARD} lists configs {names}; name one of them")
    elif not default:
        raise UserError(
            f"{where}'s {CARD} lists configs {names} and none is the default: pick one with --config NAME (repeat it to"
            " read several)"
        )
    else:
        asked = tuple(default)
    patterns: dict[str, list[str]] = {}
    folders, each = [], []
    for name in asked:
        config = configs[name]
        if (field := config.get("field")) is not None:  # the json builder's: each file one object, a list in it
            raise UserError(
                f"config {name} reads each JSON file's documents from its {field!r} list (field: in its {CARD}):"
                f" tokpipe reads JSON Lines and JSON arrays, not a list inside an object: write the items as JSON"
                f" Lines (jq -c '.{field}[]' FILE > FILE.jsonl) and read those"
            )
        data_dir = str(config.get("data_dir") or "").strip("/")
        if config.get("data_files") is None:
            if not data_dir:
                raise UserError(f"config {name} names neither data_files nor a data_dir ({CARD}): fix the card")
            folders.append(data_dir)
            each.append((name, "", (f"{data_dir}/**",)))
            continue
        for split, globs in _data_files(config["data_files"], name).items():
            globs = tuple(f"{data_dir}/{g}" if data_dir else g for g in globs)
            patterns.setdefault(split, []).extend(globs)
            each.append((name, split, globs))
    return Chosen(tuple(asked), patterns, tuple(folders), tuple(each))


def _data_files(data_files, config: str) -> dict[str, list[str]]:
    """A config's data_files as {split: globs} (datasets' sanitize_patterns): a glob or a list of them is train's. What
    load_dataset refuses in a card (MetadataConfigs: a mapping of splits, an item with other keys, a split twice) is
    refused."""
    if isinstance(data_files, str):
        data_files = [data_files]
    if not isinstance(data_files, list):
        raise UserError(
            f"config {config}'s data_files is neither a glob nor a list ({CARD}), and load_dataset refuses it: write"
            " its splits as a list of `- split: NAME` / `path: GLOB`"
        )
    if not any(isinstance(item, dict) for item in data_files):
        return {"train": [str(g) for g in data_files]}
    found: dict[str, list[str]] = {}
    for item in data_files:
        if not (isinstance(item, dict) and item.keys() == {"split", "path"} and isinstance(item["path"], (str, list))):
            raise UserError(
                f"config {config}'s data_files item {item!r} is not a split and its path ({CARD}), and load_dataset"
                " refuses it: in a list of splits' paths, each item is `- split: NAME` / `path: GLOB`, nothing else"
            )
        if str(item["split"]) in found:
            raise UserError(
                f"config {config}'s data_files names split {item['split']} twice ({CARD}), and load_dataset refuses"
                " it: give it one entry, its path a list of globs"
            )
        path = item["path"]
        found[str(item["split"])] = [path] if isinstance(path, str) else [str(p) for p in path]
    for split in found:
        if split not in SPLITS:
            raise UserError(
                f"config {config}'s split {split!r} ({CARD}): tokpipe writes the splits {', '.join(SPLITS)};"
                " read it with a card that names it one of them"
            )
    return found


def _match(glob: str, relpath: str) -> bool:
    return _compiled(glob)(relpath)


@functools.cache
def _compiled(glob: str) -> Callable[[str], bool]:
    """fsspec's glob (as `datasets` resolves data_files) as a test of a relpath; a hidden file, or one in a special
    folder, matched only where the glob says it (names.unrequested)."""
    from fsspec.utils import glob_translate  # only where a card has configs (fsspec's import: 0.1 s)

    glob = glob.removeprefix("./")
    try:
        full = re.compile(glob_translate(glob))
    except (re.error, ValueError) as e:  # ValueError: fsspec's, of a `**` that is not a whole path component
        raise UserError(f"data_files glob {glob!r} ({CARD}) is not a glob ({e}): fix the card") from None
    return lambda relpath: bool(full.match(relpath)) and not unrequested(relpath, glob)
