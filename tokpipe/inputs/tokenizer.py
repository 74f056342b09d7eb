"""Load a tokenizer offline and resolve what the output depends on: eos, vocab, dtype, identity (its
tokenizer.json's sha256, or a hub repo and commit). Encoding is encoders.py's.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

from tokpipe.errors import UserError
from tokpipe.inputs import encoders
from tokpipe.inputs.names import is_hub_name


@dataclass(frozen=True)
class TokenizerInfo:
    path: str  # the tokenizer.json
    name: str
    sha256: str  # of tokenizer.json: the tokenizer's identity in run.json and meta
    vocab_size: int  # len(tokenizer): max id + 1, added tokens included
    eos_token: str
    eos_id: int
    bos_token: str | None
    bos_id: int | None
    dtype: str  # uint16 | uint32
    repo_id: str | None = None  # ORG/NAME when --tokenizer named a hub repository (found in the HF cache)
    revision: str | None = None  # the commit of that repository's snapshot it was read from
    text_end: str | None = None  # the token a text ends with, where the config's eos is a chat turn's end (TURN_ENDS)
    text_start: str | None = None  # the token the tokenizer itself places before a text (_text_start)

    @property
    def id(self) -> str:
        return f"{self.name}@sha256:{self.sha256[:16]}"


# A chat model's tokenizer_config.json names the end of a turn its eos_token, where its base model's names the end of
# a text (Qwen2.5 and Qwen3 Instruct, SmolLM2-Instruct: <|im_end|>; Llama 3 Instruct: <|eot_id|>).
TURN_ENDS = {"<|im_end|>": "<|endoftext|>", "<|eot_id|>": "<|end_of_text|>"}


def dtype_for(vocab_size: int) -> str:
    """The smallest unsigned type that holds every id: uint16 only when all ids are < 65536."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def _text_start(tok: Tokenizer) -> str | None:
    """The token the tokenizer.json's post-processor places before a text (Llama's and Mistral's <s>, Gemma's <bos>,
    Llama 3's <|begin_of_text|>), as `tokenizer(text)` returns it in `tokenizers` and transformers; None: none."""
    placed, plain = (tok.encode("a", add_special_tokens=special).ids for special in (True, False))
    return tok.id_to_token(placed[0]) if placed[:1] != plain[:1] else None


def _token_content(value) -> str | None:
    return value.get("content") if isinstance(value, dict) else value


def _from_hub_cache(repo_id: str, revision: str | None) -> Path:
    """tokenizer.json of a hub repository's snapshot in the local Hugging Face cache, found as
    huggingface_hub finds it (HF_HUB_CACHE or HF_HOME; refs/REV or snapshots/COMMIT), never downloaded."""
    from huggingface_hub import __version__, constants, hf_hub_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        found = hf_hub_download(repo_id, "tokenizer.json", revision=revision, local_files_only=True)
    except LocalEntryNotFoundError:
        # Fetched with the CLI this huggingface_hub ships: `hf` since 0.34; before, `huggingface-cli`.
        version = tuple(int(part) for part in re.findall(r"\d+", __version__)[:2])
        cli = "hf" if version >= (0, 34) else "huggingface-cli"
        fetch = f"{cli} download {repo_id}{f' --revision {revision}' if revision else ''} --include 'tokenizer*'"
        raise UserError(
            f"no tokenizer {repo_id} (revision {revision or 'main'}) in the Hugging Face cache "
            f"{constants.HF_HUB_CACHE} (set by HF_HUB_CACHE or HF_HOME), and no local folder of that name: "
            f"fetch it with `{fetch}`; tokpipe never downloads"
        ) from None
    return Path(os.path.abspath(found))  # the snapshot's path, not its blob's: the folder holds the config too


def _other_format(local: Path) -> str:
    """What the user may mean by a tokenizer that is no tokenizer.json: a SentencePiece model (Llama 2's and
    Mistral's original checkpoints), or nanoGPT's tiktoken name "gpt2"."""
    if str(local) == "gpt2":
        return " (tiktoken's gpt2, as nanoGPT's prepare.py encodes, is the hub's openai-community/gpt2)"
    held = sorted(p.name for p in local.glob("*.model")) if local.is_dir() else []
    if not held:
        return ""
    save = "AutoTokenizer.from_pretrained(MODEL).save_pretrained(DIR)"
    return f" ({local} holds {', '.join(held)}, a SentencePiece model: transformers writes its tokenizer.json: {save})"


def _resolve(path: str | os.PathLike, revision: str | None = None) -> tuple[Path, str | None, str | None]:
    """(tokenizer.json, hub repo id, commit): a local path that exists wins over a hub name; the repo
    id and commit are None for a folder outside the Hugging Face cache."""
    local = Path(path)
    if local.exists() or not is_hub_name(str(path)):
        candidate = local / "tokenizer.json" if local.is_dir() else local
        if not candidate.is_file():
            raise UserError(
                f"no tokenizer at {path}: pass a local folder holding tokenizer.json (as saved by save_pretrained), "
                "the tokenizer.json itself, or a hub name ORG/NAME in your Hugging Face cache; tokpipe never downloads"
                + _other_format(local)
            )
        # Inside a Hugging Face cache snapshot (models--ORG--NAME/snapshots/COMMIT/): its ORG/NAME and commit, as
        # `status` prints a hub run's resume command.
        absolute = Path(os.path.abspath(candidate))
        snapshot = absolute.parent
        repo = snapshot.parent.parent.name
        if snapshot.parent.name == "snapshots" and repo.startswith("models--"):
            return absolute, repo.removeprefix("models--").replace("--", "/", 1), snapshot.name
        if revision is not None:
            raise UserError(
                f"--tokenizer-revision picks a revision of a hub name ORG/NAME; {path} is a local path: drop the option"
            )
        return candidate, None, None
    found = _from_hub_cache(str(path), revision)
    return found, str(path), found.parent.name  # snapshots/<commit>/tokenizer.json


def tokenizer_json_path(path: str | os.PathLike, revision: str | None = None) -> Path:
    """The tokenizer.json that `path` names: a folder, the file, or a hub name ORG/NAME in the HF cache."""
    return _resolve(path, revision)[0]


def load_tokenizer_info(
    path: str | os.PathLike,
    eos_token: str | None = None,
    bos_token: str | None = None,
    revision: str | None = None,
    prefetch: str | None = None,
) -> TokenizerInfo:
    """What the output depends on, from a local tokenizer (folder or tokenizer.json) or a hub name
    ORG/NAME found in the local Hugging Face cache (at `revision`, default main). `prefetch`: a backend whose
    encoder loads meanwhile, in a thread (encoders.prefetch)."""
    json_path, repo_id, commit = _resolve(path, revision)
    json_str = str(json_path if repo_id else json_path.resolve())  # a snapshot's path, not its blob's
    if prefetch is not None:
        encoders.prefetch(prefetch, json_str)
    raw = json_path.read_bytes()
    sha256 = hashlib.sha256(raw).hexdigest()
    tok, vocab_size = _parse(json_path, raw, sha256)

    config: dict = {}
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        cfg_path = json_path.parent / name
        if cfg_path.is_file():
            for key, value in json.loads(cfg_path.read_text()).items():
                config.setdefault(key, value)
    eos = eos_token or _token_content(config.get("eos_token"))
    if not eos:
        raise UserError(f"{json_path.parent} names no eos_token (tokenizer_config.json): pass --eos TOKEN")
    if tok.token_to_id(eos) is None:
        raise UserError(f"EOS token {eos!r} is not in the tokenizer's vocabulary: pass the right one with --eos")
    if bos_token is not None and tok.token_to_id(bos_token) is None:
        raise UserError(
            f"BOS token {bos_token!r} is not in the tokenizer's vocabulary: pass the right one with --bos-token"
        )
    text_start = _text_start(tok)
    bos = bos_token or _token_content(config.get("bos_token")) or text_start
    # What follows the info (the backend check, inspect's decoding) encodes with the reference:
    # this load serves it, instead of a second one of the same file.
    encoders.keep_reference(json_str, tok)
    return TokenizerInfo(
        path=json_str,
        name=repo_id or (json_path.parent.name if json_path.name == "tokenizer.json" else json_path.stem),
        sha256=sha256,
        vocab_size=vocab_size,
        eos_token=eos,
        eos_id=tok.token_to_id(eos),
        bos_token=bos,
        bos_id=tok.token_to_id(bos) if bos else None,
        dtype=dtype_for(vocab_size),
        repo_id=repo_id,
        revision=commit,
        text_end=None if eos_token or tok.token_to_id(TURN_ENDS.get(eos, "")) is None else TURN_ENDS[eos],
        text_start=text_start,
    )


_parsed: dict[str, tuple[Tokenizer, int]] = {}  # sha256 of a tokenizer.json -> (its tokenizer, vocab_size)


def _parse(json_path: Path, raw: bytes, sha256: str) -> tuple[Tokenizer, int]:
    """The tokenizer of these tokenizer.json bytes and its vocab_size (max id + 1), parsed once per process
    (0.9 s for Qwen3's, 0.3 of it the vocabulary's scan) however often a process asks: verify, inspect and
    runs called from one Python session, each with its own info. Only the last is kept (80 MiB for Qwen3's)."""
    if sha256 not in _parsed:
        try:
            tok = Tokenizer.from_str(raw.decode("utf-8"))
        except Exception as e:  # tokenizers raises plain Exception subclasses from Rust
            raise UserError(f"{json_path} is not a tokenizer.json that `tokenizers` can load: {e}") from None
        _parsed.clear()
        _parsed[sha256] = tok, max(tok.get_vocab(with_added_tokens=True).values()) + 1
    return _parsed[sha256]
