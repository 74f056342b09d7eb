"""Encode: the backends, each process's encoder, and the check that picks a backend.

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

import contextlib
import ctypes
import gc
import os
import threading
from concurrent.futures import ThreadPoolExecutor
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
_loads: dict[tuple[str, str], threading.Lock] = {}  # one load of each at a time: a second caller waits for it
_loads_lock = threading.Lock()


def encoder(backend: str, tokenizer_json: str):
    """A process-wide encoder: Ray reuses worker processes, so shards after the first skip the load."""
    key = (backend, tokenizer_json)
    if key not in _encoders:
        with _loads_lock:
            load = _loads.setdefault(key, threading.Lock())
        with load:
            if key not in _encoders:
                _encoders[key] = _ENCODER_CLASSES[backend](tokenizer_json)
    return _encoders[key]


def prefetch(backend: str, tokenizer_json: str) -> None:
    """A fast backend's encoder loading in a thread, for `encoder` to hand out once loaded (fastokens' and
    gigatoken's loaders let go of the GIL: Qwen3's 1.1 s went on beside as much of the caller's work)."""
    if backend in FAST_BACKENDS:
        threading.Thread(target=_load, args=(backend, tokenizer_json), name="tokpipe encoder", daemon=True).start()


def _load(backend: str, tokenizer_json: str) -> None:
    with contextlib.suppress(Exception):  # raised again where the encoder is asked for, by encoder()
        encoder(backend, tokenizer_json)


def keep_reference(tokenizer_json: str, loaded: Tokenizer) -> None:
    """The reference encoder of a tokenizer parsed already, for what asks for it next (the backend check,
    inspect's decoding): not a second load of the same file."""
    _encoders.setdefault(("hf", tokenizer_json), HFEncoder(tokenizer_json, loaded))


def likely_backend(requested: str) -> str:
    """The backend choose_backend will most likely pick: the one asked for, or auto's first."""
    return FAST_BACKENDS[0] if requested == "auto" else requested


def drop_encoder(backend: str, tokenizer_json: str) -> None:
    """Forget the process's encoder and hand its memory back to the OS (the next `encoder` call reloads it).

    The word cache is millions of small allocations: freed, they stay in glibc's heap as far as RSS
    shows unless it is trimmed (measured: 555 MiB -> 193 dropped -> 139 trimmed).
    """
    _encoders.pop((backend, tokenizer_json), None)
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):  # not glibc: what was freed is reused by the next cache anyway
        ctypes.CDLL("libc.so.6").malloc_trim(0)


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
