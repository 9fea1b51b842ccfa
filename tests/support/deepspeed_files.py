"""DeepSpeed checkpoint files as a hostile user would make them, from the fixtures of
tests/fixtures/deepspeed: a copy of a fixture's checkpoint, a file rewritten with an edit, and
``CRAFTED``, every way of crafting one that the reader must refuse in one line (wrong types at
every key it uses, nesting, truncation, damage, swapped rank files).

The same list is run through ``python -m zerocore.from_deepspeed`` (tests/checkpoints) and
``neox.finetune --resume DSDIR`` (tests/neox)."""

from __future__ import annotations

import contextlib
import shutil
import sys
import types
import zipfile
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from zerocore.checkpoint.deepspeed import unpickler

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "deepspeed"
# The crafted files start from this fixture: LoRA (trained and frozen parameters, an adapter
# config) over 2 ranks in fp32.
CRAFT_FROM = "lora_fp32_ws2"
TAG = "global_step3"


def copy_ckpt(tmp_path: Path, name: str = "full_fp32_ws2") -> tuple[Path, Path]:
    """A copy of a fixture's checkpoint directory, and its tag directory."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(FIXTURES / name / "ckpt", ckpt)
    return ckpt, ckpt / TAG


def _plain(obj: Any) -> Any:
    """The loaded file made savable without DeepSpeed: its stand-ins replaced by plain types."""
    osd = obj.get("optimizer_state_dict") if isinstance(obj, dict) else None
    if isinstance(osd, dict) and "zero_stage" in osd:
        osd["zero_stage"] = int(osd["zero_stage"])
        osd["loss_scaler"] = None
    return obj


def load_plain(path: Path) -> Any:
    """A DeepSpeed file's contents as ``rewrite`` saves them (plain types only)."""
    with torch.serialization.safe_globals(list(unpickler.STAND_INS)):
        return _plain(torch.load(path, weights_only=True))


def rewrite(path: Path, edit: Callable[[Any], Any]) -> None:
    """Loads a DeepSpeed file (its DeepSpeed classes as records), lets ``edit(obj)`` change it
    (or return a replacement) and saves it back under its own name with plain types only (so
    the file stays readable without DeepSpeed)."""
    obj = load_plain(path)
    new = edit(obj)
    torch.save(obj if new is None else new, path)


@contextlib.contextmanager
def deepspeed_loss_scaler() -> Iterator[type]:
    """A class that pickles as DeepSpeed's ``LossScaler`` (its module registered for the
    pickler), for files whose loss-scaler fields are crafted."""
    names = ["deepspeed", "deepspeed.runtime", "deepspeed.runtime.fp16",
             "deepspeed.runtime.fp16.loss_scaler"]  # the pickler imports each to find it
    assert not any(n in sys.modules for n in names), "DeepSpeed itself is imported"
    modules = [types.ModuleType(n) for n in names]
    for parent, child in zip(modules, modules[1:]):
        setattr(parent, child.__name__.rsplit(".", 1)[1], child)

    class LossScaler:
        def __init__(self, **state: Any):
            self.__dict__.update(state)

    LossScaler.__module__, LossScaler.__qualname__ = names[-1], "LossScaler"
    modules[-1].LossScaler = LossScaler
    sys.modules.update(zip(names, modules))
    try:
        yield LossScaler
    finally:
        for n in names:
            del sys.modules[n]


def nest(depth: int) -> list:
    x: list = []
    for _ in range(depth):
        x = [x]
    return x


def self_holding() -> list:
    x: list = []
    x.append(x)
    return x


@contextlib.contextmanager
def _deep_pickling() -> Iterator[None]:
    # Python's pickler recurses once per level: a 5,000-deep nest needs a higher limit to save.
    old = sys.getrecursionlimit()
    sys.setrecursionlimit(max(old, 30_000))
    try:
        yield
    finally:
        sys.setrecursionlimit(old)


# -- what is crafted ----------------------------------------------------------------------------

MODEL = "zero_pp_rank_{}_mp_rank_00_model_states.pt"
OPTIM = "zero_pp_rank_{}_mp_rank_00_optim_states.pt"
# Values of every kind; each key is given those that are not what DeepSpeed writes there.
POOL = {"none": None, "str": "text", "int": 3, "float": 2.5, "list": [1, "x"],
        "dict": {"k": "v"}, "tensor": torch.zeros(2)}
# The kinds DeepSpeed writes (or may write) at each key: not crafted there.
NUMBER, ANY_DICT = ("int", "float"), ("dict",)


def _first(d: dict) -> Any:
    return next(iter(d))


def _at(obj: Any, path: tuple) -> tuple[Any, Any]:
    """(container, key) of the value at ``path`` (keys; "*" is a dict's first key)."""
    for key in path[:-1]:
        obj = obj[_first(obj) if key == "*" else key]
    last = path[-1]
    return obj, (_first(obj) if last == "*" else last)


# (file, path of keys, the kinds that are right there, whether the key may be absent or None)
KEYS: tuple[tuple[str, tuple, tuple[str, ...], bool], ...] = (
    (MODEL, ("param_shapes",), (), False),
    (MODEL, ("param_shapes", 0), (), False),
    (MODEL, ("param_shapes", 0, "*"), (), False),
    (MODEL, ("module",), ANY_DICT, False),
    (MODEL, ("ds_version",), ("str",), False),
    (MODEL, ("ds_config",), ANY_DICT, True),
    (MODEL, ("global_steps",), ("int",), True),
    (MODEL, ("global_samples",), ("int",), True),
    (MODEL, ("dp_world_size",), (), True),
    (MODEL, ("frozen_param_shapes",), (), True),
    (MODEL, ("frozen_param_shapes", "*"), (), False),
    (MODEL, ("frozen_param_fragments",), (), True),
    (MODEL, ("frozen_param_fragments", "*"), ("tensor",), False),
    (MODEL, ("buffer_names",), (), True),
    (MODEL, ("shared_params",), (), True),
    (OPTIM, ("optimizer_state_dict",), (), False),
    (OPTIM, ("optimizer_state_dict", "zero_stage"), ("int",), False),
    (OPTIM, ("optimizer_state_dict", "partition_count"), (), False),
    (OPTIM, ("optimizer_state_dict", "fp32_flat_groups"), (), False),
    (OPTIM, ("optimizer_state_dict", "fp32_flat_groups", 0), ("tensor",), False),
    (OPTIM, ("optimizer_state_dict", "dynamic_loss_scale"), (), True),
    (OPTIM, ("optimizer_state_dict", "optimizer_state_dict"), (), False),
    (OPTIM, ("optimizer_state_dict", "optimizer_state_dict", "state"), (), False),
    (OPTIM, ("optimizer_state_dict", "optimizer_state_dict", "state", 0), (), False),
    (OPTIM, ("optimizer_state_dict", "optimizer_state_dict", "state", 0, "step"), NUMBER,
     False),
    (OPTIM, ("optimizer_state_dict", "optimizer_state_dict", "state", 0, "exp_avg"),
     ("tensor",), False),
    (OPTIM, ("optimizer_state_dict", "optimizer_state_dict", "state", 0, "exp_avg_sq"),
     ("tensor",), False),
    (OPTIM, ("optimizer_state_dict", "optimizer_state_dict", "param_groups"), (), False),
    (OPTIM, ("optimizer_state_dict", "optimizer_state_dict", "param_groups", 0), (), False),
    *((OPTIM, ("optimizer_state_dict", "optimizer_state_dict", "param_groups", 0, k), NUMBER,
       False) for k in ("lr", "eps", "weight_decay")),
    (OPTIM, ("optimizer_state_dict", "optimizer_state_dict", "param_groups", 0, "betas"), (),
     False),
)

Craft = Callable[[Path], None]  # makes its damage in a copy of CRAFT_FROM's tag directory


def _wrong_type(file: str, path: tuple, value: Any) -> Craft:
    def craft(tag: Path) -> None:
        def edit(obj: Any) -> None:
            container, key = _at(obj, path)
            container[key] = value
        for rank in (0, 1):  # both ranks alike: past the checks that compare ranks
            rewrite(tag / file.format(rank), edit)
    return craft


def _scaler_field(field: str, value: Any) -> Craft:
    def craft(tag: Path) -> None:
        with deepspeed_loss_scaler() as LossScaler:
            for rank in (0, 1):
                rewrite(tag / OPTIM.format(rank), lambda o: o["optimizer_state_dict"].update(
                    loss_scaler=LossScaler(**{"cur_scale": 1.0, "dynamic": False,
                                              field: value})))
    return craft


def _nested(file: str, where: str | None, value: Callable[[], Any]) -> Craft:
    def craft(tag: Path) -> None:
        with _deep_pickling():
            rewrite(tag / file.format(1), lambda o: value() if where is None else
                    o.update({where: value()}))
    return craft


def _truncated(file: str, keep: float | int) -> Craft:
    def craft(tag: Path) -> None:
        f = tag / file.format(1)
        data = f.read_bytes()
        f.write_bytes(data[:int(len(data) * keep)] if isinstance(keep, float) else data[:keep])
    return craft


def _flipped(file: str, at: float) -> Craft:
    """Bytes overwritten inside the pickle record (``at``: where, as a fraction of it)."""
    def craft(tag: Path) -> None:
        f = tag / file.format(1)
        with zipfile.ZipFile(f) as zf:
            info = next(i for i in zf.infolist() if i.filename.endswith("/data.pkl"))
        data = bytearray(f.read_bytes())
        head = info.header_offset  # the local header: 30 bytes, the name, the extra field
        start = head + 30 + int.from_bytes(data[head + 26:head + 28], "little") \
            + int.from_bytes(data[head + 28:head + 30], "little")
        i = start + int(max(info.file_size - 8, 0) * at)
        data[i:i + 8] = b"\xff\x00\x13\x37\x42\xfe\x80\x7f"
        f.write_bytes(bytes(data))
    return craft


def _swapped(kind: str) -> Craft:
    def craft(tag: Path) -> None:
        names = [MODEL, OPTIM] if kind == "both" else [MODEL if kind == "model" else OPTIM]
        for name in names:
            a, b = tag / name.format(0), tag / name.format(1)
            a.rename(tag / "swap.tmp")
            b.rename(a)
            (tag / "swap.tmp").rename(b)
    return craft


def _model_file_as_optim(tag: Path) -> None:
    shutil.copy(tag / MODEL.format(1), tag / OPTIM.format(1))


def _crafted() -> dict[str, Craft]:
    cases: dict[str, Craft] = {}
    for file, path, right, optional in KEYS:
        label = ("model" if file == MODEL else "optim") + ":" + ".".join(map(str, path))
        for kind, value in POOL.items():
            if kind in right or (kind == "none" and optional):
                continue
            cases[f"{label}={kind}"] = _wrong_type(file, path, value)
    for field in ("cur_scale", "cur_iter", "scale_window"):
        cases[f"optim:loss_scaler.{field}=str"] = _scaler_field(field, "text")
    for file, label in ((MODEL, "model"), (OPTIM, "optim")):
        cases[f"{label}:nested-5000-deep-extra"] = _nested(file, "extra", lambda: nest(5000))
        cases[f"{label}:holds-itself"] = _nested(file, "extra", self_holding)
        cases[f"{label}:whole-file-nested"] = _nested(file, None, lambda: nest(5000))
        for keep in (0, 100, 0.1, 0.5, 0.9, -22, -1):
            cases[f"{label}:truncated-{keep}"] = _truncated(file, keep)
        for at in (0.1, 0.5, 0.9):
            cases[f"{label}:flipped-{at}"] = _flipped(file, at)
    cases["model:param_shapes-nested"] = _nested(MODEL, "param_shapes", lambda: nest(5000))
    cases["model:ds_config-nested"] = _nested(MODEL, "ds_config", lambda: {"bf16": nest(5000)})
    for kind in ("model", "optim", "both"):
        cases[f"swapped-{kind}-files"] = _swapped(kind)
    cases["model-file-as-optim-file"] = _model_file_as_optim
    return cases


CRAFTED = _crafted()


def crafted_checkpoint(tmp_path: Path, case: str) -> Path:
    """A copy of CRAFT_FROM's checkpoint with crafted damage ``case``; its directory."""
    ckpt, tag = copy_ckpt(tmp_path, CRAFT_FROM)
    CRAFTED[case](tag)
    return ckpt
