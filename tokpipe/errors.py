"""Errors that reach the user as one readable line instead of a traceback."""


class UserError(Exception):
    """Bad input or usage: the message says what was wrong and what to do. Exit code 2."""


class SourceError(Exception):
    """A shard's bytes cannot be read to the end (truncated or corrupt download). Names file and place."""
