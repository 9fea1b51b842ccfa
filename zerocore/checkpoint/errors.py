"""The errors of checkpoints (a module of its own so that every checkpoint module can
raise them without importing the others).

- ``CheckpointError`` (a ``ValueError``): a checkpoint is missing, incomplete, corrupt, edited or
  does not match the model; nothing was loaded. The message names the file, and for the
  manifest the field (``.../manifest.json: layers[3].trainable.slots[1].offset: ...``).
- ``CheckpointWriteError``, both a ``CheckpointError`` and an ``OSError``: a save could not
  write, rename or flush something (disk full, permissions, I/O error). Its message is one line
  naming the path and the errno; ``errno`` and ``filename`` are set (``errno`` is None on the
  ranks that only learnt of another rank's failure). Catching either base class catches it.
- ``DeepSpeedCheckpointError``, a ``CheckpointError``: of a DeepSpeed checkpoint (``deepspeed``).
"""

from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint is missing, corrupt, or does not match the model: nothing was loaded."""


class CheckpointWriteError(CheckpointError, OSError):
    """A save failed to write (disk full, permissions, I/O): nothing was committed and earlier
    checkpoints are intact (unless the message says otherwise)."""

    def __init__(self, message: str, *, errno: int | None = None, filename: str | None = None):
        super().__init__(message)
        self.errno, self.filename = errno, filename

    def __str__(self) -> str:
        # OSError's own __str__ would print "[Errno N] None: filename" once errno is set.
        return str(self.args[0])

    def __reduce__(self):
        return _rebuild_write_error, (str(self), self.errno, self.filename)


def _rebuild_write_error(message: str, errno: int | None, filename: str | None
                         ) -> CheckpointWriteError:
    return CheckpointWriteError(message, errno=errno, filename=filename)


class DeepSpeedCheckpointError(CheckpointError):
    """A DeepSpeed checkpoint is missing, incomplete, inconsistent, unsafe or of a kind this
    reader does not support; nothing was written or loaded. One line."""
