"""Load a tokenizer offline, resolve what the output depends on (eos, vocab, dtype, identity), and encode.

The reference encoding (docs/design.md, "Semantics") is `tokenizers.Tokenizer` with
`encode_special_tokens = True` and no added special tokens: literal "<|endoftext|>" in a web page is
text, and the only special ids in the output are the EOS ids tokpipe places. Two backends produce it:

- `hf`: tokenizers itself (~2 MB/s a core here).
- `fastokens`: a Rust BPE that loads the same tokenizer.json and encodes special-token strings as
  text when asked (`split_special_tokens=True`); one flat uint32 buffer per batch, no per-token
  Python; memory bounded (measured: 269 MiB flat over 500 MB of long-tail text). ~130 MB/s a core
  on distinct text here.
- `gigatoken`: another Rust BPE (~90 MB/s a core on distinct text), given the tokenizer without its
  special tokens so that their strings stay text; its word cache never evicts (memory.MemoryGuard),
  and it swaps the tokens of some rare-script pairs (HARD_CASES).
`auto` takes the first of FAST_BACKENDS that gives exactly the reference ids on the known hard
cases and on a sample of the actual data, else `hf`.
"""

from __future__ import annotations

import ctypes
import gc
import hashlib
import json
import os
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import orjson
from tokenizers import Tokenizer

from tokpipe.errors import UserError
from tokpipe.inputs.pieces import PIECE_CHARS, piece_tokens, pieces

FAST_BACKENDS = ("fastokens", "gigatoken")  # auto's order of preference: the faster first
BACKENDS = ("auto", *FAST_BACKENDS, "hf")

# Texts where BPE implementations are known to part ways: specials as text, whitespace and digit runs,
# normalization (NFC), scripts without spaces, emoji, control characters, replacement characters.
HARD_CASES = [
    "<|endoftext|> and <|im_start|>user\n<think>hm</think><|im_end|>",
    " " * 5000 + "x" + "\n" * 300 + "\t\t  \r\n \u3000 end",
    "1234567890" * 300 + " 3.14159 1,000,000",
    "e\u0301 \u212b \u00c5 \ufb01 \uff21\uff22 \u0130stanbul",
    "吾輩は猫である。名前はまだ無い。 สวัสดีครับ مرحبا بالعالم 안녕하세요",
    "emoji 👩‍👩‍👧‍👦 🇩🇪 \x00 \x7f \ufffd\ufffd 's 'S 'll 'LL",
    "def f(x):\n\treturn x  # comment\r\n\n\n    pass\n",
    # Two combining marks (Hanifi Rohingya, Sogdian): gigatoken 0.10's NFC reorders them, tokenizers'
    # keeps them (found in 240 MB of distinct text: the one document where fastokens and gigatoken differed).
    "\U00010d27\U00010f46",
]


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

    @property
    def id(self) -> str:
        return f"{self.name}@sha256:{self.sha256[:16]}"


def dtype_for(vocab_size: int) -> str:
    """The smallest unsigned type that holds every id: uint16 only when all ids are < 65536."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def _token_content(value) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


HUB_NAME = re.compile(r"[\w.-]+/[\w.-]+")  # ORG/NAME, as the hub names a repository


def _download_command(repo_id: str, revision: str | None) -> str:
    """How to put a repository's tokenizer into the cache, with the CLI this huggingface_hub ships
    (`hf` since 0.34; before, `huggingface-cli`)."""
    import huggingface_hub

    version = tuple(int(part) for part in re.findall(r"\d+", huggingface_hub.__version__)[:2])
    cli = "hf" if version >= (0, 34) else "huggingface-cli"
    return f"{cli} download {repo_id}{f' --revision {revision}' if revision else ''} --include 'tokenizer*'"


def _from_hub_cache(repo_id: str, revision: str | None) -> Path:
    """tokenizer.json of a hub repository's snapshot in the local Hugging Face cache, found as
    huggingface_hub finds it (HF_HUB_CACHE or HF_HOME; refs/REV or snapshots/COMMIT), never downloaded."""
    from huggingface_hub import constants, hf_hub_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        found = hf_hub_download(repo_id, "tokenizer.json", revision=revision, local_files_only=True)
    except LocalEntryNotFoundError:
        raise UserError(
            f"no tokenizer {repo_id} (revision {revision or 'main'}) in the Hugging Face cache "
            f"{constants.HF_HUB_CACHE} (set by HF_HUB_CACHE or HF_HOME), and no local folder of that name: "
            f"fetch it with `{_download_command(repo_id, revision)}`; tokpipe never downloads"
        ) from None
    return Path(os.path.abspath(found))  # the snapshot's path, not its blob's: the folder holds the config too


def _is_hub_name(text: str) -> bool:
    if not HUB_NAME.fullmatch(text):
        return False
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(text)
    except HFValidationError:  # e.g. ./qwen3, a--b/c: a path, not a name
        return False
    return True


def _cache_snapshot(json_path: Path) -> tuple[str, str] | None:
    """(ORG/NAME, commit) of a tokenizer.json inside a Hugging Face cache snapshot
    (models--ORG--NAME/snapshots/COMMIT/), as `status` prints a hub run's resume command; else None."""
    snapshot = json_path.parent
    repo = snapshot.parent.parent.name
    if snapshot.parent.name == "snapshots" and repo.startswith("models--"):
        return repo.removeprefix("models--").replace("--", "/", 1), snapshot.name
    return None


def _resolve(path: str | os.PathLike, revision: str | None = None) -> tuple[Path, str | None, str | None]:
    """(tokenizer.json, hub repo id, commit): a local path that exists wins over a hub name; the repo
    id and commit are None for a folder outside the Hugging Face cache."""
    local = Path(path)
    if local.exists() or not _is_hub_name(str(path)):
        candidate = local / "tokenizer.json" if local.is_dir() else local
        if not candidate.is_file():
            raise UserError(
                f"no tokenizer at {path}: pass a local folder holding tokenizer.json (as saved by save_pretrained), "
                "the tokenizer.json itself, or a hub name ORG/NAME in your Hugging Face cache; tokpipe never downloads"
            )
        hub = _cache_snapshot(Path(os.path.abspath(candidate)))
        if revision is not None and hub is None:
            raise UserError(
                f"--tokenizer-revision picks a revision of a hub name ORG/NAME; {path} is a local path: drop the option"
            )
        return (Path(os.path.abspath(candidate)), *hub) if hub else (candidate, None, None)
    found = _from_hub_cache(str(path), revision)
    return found, str(path), found.parent.name  # snapshots/<commit>/tokenizer.json


def tokenizer_json_path(path: str | os.PathLike, revision: str | None = None) -> Path:
    """The tokenizer.json that `path` names: a folder, the file, or a hub name ORG/NAME in the HF cache."""
    return _resolve(path, revision)[0]


def load_tokenizer_info(
    path: str | os.PathLike, eos_token: str | None = None, bos_token: str | None = None, revision: str | None = None
) -> TokenizerInfo:
    """What the output depends on, from a local tokenizer (folder or tokenizer.json) or a hub name
    ORG/NAME found in the local Hugging Face cache (at `revision`, default main)."""
    json_path, repo_id, commit = _resolve(path, revision)
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
    bos = bos_token or _token_content(config.get("bos_token"))
    name = repo_id or (json_path.parent.name if json_path.name == "tokenizer.json" else json_path.stem)
    info = TokenizerInfo(
        path=str(json_path if repo_id else json_path.resolve()),  # a snapshot's path, not its blob's
        name=name,
        sha256=sha256,
        vocab_size=vocab_size,
        eos_token=eos,
        eos_id=tok.token_to_id(eos),
        bos_token=bos,
        bos_id=tok.token_to_id(bos) if bos else None,
        dtype=dtype_for(vocab_size),
        repo_id=repo_id,
        revision=commit,
    )
    # What follows the info (the backend check, inspect's decoding) encodes with the reference:
    # this load serves it, instead of a second one of the same file.
    _encoders.setdefault(("hf", info.path), HFEncoder(info.path, tok))
    return info


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


class Encoder:
    """What every backend shares: texts of more than PIECE_CHARS are encoded a piece at a time, where
    the tokenizer allows it (piece_tokens), so an encode call's memory is bounded by a piece, not by
    the longest document; the ids are the same. Each backend's `_encode` encodes a list of texts."""

    name: str
    # Whether the encoder's memory stops growing however much distinct text it reads: write.memory then lets it
    # keep its working set, and drops it only near the worker's limit.
    bounded_cache = False

    def __init__(self, tokenizer_json: str, config: dict | None = None):
        # `config`: the tokenizer.json a backend has parsed already (11 MB for Qwen3), not read twice.
        self.piece_tokens = piece_tokens(config or orjson.loads(Path(tokenizer_json).read_bytes()))

    def encode(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """(flat uint32 ids of all texts, int64 token count per text)."""
        if self.piece_tokens is None or all(len(text) <= PIECE_CHARS for text in texts):
            return self._encode(texts)
        parts, lengths, short = [], np.zeros(len(texts), np.int64), []

        def flush() -> None:  # the short texts so far, in one call as ever
            if short:
                flat, lengths[short] = self._encode([texts[i] for i in short])
                parts.append(flat)
                short.clear()

        for i, text in enumerate(texts):
            if len(text) <= PIECE_CHARS:
                short.append(i)
                continue
            flush()
            for start, end in pieces(text, self.piece_tokens):
                flat, _ = self._encode([text[start:end]])
                parts.append(flat)
                lengths[i] += flat.size
        flush()
        return np.concatenate(parts), lengths

    def _encode(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        raise NotImplementedError


class HFEncoder(Encoder):
    """The reference: tokenizers, special-token strings encoded as text."""

    name = "hf"

    def __init__(self, tokenizer_json: str, loaded: Tokenizer | None = None):
        super().__init__(tokenizer_json)
        self._tok = loaded or Tokenizer.from_file(tokenizer_json)
        self._tok.encode_special_tokens = True

    def _encode(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        encodings = self._tok.encode_batch_fast(texts, add_special_tokens=False)
        lengths = np.fromiter((len(e.ids) for e in encodings), dtype=np.int64, count=len(encodings))
        if not encodings:
            return np.empty(0, np.uint32), lengths
        return np.concatenate([np.asarray(e.ids, dtype=np.uint32) for e in encodings]), lengths

    def decode(self, ids: np.ndarray) -> str:
        """Text of ids, special tokens included as their text (`inspect` marks EOS itself, before this)."""
        return self._tok.decode(ids.tolist(), skip_special_tokens=False)


class GigatokenEncoder(Encoder):
    name = "gigatoken"

    def __init__(self, tokenizer_json: str):
        import gigatoken

        config = orjson.loads(Path(tokenizer_json).read_bytes())
        super().__init__(tokenizer_json, config)  # before gigatoken's copy drops the special added tokens
        config["added_tokens"] = [t for t in config.get("added_tokens", []) if not t.get("special")]
        self._tok = gigatoken.Tokenizer.from_json(orjson.dumps(config))

    def _encode(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        # One worker process per core: the encoder stays on the calling thread.
        encoded = self._tok.encode_batch(texts, parallel=False)
        # Numpy views of awkward's ids and offsets (awkward's own ak.num/ak.flatten cost ~1 ms a call).
        layout = encoded.layout.to_ListOffsetArray64(True)  # start_at_zero; no copy when it already is one
        offsets = np.asarray(layout.offsets.data)
        flat = np.asarray(layout.content.data)[: offsets[-1]]
        return flat.astype(np.uint32, copy=False), np.diff(offsets)


class FastokensEncoder(Encoder):
    name = "fastokens"
    # Measured (Qwen3, one thread): RSS 113 MiB loaded, 330 MiB after 117 MB of text, 332 MiB after 770 MB of
    # distinct documents with a never-seen identifier after every 4th word. Dropped at a third of its room, as
    # a growing cache is, it was dropped at that plateau and paid its load again (1.0-1.3 s) and a cold cache
    # (20-27 MB/s against ~65 warm) for nothing.
    bounded_cache = True

    def __init__(self, tokenizer_json: str):
        super().__init__(tokenizer_json)
        # One worker per core: fastokens builds a pool of all cores at its first encode unless told
        # (measured: 1.8 CPU-s per wall-s without this, 1.0 with it).
        os.environ["FASTOKENS_BPE_THREADS"] = "1"
        import fastokens

        self._tok = fastokens.Tokenizer.from_file(tokenizer_json)
        # Off by default, but an inherited FASTOKENS_SEGMENT_CACHE would turn it on: it caches text
        # between added tokens, for chat traffic; on documents it held ~2 MiB and changed no speed.
        self._tok.enable_segment_cache(0)

    def _encode(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        ids, offsets = self._tok.encode_batch_flat(texts, add_special_tokens=False, split_special_tokens=True)
        return np.frombuffer(ids, dtype="<u4"), np.diff(np.frombuffer(offsets, dtype="<u8")).astype(np.int64)


_ENCODER_CLASSES = {"hf": HFEncoder, "fastokens": FastokensEncoder, "gigatoken": GigatokenEncoder}
_encoders: dict[tuple[str, str], Encoder] = {}


def encoder(backend: str, tokenizer_json: str):
    """A process-wide encoder: Ray reuses worker processes, so shards after the first skip the load."""
    key = (backend, tokenizer_json)
    if key not in _encoders:
        _encoders[key] = _ENCODER_CLASSES[backend](tokenizer_json)
    return _encoders[key]


def drop_encoder(backend: str, tokenizer_json: str) -> None:
    """Forget the process's encoder and hand its memory back to the OS (the next `encoder` call reloads it).

    The word cache is millions of small allocations: freed, they stay in glibc's heap as far as RSS
    shows unless it is trimmed (measured: 555 MiB -> 193 dropped -> 139 trimmed).
    """
    _encoders.pop((backend, tokenizer_json), None)
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: what was freed is reused by the next cache all the same
        pass


def _differing(found: tuple[np.ndarray, np.ndarray], reference: tuple[np.ndarray, np.ndarray]) -> list[int]:
    """Which texts a backend encodes to other ids than the reference: `found` and `reference` are their (flat
    ids, lengths) of the same texts."""
    (ids, lengths), (ref_ids, ref_lengths) = found, reference
    if np.array_equal(lengths, ref_lengths) and np.array_equal(ids, ref_ids):
        return []
    ends, ref_ends = np.cumsum(lengths), np.cumsum(ref_lengths)
    return [
        i
        for i in range(len(lengths))
        if not np.array_equal(ids[ends[i] - lengths[i] : ends[i]], ref_ids[ref_ends[i] - ref_lengths[i] : ref_ends[i]])
    ]


def choose_backend(requested: str, tokenizer_json: str, sample_texts: list[str]) -> tuple[str, str]:
    """(backend, why). `auto`: the first fast backend that gives exactly the reference ids on the
    hard cases and on the sample of the data, else hf. A backend asked for by name must match on the
    sample; where it misses a known hard case, `why` says so (the run goes on: it was asked for)."""
    if requested == "hf":
        return "hf", "requested"
    # A long document is checked on its beginning: the whole would cost the reference 150-350 bytes a
    # character and ~0.25 s a megabyte (the run encodes it a piece at a time, each piece a text like these).
    cut = sum(len(text) > PIECE_CHARS for text in sample_texts)
    sample_texts = [text[:PIECE_CHARS] for text in sample_texts]
    texts, passed_over = sample_texts + HARD_CASES, []
    with ThreadPoolExecutor(1) as beside:
        # The reference's ids, encoded while the first fast backend loads: both let go of the GIL (Qwen3 on the
        # example's 543 K characters: 1.20 s for the two, against 1.76 one after the other).
        reference = beside.submit(encoder("hf", tokenizer_json).encode, texts)
        for backend in FAST_BACKENDS if requested == "auto" else (requested,):
            try:
                fast = encoder(backend, tokenizer_json)
            except Exception as e:  # unsupported tokenizer types raise from the Rust loaders
                if requested != "auto":
                    raise UserError(
                        f"--backend {backend} cannot load this tokenizer ({e}): use --backend auto or hf",
                        fix={"backend": "auto"},
                    ) from None
                passed_over.append(f"{backend} cannot load this tokenizer ({type(e).__name__}: {e})")
                continue
            differing = _differing(fast.encode(texts), reference.result())
            found = _verdict(requested, backend, differing, sample_texts, cut, passed_over)
            if found is not None:
                return found
    return "hf", "; ".join(passed_over)


def _verdict(requested: str, backend: str, differing: list[int], sample: list[str], cut: int, passed_over: list[str]):
    """What choose_backend makes of a backend whose ids differ from the reference's on these texts (`sample`'s,
    then HARD_CASES'): (backend, why); None to try the next, noted in `passed_over`; or a UserError."""
    on_sample = [i for i in differing if i < len(sample)]
    on_hard = [i - len(sample) for i in differing if i >= len(sample)]
    matched = f"matched tokenizers on {len(sample) + len(HARD_CASES)} texts ({sum(map(len, sample)):,} chars of sample)"
    if cut:
        matched += f"; {cut} longer document(s) of the sample checked on their first {PIECE_CHARS:,} chars"
    if requested == "auto" and not on_sample and not on_hard:
        return backend, "; ".join([*passed_over, f"{backend} {matched}"])
    if requested == "auto":
        passed_over.append(
            f"{backend}'s ids differ from tokenizers' on {len(on_sample)} sampled and {len(on_hard)} hard-case texts"
        )
        return None
    if on_sample:
        raise UserError(
            f"--backend {backend} does not reproduce tokenizers' ids on this tokenizer and data: use --backend auto",
            fix={"backend": "auto"},
        )
    if on_hard:
        example = ascii(HARD_CASES[on_hard[0]][:40])
        return backend, (
            f"requested; matched tokenizers on the sample, but NOT on {len(on_hard)} known hard case(s), e.g."
            f" {example}: its ids differ where such text occurs (--backend auto picks an exact backend)"
        )
    return backend, f"requested; {matched}"
