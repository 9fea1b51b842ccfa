"""The compiled kernels: ``ops`` (typed wrappers over ``torch.ops.zerocore.*``, which loads the
library, ``_extension``, built from csrc/ as ``_sources`` says), ``reference`` (what each op
computes, in plain PyTorch) and ``formats`` (the NF4 and fp8 frozen-weight formats and their
quantizers, which ops re-exports). Imports nothing else of zerocore."""
