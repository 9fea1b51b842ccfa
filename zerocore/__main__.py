"""Says what zerocore was built with (the kernels, the torch they are for)
and whether CUDA is available. ``python -m zerocore.selftest`` checks that they work."""

import argparse
import sys

import torch

# `python -m zerocore` has imported the package (and torch) before this module runs anyway.
import zerocore


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(prog="python -m zerocore", description=__doc__).parse_args(argv)
    print(f"zerocore {zerocore.__version__}")
    print(zerocore.BUILD)
    print(f"torch {torch.__version__}, CUDA available: {torch.cuda.is_available()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
