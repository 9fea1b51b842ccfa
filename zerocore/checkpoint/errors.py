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

``weights_only_failure(e)`` says in one line why ``torch.load(weights_only=True)`` refused a file,
for every reader of pickled files (rank files here, neox's pretrained weights).
"""

from __future__ import annotations

import re


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


def weights_only_failure(e: BaseException) -> str:
    """Why ``torch.load(weights_only=True)`` failed, in one line. torch's refusal of a pickle that
    would import code is several lines ending with the advice to load it with
    ``weights_only=False`` ("will likely succeed"): exactly what must not be done with a file one
    does not trust, so only the refused object is named."""
    text = str(e)
    if text.startswith("Weights only load failed"):
        # torch words it by version and path: "Unsupported global: GLOBAL getattr was not an
        # allowed global by default." / "... unsupported GLOBAL posix.system whose module ..."
        found = re.search(r"(?i)unsupported global:?\s*(?:GLOBAL\s+)?([\w.]+)", text)
        if found:
            return (f"refused: it holds pickled objects that loading would have to import and "
                    f"run, not only tensors (unsupported global {found.group(1)}); nothing in "
                    f"it was run")
        # Anything else the weights-only unpickler rejects is a damaged or foreign file
        # ("Unsupported operand 103" for bytes that are not a pickle at all).
        found = re.search(r"WeightsUnpickler error:\s*([^\n]+)", text)
        reason = found.group(1).strip() if found else type(e).__name__
        return f"not a readable torch file ({reason})"
    first = text.strip().splitlines()[0] if text.strip() else ""
    return f"{type(e).__name__}{': ' + first if first else ''}"
