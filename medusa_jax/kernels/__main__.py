"""``python -m medusa_jax.kernels``: build the weight-streaming CPU kernels now (``make demo`` and
``make test`` run this at install) and say which path decoding will take; ``--bandwidth`` also
measures this machine's read bandwidth, the roofline of a decoding step."""
from __future__ import annotations

import argparse
import sys

from medusa_jax.kernels import available, load_library, read_bandwidth, status


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m medusa_jax.kernels", description=__doc__,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--bandwidth", action="store_true",
                   help="also measure the read bandwidth (2 threads summing a 1 GiB buffer, best of 3)")
    p.add_argument("--threads", type=int, default=2, help="threads for --bandwidth")
    args = p.parse_args(argv)
    load_library()
    print(f"decoding products: {status()}")
    if args.bandwidth:
        if not available():
            print("error: --bandwidth needs the kernels", file=sys.stderr)
            return 1
        print(f"read bandwidth: {read_bandwidth(1 << 30, args.threads) / 1e9:.1f} GB/s ({args.threads} threads)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
