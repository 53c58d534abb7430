"""Bad input is loud: every reader raises ``DataError`` naming the file and line, or counts what it skipped."""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from pathlib import Path


class DataError(ValueError):
    """A problem in an input file; ``str(error)`` names the file and, where there is one, the line or row."""

    def __init__(self, path: str | Path, where: str | int | None, message: str) -> None:
        self.path, self.where, self.message = str(path), where, message
        location = self.path if where is None else f"{self.path}:{where}"
        super().__init__(f"{location}: {message}")

    def __reduce__(self):
        # NOTE: an exception pickles as its class called with its args (here the text alone, which __init__ does not
        # take): a reader in another process (ProcessReadAhead) sends it whole
        return DataError, (self.path, self.where, self.message)


def portable_error(error: BaseException) -> BaseException:
    """``error`` as it can reach another process: itself where it survives a pickle round trip, else a RuntimeError
    with its type and text. NOTE: pickling alone is not enough: an exception whose ``__init__`` takes other arguments
    than its ``args`` pickles, then fails to unpickle on the other side (a TypeError in place of the error)."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")


@dataclass
class BadRows:
    """What a reader skipped under ``skip_bad_rows=True``: the count and the first few reasons.

    Without the option the first bad row raises instead, so a reader never drops data silently.
    """

    skip: bool = False
    count: int = 0
    examples: list[str] = field(default_factory=list)
    keep: int = 10

    def report(self, path: str | Path, where: str | int | None, message: str) -> None:
        """Raise ``DataError`` or, when skipping, count the row and remember the reason."""
        error = DataError(path, where, message)
        if not self.skip:
            raise error
        self.count += 1
        if len(self.examples) < self.keep:
            self.examples.append(str(error))
