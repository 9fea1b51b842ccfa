"""``python -m zerocore``: says what zerocore was built with."""

import torch

import zerocore

print(f"zerocore {zerocore.__version__}")
print(zerocore.BUILD)
print(f"torch {torch.__version__}, CUDA available: {torch.cuda.is_available()}")
