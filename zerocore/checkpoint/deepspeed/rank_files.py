"""What each rank's two DeepSpeed files must hold before the reader uses them: every key the
reader reads, checked for the type DeepSpeed writes there, and each file checked to be the one
its name says.

Types: a file made or changed by something else can hold anything under a key the reader uses
(a string for ``param_shapes``, a list for ``ds_config``); each is checked here, once, so that
such a file is one ``DeepSpeedCheckpointError`` line naming the file and the key, never an
exception from deep inside the reader. Keys the reader does not use are not looked at.

Identity: DeepSpeed's files do not record their rank, but torch does record a file's name:
``torch.save(obj, ".../zero_pp_rank_1_mp_rank_00_optim_states.pt")`` files the records under
``zero_pp_rank_1_mp_rank_00_optim_states/``. A file whose records carry the name of another
rank file was renamed or copied over it (two ranks' files swapped, a model-state file under an
optimizer-state name): refused. A file re-saved under its new name, or written through a file
object (records under ``archive/``), carries no such evidence and is accepted: see the README.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Callable

import torch

from zerocore.checkpoint.deepspeed.unpickler import DeepSpeedRecord, TensorRef
from zerocore.checkpoint.errors import DeepSpeedCheckpointError

__all__ = ["MODEL_FILE_RE", "OPTIM_FILE_RE", "check_model_states", "check_optim_states",
           "check_saved_as", "step_value"]

MODEL_FILE_RE = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt$")
OPTIM_FILE_RE = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")


# -- the types DeepSpeed writes -----------------------------------------------------------------

Check = Callable[[Any], bool]


def _int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _count(x: Any) -> bool:
    return _int(x) and x > 0


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _shape(x: Any) -> bool:
    return isinstance(x, (list, tuple)) and all(_int(d) and d >= 0 for d in x)


def _dict_of(value: Check, key: Check = lambda k: isinstance(k, str)) -> Check:
    return lambda x: isinstance(x, dict) and all(key(k) and value(v) for k, v in x.items())


def _list_of(item: Check) -> Check:
    return lambda x: isinstance(x, (list, tuple)) and all(item(v) for v in x)


def _tensor(x: Any) -> bool:
    return isinstance(x, TensorRef)


def _step(x: Any) -> bool:
    """Adam's step: a number, or (torch's own optimizers) a one-element tensor."""
    return _number(x) or (isinstance(x, TensorRef) and x.numel == 1
                          and x.dtype not in (torch.bool, torch.complex64, torch.complex128))


def _group_state(x: Any) -> bool:
    # The moments' types are the layout's to check (a missing one: not Adam, said so there).
    return isinstance(x, dict) and ("step" not in x or _step(x["step"]))


def _param_group(x: Any) -> bool:
    return (isinstance(x, dict) and "lr" in x
            and all(_number(x[k]) for k in ("lr", "eps", "weight_decay") if k in x)
            and ("betas" not in x or (_list_of(_number)(x["betas"]) and len(x["betas"]) == 2)))


_SCALER_NUMBERS = ("cur_scale", "cur_hysteresis", "cur_iter", "last_overflow_iter",
                   "scale_window")


def _loss_scaler(x: Any) -> bool:
    state = x.state if isinstance(x, DeepSpeedRecord) else None
    return isinstance(x, DeepSpeedRecord) and (
        not isinstance(state, dict) or all(_number(state[k]) for k in _SCALER_NUMBERS
                                           if k in state))


def _partition_count(x: Any) -> bool:
    return _count(x) or (_list_of(_count)(x) and len(x) > 0)


# (key, required, check, what DeepSpeed writes there). Optional keys may be absent or None.
MODEL_KEYS: tuple[tuple[str, bool, Check, str], ...] = (
    ("param_shapes", True, _list_of(_dict_of(_shape)),
     "a list of {parameter name: shape} dicts, one per parameter group"),
    ("module", True, _dict_of(lambda v: True), "a dict of the module's tensors by name"),
    ("ds_version", True, lambda x: isinstance(x, str), "a version string"),
    ("ds_config", False, lambda x: isinstance(x, dict), "a dict (the DeepSpeed config)"),
    ("global_steps", False, _int, "an integer"),
    ("global_samples", False, _int, "an integer"),
    ("dp_world_size", False, _count, "a positive integer"),
    ("frozen_param_shapes", False, _dict_of(_shape), "a dict of {parameter name: shape}"),
    ("frozen_param_fragments", False, _dict_of(_tensor),
     "a dict of {parameter name: tensor}"),
    ("buffer_names", False, _list_of(lambda v: isinstance(v, str)), "a list of names"),
    ("shared_params", False, _dict_of(lambda v: isinstance(v, str)),
     "a dict of {alias: parameter name}"),
)
OPTIM_KEYS: tuple[tuple[str, bool, Check, str], ...] = (
    ("zero_stage", True, _int, "an integer (the ZeRO stage)"),
    ("partition_count", True, _partition_count, "a positive integer, or a list of them"),
    ("fp32_flat_groups", True, _list_of(_tensor), "a list of tensors, one per parameter group"),
    ("optimizer_state_dict", True, lambda x: isinstance(x, dict),
     "a dict (the inner optimizer's state)"),
    ("loss_scaler", False, _loss_scaler, "a DeepSpeed loss scaler with numeric fields"),
    ("dynamic_loss_scale", False, lambda x: isinstance(x, bool), "a bool"),
)
INNER_KEYS: tuple[tuple[str, bool, Check, str], ...] = (
    ("state", True, _dict_of(_group_state, key=_int),
     "a dict of {group index: {step, exp_avg, exp_avg_sq}}, the step a number"),
    ("param_groups", True, _list_of(_param_group),
     "a list of dicts with a numeric lr (eps, weight_decay numbers, betas two numbers)"),
)


def _describe(x: Any) -> str:
    text = repr(x)
    return f"{type(x).__name__} {text[:60]}{'...' if len(text) > 60 else ''}"


def _check_keys(path: Path, where: str, d: dict[str, Any],
                keys: tuple[tuple[str, bool, Check, str], ...]) -> None:
    for key, required, check, what in keys:
        if key not in d or d[key] is None:
            if required:
                raise DeepSpeedCheckpointError(
                    f"{path}: {where}has no {key!r}: not a DeepSpeed ZeRO-3 file (or one this "
                    f"reader does not know)")
            continue
        if not check(d[key]):
            raise DeepSpeedCheckpointError(
                f"{path}: {where}{key!r} is {_describe(d[key])}, not {what} as DeepSpeed "
                f"writes it: the file was made or changed by something else; copy it again "
                f"from where the run saved it")


def check_model_states(path: Path, sd: Any) -> None:
    """A model-state file's contents, as the reader uses them."""
    if not isinstance(sd, dict) or "param_shapes" not in sd or "module" not in sd:
        raise DeepSpeedCheckpointError(f"{path}: not a DeepSpeed model-state file (no "
                                       f"param_shapes)")
    _check_keys(path, "", sd, MODEL_KEYS)


def check_optim_states(path: Path, sd: Any) -> dict[str, Any]:
    """An optimizer-state file's contents, as the reader uses them; returns the optimizer state
    dict (``sd["optimizer_state_dict"]``)."""
    osd = sd.get("optimizer_state_dict") if isinstance(sd, dict) else None
    if not isinstance(osd, dict) or "zero_stage" not in osd:
        raise DeepSpeedCheckpointError(f"{path}: not a DeepSpeed ZeRO optimizer-state file "
                                       f"(no zero_stage)")
    _check_keys(path, "optimizer_state_dict: ", osd, OPTIM_KEYS[:1])
    if osd["zero_stage"] != 3:
        raise DeepSpeedCheckpointError(f"{path}: ZeRO stage {osd['zero_stage']}: only ZeRO "
                                       f"stage 3 checkpoints are supported")
    _check_keys(path, "optimizer_state_dict: ", osd, OPTIM_KEYS[1:])
    _check_keys(path, "the inner optimizer state: ", osd["optimizer_state_dict"], INNER_KEYS)
    return osd


def step_value(x: Any) -> int:
    """Adam's step as an int (a checked ``_step``: a number or a one-element tensor)."""
    return int(x.read().item()) if isinstance(x, TensorRef) else int(x)


# -- identity -----------------------------------------------------------------------------------

def check_saved_as(path: Path, saved_as: str) -> None:
    """Refuses a rank file whose records carry the name of another rank file (see the module
    docstring); a name that is no rank file's says nothing, and is accepted."""
    written = f"{saved_as}.pt"
    if written == path.name:
        return
    for pattern, what in ((MODEL_FILE_RE, "model states"), (OPTIM_FILE_RE, "optimizer states")):
        m = pattern.match(written)
        if m:
            raise DeepSpeedCheckpointError(
                f"{path}: this file was saved as {written} (torch records the name a file is "
                f"saved under), so it holds rank {int(m.group(1))}'s {what}: rank files were "
                f"renamed or swapped; copy the tag directory {path.parent.name} again from "
                f"where DeepSpeed saved it")
