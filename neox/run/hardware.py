"""The machines a plan estimates a step's time on: the links between GPUs (``--link`` within a
node, ``--link-across`` between nodes) and a GPU's peak arithmetic (``--gpu``), each a named
preset or a number, with the figures in one table each.

Every link figure is the specification's bandwidth in ONE direction (1 GB = 10^9 bytes), at the
signalling rate less line encoding, before protocol overheads: what a ring collective's busiest
link can carry at best. A GPU's figure is its dense (no sparsity) 16-bit tensor-core peak with
fp32 accumulation, from the vendor's datasheet or architecture whitepaper.
"""

from __future__ import annotations

import dataclasses

from neox.setting import BadValue, finite_float

__all__ = ["LINKS", "GPUS", "Link", "link_of", "gpu_tflops_of"]

# GB/s per direction, and where the figure comes from.
LINKS = {
    # PCI-SIG PCIe 4.0 base specification: 16 GT/s per lane, 128b/130b encoding, x16.
    "pcie4": 31.5,
    # PCI-SIG PCIe 5.0 base specification: 32 GT/s per lane, 128b/130b encoding, x16.
    "pcie5": 63.0,
    # NVIDIA A100 datasheet: third-generation NVLink, 600 GB/s per GPU counting both directions.
    "nvlink3": 300.0,
    # NVIDIA H100 SXM datasheet: fourth-generation NVLink, 900 GB/s per GPU, both directions.
    "nvlink4": 450.0,
    # InfiniBand EDR, HDR and NDR ports (IBTA): 100, 200 and 400 Gb/s in each direction.
    "ib-100g": 12.5,
    "ib-200g": 25.0,
    "ib-400g": 50.0,
    # IEEE 802.3by 25 Gigabit Ethernet: 25 Gb/s in each direction.
    "eth-25g": 3.125,
}

# Peak dense bf16 tensor TFLOPS (fp32 accumulation), and where the figure comes from.
GPUS = {
    # NVIDIA GA102 (Ampere) whitepaper, GeForce RTX 3090: 71 (142 with sparsity).
    "rtx3090": 71.0,
    # NVIDIA Ada Lovelace whitepaper, GeForce RTX 4090: 165.2 (330.4 with sparsity).
    "rtx4090": 165.2,
    # NVIDIA A100 datasheet: 312 (624 with sparsity).
    "a100": 312.0,
    # NVIDIA H100 SXM and H200 datasheets: 989 (1,979 with sparsity).
    "h100": 989.0,
    "h200": 989.0,
}


@dataclasses.dataclass(frozen=True)
class Link:
    """A link's name (a preset, or the number given) and its bandwidth per direction."""

    name: str
    gb_per_s: float   # 10^9 bytes per second, one direction

    @property
    def bytes_per_s(self) -> float:
        return self.gb_per_s * 1e9


def _named(table: dict[str, float], unit: str) -> str:
    return ", ".join(f"{name} ({value:g} {unit})" for name, value in table.items())


def _number_or_preset(text: str, table: dict[str, float], unit: str) -> tuple[str, float]:
    word = text.strip().lower()
    if word in table:
        return word, table[word]
    try:
        value = finite_float(word)
    except (BadValue, ValueError):
        value = -1.0
    if value <= 0:
        raise BadValue(f"{text!r} is neither a preset nor a number of {unit} above 0; the "
                       f"presets: {_named(table, unit)}")
    return f"{value:g} {unit}", value


def link_of(text: str) -> Link:
    """``--link``/``--link-across``: a preset of ``LINKS`` or a number of GB/s (one direction)."""
    return Link(*_number_or_preset(text, LINKS, "GB/s"))


def gpu_tflops_of(text: str) -> float:
    """``--gpu``: a preset of ``GPUS`` or a number of peak TFLOPS."""
    return _number_or_preset(text, GPUS, "TFLOPS")[1]
