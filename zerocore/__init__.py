"""zerocore: ZeRO-3 sharding of parameters, gradients and optimizer state for PyTorch, on fused
C++/CUDA kernels.

``zerocore.BUILD`` says which kernels were compiled (CPU only or CPU+CUDA) and for which torch;
``python -m zerocore`` prints it.
"""

from zerocore import _extension

BUILD = _extension.load()

from zerocore import ops, optim, reference  # noqa: E402  (the ops must be registered first)

__version__ = "0.1.0"
__all__ = ["BUILD", "ops", "optim", "reference"]
