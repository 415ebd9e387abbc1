"""Every error this library raises, in one place.

Each failure has its own class so callers (operators, the CLI, scripts) can react to one kind without
parsing messages. Errors that are bad input in spirit also subclass :class:`ValueError`.
Messages say what happened and what to do; they never carry credentials.
"""

from __future__ import annotations


class StatefulError(Exception):
    """Base class of every error raised by airflow-provider-stateful."""


class IdentityError(StatefulError, ValueError):
    """An identity (or one of its parts) is empty, too long, or could escape its prefix."""


class ConfigurationError(StatefulError, ValueError):
    """A backend URL, connection or option is missing or malformed."""


class InvalidValueError(StatefulError, ValueError):
    """A checkpoint value or file argument cannot be stored (not JSON, not a file, ...)."""


class DestinationNotEmptyError(InvalidValueError):
    """A restore in mode ``"empty"`` found its destination holding files; nothing was downloaded or changed.

    :attr:`dest` is the destination, :attr:`names` what is in it (sorted), so a front end can word its own hint.
    """

    def __init__(self, message: str, *, dest: object, names: list[str]) -> None:
        super().__init__(message)
        self.dest = dest
        self.names = names


class ObjectNotFoundError(StatefulError):
    """An object the protocol expects does not exist in the store."""


class PreconditionFailedError(StatefulError):
    """A conditional write lost: the object exists (create-if-absent) or changed (compare-and-swap)."""


class StoreError(StatefulError):
    """The object store failed in a way the protocol cannot recover from (access denied, no bucket, ...)."""


class StoreUnavailableError(StoreError):
    """The store cannot be used as configured: its bucket or directory does not exist, its endpoint cannot be
    reached or is not S3, its credentials are missing or refused, its KMS key may not be used, or it lacks the
    conditional writes the protocol needs. Apart from other store failures so that a command line can call it a
    configuration error (exit 2)."""


class CommitOutcomeUnknownError(StoreError):
    """A commit's head write got no answer and the head could not be read back to tell whether it landed.

    :attr:`manifest` is the checkpoint that may have landed. Either way the previous checkpoint is intact; the
    writer's next commit reads the head and goes on from whichever is the newest.
    """

    def __init__(self, message: str, *, manifest: object = None) -> None:
        super().__init__(message)
        self.manifest = manifest


class FencedError(StatefulError):
    """A writer's epoch is stale: a newer writer took the identity's lease, so this one may not commit."""


class ConcurrentCommitError(StatefulError):
    """Two commits presented the same lease at once; one writer's commits must be sequential."""


class LeaseHeldError(StatefulError):
    """Another writer holds a live lease on the identity."""


class CheckpointCorruptError(StatefulError):
    """A stored object does not match the size or SHA-256 recorded for it."""


class ObjectTooLargeError(CheckpointCorruptError):
    """A record read from storage is larger than a record of its kind may be; it is not read, let alone parsed."""


class CheckpointNotFoundError(StatefulError, LookupError):
    """The requested checkpoint is not (or no longer) in the identity's history."""


class FormatVersionError(StatefulError):
    """A record was written by a newer, incompatible version of this library."""


class IncompatibleStateError(StatefulError):
    """A checkpoint's schema_version cannot be brought to the task's (newer than the code, or no migration)."""


class CodeChangedError(IncompatibleStateError):
    """The checkpoint to resume was written by other code and the task said ``on_code_change="fail"``."""


class CursorMismatchError(IncompatibleStateError):
    """A ``resume()`` loop's iterable no longer matches its stored cursor (other first items, a missing key)."""


class MigrationError(StatefulError):
    """A migration function failed or returned nothing."""


class StopRequested(StatefulError):
    """The try was asked to stop (SIGTERM / ``on_kill``); its progress was committed first."""
