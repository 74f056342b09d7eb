"""What the driver reads of the corpus before any tokenizing: the first documents of each split, which the fast
encoder is proven exact on (and which refuse a --text-field no document has), and --group-by's first values."""

from __future__ import annotations

import os
from collections import Counter

from tokpipe.errors import SourceError, UserError, too_many_groups
from tokpipe.inputs.manifest import Manifest
from tokpipe.inputs.source import fields_of, read_batches
from tokpipe.inputs.source.batch import MISSING_GROUP
from tokpipe.layout.records import MAX_GROUPS
from tokpipe.layout.stored import on_store

SAMPLE_BYTES = 256 << 10  # of input per split, to prove the fast backend exact on this data (with HARD_CASES)
# A longer line is passed over by the sample (said in the backend's line), not read whole: the driver's
# memory does not grow with a document's size. Books (~0.5 MB) are sampled.
SAMPLE_LINE_BYTES = 4 << 20
# A chat dataset's documents are lists of turns ({"role": ..., "content": ...}): which tokens mark a turn is the
# model's chat template, not tokpipe's to guess.
CHAT_TURNS = "a conversation's turns are made one text by the model's chat template first (apply_chat_template)"
GROUP_SAMPLE_BYTES = 16 << 20  # of input per split read for --group-by's values before any tokenizing (~0.2 s)
# More shards of a split, spread over it, whose first batch is read before a --group-by field that no first shard has
# is refused: a corpus of several sources whose first lacks it is no typo.
GROUP_LOOK_SHARDS = 8


def sample_texts(manifest: Manifest, text_field: str) -> tuple[list[str], int]:
    """The first documents of each split's first shard: what the backend is checked on, and how many
    lines over SAMPLE_LINE_BYTES it passed over. Refuses, before anything is tokenized, a --text-field
    that none of those shards has."""
    if not on_store(manifest.base) and not os.path.isdir(manifest.base):  # else a line a shard
        raise UserError(
            f"the manifest's dataset {manifest.base} is not there (moved, renamed, or its file system not mounted):"
            " put it back, or make the manifest again where it is (`tokpipe manifest`): one of the same files"
            " resumes OUT"
        )
    texts, fields, passed_over, not_text = [], Counter(), 0, 0
    for split in manifest.counts:
        shard = next(manifest.shards(split))
        path, etag = shard.path, shard.etag
        if shard.may_block():
            continue
        try:
            found = fields_of(path, etag)
            batches = read_batches(
                path, text_field, batch_bytes=SAMPLE_BYTES, max_line_bytes=SAMPLE_LINE_BYTES, etag=etag
            )
            first = next(batches, None) if text_field in found else None
        except SourceError:  # an unreadable first shard: its own task reports it
            continue
        if text_field in found and first is not None:  # None: an empty shard
            texts += first.texts
            passed_over += first.skipped["too_long"]
            not_text += first.skipped["text_not_string"]
        fields.update(found)
    if not texts and not_text:  # a list, an object: what a string must be made of first
        raise UserError(
            f"the {text_field!r} field holds no text (a string) in the first lines of each split's first shard:"
            f" tokpipe tokenizes a string a document; {CHAT_TURNS}"
        )
    if fields and text_field not in fields:
        missing = f"no document has a {text_field!r} field in the first lines of each split's first shard"
        names = ", ".join(sorted(fields))
        if fields[likely := max(fields, key=fields.get)] <= 0:  # an object, a list: naming it would be refused next
            raise UserError(
                f"{missing}, and none of their fields ({names}) holds text at a document's top level, which"
                " --text-field names: move the text up (e.g. with `datasets`' map), into a dataset of its own;"
                f" {CHAT_TURNS}"
            )
        # Beside a prompt, its turns hold most of a chat dataset's text: a run of the prompt alone leaves them out.
        turns = sorted(field for field, weight in fields.items() if weight < 0)
        holds = f"; {', '.join(turns)} {'holds' if len(turns) == 1 else 'hold'} lists of texts: {CHAT_TURNS}"
        raise UserError(
            f"{missing}; their fields: {names}: pass --text-field NAME (e.g. --text-field {likely})"
            + (holds if turns else ""),
            fix={"text_field": likely},
        )
    return texts, passed_over


def count_groups(manifest: Manifest, text_field: str, group_by: str) -> None:
    """Refuse, before anything is tokenized, a --group-by field with more values than a split may have
    groups, as far as each split's first shard shows it (an id or a url shows it in its first thousand
    documents), or that none of their documents has, nor one of GROUP_LOOK_SHARDS more (a typo, or a field nested
    deeper: every document would be in MISSING_GROUP); workers and the assembly refuse what this could not see."""
    documents, had, opened = 0, set(), []
    for split in manifest.counts:
        shard, values, read = next(manifest.shards(split)), set(), 0
        if shard.may_block():
            continue
        try:
            for batch in read_batches(shard.path, text_field, group_by=group_by, etag=shard.etag):
                values.update(batch.groups)
                read, documents = read + batch.text_bytes, documents + len(batch.groups)
                if len(values) > MAX_GROUPS or read >= GROUP_SAMPLE_BYTES:
                    break
        except SourceError:  # an unreadable first shard: its own task reports it
            continue
        if len(values) > MAX_GROUPS:
            raise too_many_groups(group_by, f"split {split}", values, MAX_GROUPS, within=" in its first shard alone")
        had, opened = had | values, [*opened, shard]
    if documents and had == {MISSING_GROUP} and not _elsewhere(manifest, text_field, group_by):
        fields = Counter()
        for shard in opened:  # their fields, read for the refusal alone: a run with the field opens no shard again
            fields.update(fields_of(shard.path, shard.etag))
        raise UserError(
            f"--group-by {group_by}: none of the {documents:,} documents read of each split's first shard (nor of"
            f" {GROUP_LOOK_SHARDS} more across it) has it: every document would be in group {MISSING_GROUP}; their"
            f" fields: {', '.join(sorted(fields))}: name the field by its path (a JSON line's by dots, as"
            " meta.redpajama_set_name; a Parquet column, or a struct's field)"
        )


def _elsewhere(manifest: Manifest, text_field: str, group_by: str) -> bool:
    """Whether a document in the first batch of one of GROUP_LOOK_SHARDS more shards of a split, spread over it, has
    --group-by's field."""
    for split, count in manifest.counts.items():
        picked = {round(i * (count - 1) / GROUP_LOOK_SHARDS) for i in range(1, GROUP_LOOK_SHARDS + 1)} - {0}
        for number, shard in enumerate(manifest.shards(split)):
            if number > max(picked, default=0):
                break
            if number not in picked or shard.may_block():
                continue
            try:
                batch = next(read_batches(shard.path, text_field, group_by=group_by, etag=shard.etag), None)
            except SourceError:  # its own task reports it
                continue
            if batch is not None and set(batch.groups) - {MISSING_GROUP}:
                return True
    return False
