"""The compiled kernels: ``ops`` (typed wrappers over ``torch.ops.zerocore.*``, which loads the
library, ``_extension``, built from csrc/ as ``_sources`` says) and ``reference`` (what each op
computes, in plain PyTorch). Imports nothing else of zerocore."""
