"""zerocore.ops and its kernels (fused Adam, gradient statistics, pack/unpack, int8), the
optimizers, loading the extension, the self-test."""
