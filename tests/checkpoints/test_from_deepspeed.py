"""zerocore.from_deepspeed: DeepSpeed ZeRO-3 checkpoints read without DeepSpeed.

The fixtures under tests/fixtures/deepspeed/ were made by real DeepSpeed 0.19.8 (make_fixtures.py
there, which runs only in a DeepSpeed venv): a tiny GPT-NeoX trained 3 steps, full fine-tuning or
PEFT LoRA with frozen base weights, on 2 or 3 gloo ranks, fp32 or bf16. Beside each checkpoint
are DeepSpeed's own zero_to_fp32.py output, the 16-bit model DeepSpeed gathered (bf16 runs), and
the losses of DeepSpeed's run continued 3 steps after the save. These tests need no DeepSpeed:
- the export equals zero_to_fp32 tensor for tensor, bitwise (full, trainable-only, 16-bit), and a
  LoRA adapter loads with peft.PeftModel.from_pretrained;
- a zerocore run resumed from the checkpoint at world sizes 1, 2 and 3 reproduces DeepSpeed's
  continued losses;
- bad inputs are refused in one line before anything is written, and a pickle payload does not
  run.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.support.deepspeed_files import (CRAFTED, copy_ckpt, crafted_checkpoint, load_plain,
                                           rewrite)
from tests.support.dist_utils import global_mean
from zerocore.checkpoint import deepspeed as fds
from zerocore import from_deepspeed
from zerocore.checkpoint.deepspeed import DeepSpeedCheckpointError
from zerocore.checkpoint.deepspeed import exporting, resume, streaming_safetensors, unpickler

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "deepspeed"
ALL = ["full_fp32_ws2", "full_fp32_ws3", "full_bf16_ws3", "lora_fp32_ws2", "lora_fp32_ws3",
       "lora_bf16_ws2"]
BF16 = [n for n in ALL if "bf16" in n]
LORA = [n for n in ALL if n.startswith("lora")]


def info(name: str) -> dict:
    return json.loads((FIXTURES / name / "fixture.json").read_text())


def reference(name: str) -> dict[str, torch.Tensor]:
    return load_file(str(FIXTURES / name / "zero_to_fp32.safetensors"))


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for k in want:
        assert got[k].dtype == want[k].dtype, k
        assert torch.equal(got[k], want[k]), k


def trained_names(name: str) -> list[str]:
    """The parameters the fixture's run trained: every one (full), or the LoRA matrices."""
    names = list(reference(name))
    return [n for n in names if "lora_" in n] if name.startswith("lora") else names


def run_cli(*args: str) -> int:
    return from_deepspeed.main([str(a) for a in args])


# -- export -------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ALL)
def test_full_export_equals_zero_to_fp32(name, tmp_path):
    assert run_cli(FIXTURES / name / "ckpt", tmp_path / "out") == 0
    assert sorted(os.listdir(tmp_path / "out")) == ["model.safetensors"]
    assert_same(load_file(str(tmp_path / "out" / "model.safetensors")), reference(name))


@pytest.mark.parametrize("name", BF16)
def test_16bit_export_equals_deepspeeds_16bit_model(name, tmp_path):
    assert run_cli(FIXTURES / name / "ckpt", tmp_path / "out", "--dtype", "16bit") == 0
    want = load_file(str(FIXTURES / name / "ds_16bit.safetensors"))
    got = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert {t.dtype for t in got.values()} == {torch.bfloat16}
    assert_same(got, want)


@pytest.mark.parametrize("name", ALL)
def test_trainable_only_equals_zero_to_fp32_filtered(name, tmp_path):
    assert run_cli(FIXTURES / name / "ckpt", tmp_path / "out", "--trainable-only") == 0
    ref = reference(name)
    if name.startswith("lora"):
        # PEFT's saved names: the adapter's name ("default") left out
        want = {n.replace(".default.", "."): ref[n] for n in trained_names(name)}
        assert sorted(os.listdir(tmp_path / "out")) == ["adapter_config.json",
                                                         "adapter_model.safetensors"]
        got = load_file(str(tmp_path / "out" / "adapter_model.safetensors"))
    else:
        want = {n: ref[n] for n in trained_names(name)}
        assert sorted(os.listdir(tmp_path / "out")) == ["trainable.safetensors"]
        got = load_file(str(tmp_path / "out" / "trainable.safetensors"))
    assert_same(got, want)


def tiny_base(name: str):
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    torch.manual_seed(0)
    return GPTNeoXForCausalLM(GPTNeoXConfig(**info(name)["model_config"]))


@pytest.mark.parametrize("name", LORA)
def test_adapter_loads_with_peft(name, tmp_path):
    from peft import PeftModel

    assert run_cli(FIXTURES / name / "ckpt", tmp_path / "adapter", "--trainable-only") == 0
    model = PeftModel.from_pretrained(tiny_base(name), str(tmp_path / "adapter"))
    loaded = dict(model.named_parameters())
    ref = reference(name)
    names = trained_names(name)
    assert len(names) == 8
    for n in names:
        assert torch.equal(loaded[n], ref[n]), n


def test_adapter_config_from_the_user(tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(FIXTURES / "lora_fp32_ws2" / "ckpt", ckpt)
    config = tmp_path / "my_lora.json"
    (ckpt / "adapter_config.json").rename(config)
    # no config anywhere: the adapter is written, and the note says what is missing
    assert run_cli(ckpt, tmp_path / "bare", "--trainable-only") == 0
    assert sorted(os.listdir(tmp_path / "bare")) == ["adapter_model.safetensors"]
    assert "no LoRA config found" in capsys.readouterr().out
    assert run_cli(ckpt, tmp_path / "out", "--trainable-only", "--adapter-config", config) == 0
    assert (tmp_path / "out" / "adapter_config.json").read_bytes() == config.read_bytes()
    from peft import PeftModel

    PeftModel.from_pretrained(tiny_base("lora_fp32_ws2"), str(tmp_path / "out"))


def test_tag_and_tag_directory(tmp_path):
    ckpt = FIXTURES / "full_fp32_ws2" / "ckpt"
    assert run_cli(ckpt, tmp_path / "a", "--tag", "global_step3") == 0
    assert run_cli(ckpt / "global_step3", tmp_path / "b") == 0
    assert_same(load_file(str(tmp_path / "a" / "model.safetensors")), reference("full_fp32_ws2"))
    assert_same(load_file(str(tmp_path / "b" / "model.safetensors")), reference("full_fp32_ws2"))


def test_streams_one_tensor_at_a_time(tmp_path, monkeypatch):
    """The writer asks for each tensor just before writing it: never more than one read ahead."""
    produced, written = [], []
    real = exporting.write_safetensors

    def spy(path, entries, metadata=None):
        def wrap(name, produce):
            def go():
                assert len(produced) == len(written), "a tensor was read before the last written"
                produced.append(name)
                return produce()
            return go
        entries = [(n, d, s, wrap(n, p)) for n, d, s, p in entries]
        return real(path, entries, metadata)

    monkeypatch.setattr(exporting, "write_safetensors", spy)
    real_write = streaming_safetensors.write_file

    def write_file(path, fill):
        def counting(f):
            class F:
                def write(self, data):
                    if len(produced) > len(written):
                        written.append(produced[-1])
                    return f.write(data)
            return fill(F())
        return real_write(path, counting)

    monkeypatch.setattr(streaming_safetensors, "write_file", write_file)
    assert run_cli(FIXTURES / "full_fp32_ws3" / "ckpt", tmp_path / "out") == 0
    assert produced == written and len(produced) == 28


# -- refusals -------------------------------------------------------------------------------------

def refused(ckpt: Path, capsys, *args: str) -> str:
    """Runs the CLI, which must fail with one line and write nothing; returns the line."""
    out = ckpt.parent / "out"
    assert run_cli(ckpt, out, *args) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert not out.exists()
    assert not [p for p in ckpt.parent.iterdir() if p.name.startswith(".out.tmp")]
    return err


def test_refuses_missing_rank_file(tmp_path, capsys):
    ckpt, tag = copy_ckpt(tmp_path)
    (tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    err = refused(ckpt, capsys)
    assert f"{tag / 'zero_pp_rank_1_mp_rank_00_optim_states.pt'}: missing (2 model-state files " \
           f"and 1 optimizer-state files here)" in err


def test_refuses_missing_files_of_a_bf16_run(tmp_path, capsys):
    ckpt, tag = copy_ckpt(tmp_path, "lora_bf16_ws2")
    (tag / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    assert f"{tag / 'bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt'}: missing" in \
        refused(ckpt, capsys)
    # both of rank 1's files gone: what is left says it was partitioned over 2 ranks
    (tag / "zero_pp_rank_1_mp_rank_00_model_states.pt").unlink()
    assert "written by a run of 2 data-parallel ranks, but 1 ranks' files are here" in \
        refused(ckpt, capsys)


def test_refuses_missing_rank_zero(tmp_path, capsys):
    ckpt, tag = copy_ckpt(tmp_path, "full_fp32_ws3")
    for kind in ("model", "optim"):
        (tag / f"zero_pp_rank_0_mp_rank_00_{kind}_states.pt").unlink()
    assert "the model_states file of rank 0 is missing (found ranks [1, 2])" in \
        refused(ckpt, capsys)


def test_refuses_truncated_file(tmp_path, capsys):
    ckpt, tag = copy_ckpt(tmp_path)
    f = tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    err = refused(ckpt, capsys)
    assert str(f) in err and "truncated" in err


def test_refuses_files_of_two_world_sizes(tmp_path, capsys):
    """Rank 2's files of the 3-rank run of another model added to a 2-rank checkpoint."""
    ckpt, tag = copy_ckpt(tmp_path)
    src = FIXTURES / "full_fp32_ws3" / "ckpt" / "global_step3"
    for kind in ("model", "optim"):
        shutil.copy(src / f"zero_pp_rank_2_mp_rank_00_{kind}_states.pt", tag)
    err = refused(ckpt, capsys)
    assert "zero_pp_rank_0_mp_rank_00_model_states.pt: written by a run of 2 data-parallel " \
           "ranks, but 3 ranks' files are here" in err


def test_refuses_partition_count_that_does_not_match(tmp_path, capsys):
    ckpt, tag = copy_ckpt(tmp_path)
    for r in (0, 1):
        rewrite(tag / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt",
                lambda o: o["optimizer_state_dict"].update(partition_count=4))
    err = refused(ckpt, capsys)
    assert "partitioned over 4 ranks, but 2 ranks' files are here: the files of rank(s) [2, 3]" \
        in err


def test_refuses_flat_group_of_the_wrong_size(tmp_path, capsys):
    ckpt, tag = copy_ckpt(tmp_path)

    def shorten(o):
        osd = o["optimizer_state_dict"]
        osd["fp32_flat_groups"] = [osd["fp32_flat_groups"][0][:-5].clone()]

    rewrite(tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt", shorten)
    err = refused(ckpt, capsys)
    assert "fp32_flat_groups[0] holds 3259 torch.float32 elements, but its 28 parameters take " \
           "3264 fp32 elements per rank over 2 ranks" in err


def test_refuses_mixed_saves(tmp_path, capsys):
    ckpt, tag = copy_ckpt(tmp_path)
    rewrite(tag / "zero_pp_rank_1_mp_rank_00_model_states.pt",
            lambda o: o.update(global_steps=7))
    assert "its global_steps differs from rank 0's" in refused(ckpt, capsys)


def test_refuses_zero_stage_2(tmp_path, capsys):
    ckpt, tag = copy_ckpt(tmp_path)
    for r in (0, 1):
        rewrite(tag / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt",
                lambda o: o["optimizer_state_dict"].update(zero_stage=2))
    assert "ZeRO stage 2: only ZeRO stage 3 checkpoints are supported" in refused(ckpt, capsys)


def test_refuses_stage_2_layout(tmp_path, capsys):
    ckpt, tag = copy_ckpt(tmp_path)
    (tag / "zero_pp_rank_0_mp_rank_00_model_states.pt").rename(tag / "mp_rank_00_model_states.pt")
    assert "a ZeRO stage 1/2 checkpoint" in refused(ckpt, capsys)


def test_refuses_tensor_parallel(tmp_path, capsys):
    ckpt, tag = copy_ckpt(tmp_path)
    shutil.copy(tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt",
                tag / "zero_pp_rank_0_mp_rank_01_optim_states.pt")
    assert "tensor- or pipeline-parallel checkpoint (mp_rank 01)" in refused(ckpt, capsys)


def test_refuses_old_deepspeed(tmp_path, capsys):
    ckpt, tag = copy_ckpt(tmp_path)
    for r in (0, 1):
        rewrite(tag / f"zero_pp_rank_{r}_mp_rank_00_model_states.pt",
                lambda o: o.update(ds_version="0.8.3"))
    assert "written by DeepSpeed 0.8.3; this reader knows the ZeRO-3 files of DeepSpeed 0.10" in \
        refused(ckpt, capsys)


def test_refuses_no_latest_and_bad_tag(tmp_path, capsys):
    ckpt, _ = copy_ckpt(tmp_path)
    (ckpt / "latest").unlink()
    assert "no 'latest' file saying which save to read; give --tag (directories here: " \
           "global_step3)" in refused(ckpt, capsys)
    assert "tag 'global_step9' has no directory" in refused(ckpt, capsys, "--tag",
                                                            "global_step9")


@pytest.mark.parametrize("case", sorted(CRAFTED))
def test_every_crafted_file_is_one_line(tmp_path, capsys, case):
    """Fuzzed files (tests/support/deepspeed_files.py: a wrong type at every key the reader
    uses, nesting 5,000 deep or holding itself, truncation, damaged bytes, swapped rank
    files): exit 2, one line naming the checkpoint's file, nothing written."""
    ckpt = crafted_checkpoint(tmp_path, case)
    err = refused(ckpt, capsys)
    assert err.startswith(f"error: {ckpt / 'global_step3'}"), err
    assert "Traceback" not in err and "RecursionError" not in err


def test_a_swap_is_refused_naming_whose_file_it_is(tmp_path, capsys):
    ckpt, tag = copy_ckpt(tmp_path, "full_fp32_ws3")
    a, b = tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt", \
        tag / "zero_pp_rank_2_mp_rank_00_optim_states.pt"
    a.rename(tag / "x")
    b.rename(a)
    (tag / "x").rename(b)
    err = refused(ckpt, capsys)
    assert f"{a}: this file was saved as zero_pp_rank_2_mp_rank_00_optim_states.pt (torch " \
           f"records the name a file is saved under), so it holds rank 2's optimizer states: " \
           f"rank files were renamed or swapped" in err


def test_a_file_re_saved_under_its_new_name_is_not_detected(tmp_path):
    """What docs/checkpoints.md ("Coming from DeepSpeed") says cannot be detected: a swap made
    by loading and saving each file under the other's name (the files record no rank, and
    torch's record of the name is then the new one). The export is then wrong, as
    zero_to_fp32's would be."""
    ckpt, tag = copy_ckpt(tmp_path, "full_fp32_ws2")
    files = [tag / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (0, 1)]
    loaded = [load_plain(f) for f in files]
    for f, obj in zip(files, reversed(loaded)):
        torch.save(obj, f)
    assert run_cli(ckpt, tmp_path / "out") == 0
    got = load_file(str(tmp_path / "out" / "model.safetensors"))
    want = reference("full_fp32_ws2")
    assert sorted(got) == sorted(want)
    assert not all(torch.equal(got[k], want[k]) for k in want)


def test_a_bf16_runs_file_among_an_fp32_runs_is_refused_as_mixed(tmp_path, capsys):
    """The model-state file of rank 1 of the bf16 run of the same model and steps: every shape
    agrees; its DeepSpeed config (and its frozen fragments' dtype) do not."""
    ckpt, tag = copy_ckpt(tmp_path, "lora_fp32_ws2")
    shutil.copy(FIXTURES / "lora_bf16_ws2" / "ckpt" / "global_step3" /
                "zero_pp_rank_1_mp_rank_00_model_states.pt", tag)
    err = refused(ckpt, capsys)
    assert "zero_pp_rank_1_mp_rank_00_model_states.pt: its ds_config differs from rank 0's" in err
    assert "truncated" not in err


def test_a_bf16_optimizer_file_among_plain_ones_is_refused(tmp_path, capsys):
    ckpt, tag = copy_ckpt(tmp_path, "lora_fp32_ws2")
    src = FIXTURES / "lora_bf16_ws2" / "ckpt" / "global_step3"
    (tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    shutil.copy(src / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt", tag)
    assert "zero_pp_rank_0_mp_rank_00_optim_states.pt: a plain optimizer-state file among bf16_ " \
           "ones (of ranks [1])" in refused(ckpt, capsys)


def test_refuses_16bit_of_fp32_run_and_existing_out(tmp_path, capsys):
    ckpt, _ = copy_ckpt(tmp_path)
    assert "this run trained in fp32" in refused(ckpt, capsys, "--dtype", "16bit")
    (tmp_path / "out").mkdir()
    assert run_cli(ckpt, tmp_path / "out") == 2
    assert "exists; choose a new output directory" in capsys.readouterr().err
    assert os.listdir(tmp_path / "out") == []


def test_library_raises_value_error(tmp_path):
    with pytest.raises(ValueError, match="no such directory"):
        fds.export(tmp_path / "nothing", tmp_path / "out")


# Below the model file's 29,000 bytes and above the adapter config's: the write fails midway.
FILE_LIMIT = 8 * 1024


def test_a_write_that_fails_midway_leaves_nothing(tmp_path, capsys):
    """A real write(2) error while model.safetensors is written (a soft RLIMIT_FSIZE: EFBIG, as
    a full disk gives ENOSPC): one line naming the file, no OUT and no temporary directory."""
    ckpt, _ = copy_ckpt(tmp_path)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the error, not a kill
    resource.setrlimit(resource.RLIMIT_FSIZE, (FILE_LIMIT, hard))
    try:
        err = refused(ckpt, capsys)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)
    assert "File too large" in err and "model.safetensors" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


# -- safety ---------------------------------------------------------------------------------------

class _Payload:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.mark.parametrize("kind", ["model", "optim"])
def test_pickle_payload_does_not_run(tmp_path, capsys, kind):
    ckpt, tag = copy_ckpt(tmp_path)
    victim = tag / f"zero_pp_rank_1_mp_rank_00_{kind}_states.pt"
    marker = tmp_path / "marker"
    rewrite(victim, lambda o: o.update(extra=_Payload(marker)))
    err = refused(ckpt, capsys)
    assert f"{victim}: refused: it names posix.system" in err
    assert not marker.exists()
    # The same file is live: an unrestricted load runs its payload (so the check above can fail).
    torch.load(victim, weights_only=False)
    assert marker.exists()


def test_refuses_a_class_outside_the_allowlist(tmp_path, capsys):
    """Not a payload, just a class no DeepSpeed checkpoint holds: refused all the same."""
    ckpt, tag = copy_ckpt(tmp_path)
    victim = tag / "zero_pp_rank_0_mp_rank_00_model_states.pt"
    rewrite(victim, lambda o: o.update(args=argparse.Namespace(lr=0.1)))
    assert f"{victim}: refused: it names argparse.Namespace, which is neither a tensor type " \
           f"nor one of DeepSpeed's checkpoint classes" in refused(ckpt, capsys)


def test_resume_refuses_payload_too(tmp_path):
    ckpt, tag = copy_ckpt(tmp_path)
    marker = tmp_path / "marker"
    victim = tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    torch.save({"optimizer_state_dict": _Payload(marker)}, victim)
    with pytest.raises(DeepSpeedCheckpointError, match="refused: it names posix.system"):
        fds.DeepSpeedCheckpoint(ckpt)
    assert not marker.exists()
    torch.load(victim, weights_only=False)  # the payload is live
    assert marker.exists()


def test_deepspeed_classes_are_inert_records():
    ckpt = fds.DeepSpeedCheckpoint(FIXTURES / "full_bf16_ws3" / "ckpt")
    scaler = ckpt.optim_states[0]["loss_scaler"]
    # a class of this reader, not DeepSpeed's
    assert type(scaler).__module__ == unpickler.__name__
    assert scaler.ds_class == "deepspeed.runtime.fp16.loss_scaler.LossScaler"
    assert ckpt.loss_scaler == {"cur_scale": 1.0, "dynamic": False}
    assert type(ckpt.optim_states[0]["zero_stage"]) is unpickler.ZeroStage
    assert ckpt.world_size == 3 and ckpt.dtype16 is torch.bfloat16 and ckpt.steps == [3]


def test_dynamic_loss_scaler_state():
    """DeepSpeed's DynamicLossScaler fields mapped onto zerocore's (no fp16 fixture: DeepSpeed's
    CPU accelerator runs bf16 and fp32, so this mapping is checked on hand-made state)."""
    class Scaler:
        dynamic = True

        def state_dict(self):
            return {"loss_scale": 65536.0, "hysteresis_left": 2, "good_steps": 0,
                    "dynamic": True}

    ds = {"cur_scale": 1024.0, "cur_iter": 30, "last_overflow_iter": 19, "scale_window": 1000,
          "cur_hysteresis": 1}
    assert resume._scaler_state(ds, Scaler()) == {"loss_scale": 1024.0, "hysteresis_left": 1,
                                                "good_steps": 10, "dynamic": True}


# -- resuming on zerocore ------------------------------------------------------------------------

def build(name: str):
    """The fixture's model, as the DeepSpeed run built it (values are replaced by the
    checkpoint's), sharded by zerocore; and its optimizer."""
    import zerocore

    fx = info(name)
    model = tiny_base(name)
    if fx["mode"] == "lora":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(**fx["lora_config"]))
        units = model.base_model.model.gpt_neox.layers
    else:
        units = model.gpt_neox.layers
    mp = zerocore.MixedPrecision(param_dtype=torch.bfloat16) if fx["dtype"] == "bf16" else \
        zerocore.MixedPrecision()
    zerocore.shard_model(model, units, mixed_precision=mp)
    # lr 0: the checkpoint's hyper-parameters must be the ones that apply
    optimizer = zerocore.optim.AdamW(model.parameters(), lr=0.0)
    return model, optimizer


def assert_state_is_deepspeeds(model, optimizer, name: str, rank: int) -> None:
    """What this rank holds after the load, bitwise: its shard of the fp32 masters (against
    zero_to_fp32's output, which our reader did not make), of Adam's moments (assembled from
    DeepSpeed's partitions by the reader, whose masters the export tests prove bitwise) and
    Adam's step. The losses below then only have to show that training continues alike."""
    from zerocore.engine.sharded_model import sharding_of

    ckpt = fds.DeepSpeedCheckpoint(FIXTURES / name / "ckpt")
    masters = reference(name)
    checked = 0
    for layer in sharding_of(model).layers:
        group = layer.trainable
        if group is None:
            continue
        layout, shard = group.layout, group.shard
        state = optimizer.state[shard]
        lo, hi = layout.shard_range(rank)
        for what, held in (("fp32", shard), ("exp_avg", state["exp_avg"]),
                           ("exp_avg_sq", state["exp_avg_sq"])):
            full = torch.zeros(layout.padded_numel)
            for slot in layout.slots:
                value = masters[slot.name] if what == "fp32" else ckpt.read(slot.name, what)
                full[slot.offset:slot.offset + slot.numel] = value.reshape(-1)
            assert torch.equal(held.detach().cpu().reshape(-1), full[lo:hi]), (what, layer.index)
        assert float(state["step"]) == 3.0
        checked += len(layout.slots)
    assert checked == len(trained_names(name))


def resumed_losses(rank: int, world: int, name: str) -> list[float]:
    import zerocore

    model, optimizer = build(name)
    extra = zerocore.load_checkpoint(FIXTURES / name / "ckpt", model, optimizer)
    assert extra["deepspeed"]["global_steps"] == 3
    assert_state_is_deepspeeds(model, optimizer, name, rank)
    assert optimizer.param_groups[0]["lr"] == info(name)["adamw"]["lr"]
    cont = info(name)["continued"]
    losses = []
    for batch in cont["batches"]:
        micro = len(batch) // world  # this rank's share of DeepSpeed's global batch
        ids = torch.tensor(batch[rank * micro:(rank + 1) * micro])
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(global_mean(loss))
    return losses


# Why these tolerances: the state the resumed run starts from is checked bitwise above, so what
# differs in the losses is rounding: the gradients are summed over ranks in another order and
# shape (DeepSpeed reduce-scatters per bucket over its ranks, zerocore per unit over its own), each
# rank's batch has another size (other matmul blockings), and the Adam kernels differ (torch's
# AdamW inside DeepSpeed, zerocore's fused kernel). Measured on this machine (2026-12-01, all 18
# cases): fp32 at most 1.14e-7 relative, one ulp of a loss of ~4.2 (0 in some cases at
# DeepSpeed's own world size); 5e-7 allows ~4 ulps, and still fails when Adam's step is one off
# (measured 2e-5 to 8e-5 on the second and third losses). bf16: the forward runs on bf16
# weights and activations, where one flipped rounding moves a loss by ~1e-5; measured at most
# 3.6e-5; 2e-4 leaves a 5x margin. It would not catch a step one off (8e-5) on its own: the
# bitwise state check does.
RTOL = {"fp32": 5e-7, "bf16": 2e-4}


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("name", ALL)
def test_resume_continues_as_deepspeed(worlds, name, world_size):
    fx = info(name)
    got = worlds(world_size).run(resumed_losses, name)[0]
    want = fx["continued"]["losses"]
    # the continued losses must differ from the first steps' (the check could fail)
    assert want[0] != pytest.approx(fx["losses_before"][-1], rel=RTOL[fx["dtype"]])
    assert got == pytest.approx(want, rel=RTOL[fx["dtype"]])


def frozen_checked(rank: int, world: int, name: str, tamper: bool) -> str:
    """frozen="check": the model's own frozen weights (the base the run started from) are kept
    when they are the checkpoint's; one changed element on one rank is refused on every rank."""
    from zerocore.engine.sharded_model import sharding_of

    model, optimizer = build(name)
    layers = [l for l in sharding_of(model).layers if l.frozen is not None]
    if tamper and rank == world - 1:
        with torch.no_grad():
            layers[-1].frozen.shard.view(-1)[0] += 1.0
    try:
        fds.load_deepspeed_checkpoint(FIXTURES / name / "ckpt", model, optimizer,
                                      frozen="check")
    except DeepSpeedCheckpointError as e:
        return str(e)
    return f"loaded {len(layers)} frozen groups"


@pytest.mark.parametrize("name, tamper", [("lora_fp32_ws2", False), ("lora_fp32_ws2", True),
                                          ("lora_bf16_ws2", False)])
def test_resume_checks_frozen_weights(worlds, name, tamper):
    got = worlds(2).run(frozen_checked, name, tamper)
    assert got[0] == got[1]
    if tamper:
        assert "differs from the model's: the base weights given are not the ones the " \
               "DeepSpeed run trained on" in got[0]
    else:
        assert got[0].startswith("loaded") and not got[0].startswith("loaded 0")


def wrong_model(rank: int, world: int) -> str:
    import zerocore

    model, optimizer = build("lora_fp32_ws2")
    try:
        zerocore.load_checkpoint(FIXTURES / "full_fp32_ws2" / "ckpt", model, optimizer)
    except DeepSpeedCheckpointError as e:
        return str(e)
    return "loaded"


def test_resume_refuses_another_model(worlds):
    errors = worlds(2).run(wrong_model)
    assert errors[0] == errors[1]
    assert "the model's trained parameters are not the checkpoint's: 8 only in the model" in \
        errors[0]
    assert "\n" not in errors[0]
