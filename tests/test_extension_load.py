"""Loading zerocore._C: an installed build whose sources have since changed (an editable install
after a ``git pull``) is noticed, instead of loading a library that lacks the new ops."""

from __future__ import annotations

import json

import torch

from zerocore import _extension, _sources


def _write_info(folder, fingerprint) -> None:
    info = {"torch": torch.__version__, "cuda": None, "cuda_arch_list": None, "avx2": True}
    if fingerprint is not None:
        info["fingerprint"] = fingerprint
    (folder / "_C_build.json").write_text(json.dumps(info))


def test_a_build_of_other_sources_is_stale(tmp_path):
    current = _sources.fingerprint(_sources.repo_root(), with_cuda=False,
                                   torch_version=torch.__version__, cuda_arch_list=None)
    _write_info(tmp_path, current)
    assert not _extension._prebuilt_is_stale(str(tmp_path))
    _write_info(tmp_path, "0" * 64)
    assert _extension._prebuilt_is_stale(str(tmp_path))
    _write_info(tmp_path, None)  # a build that recorded no fingerprint: trusted as before
    assert not _extension._prebuilt_is_stale(str(tmp_path))
