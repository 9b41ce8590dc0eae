"""Start-up time of decode.py: wall time minus its own prefill and decode seconds.

    .venv/bin/python scripts/startup_time.py [--runs 4] [--python PYTHON] [-- decode.py flags]

Runs ``decode.py --json --max-new-tokens 32`` (plus any flags after ``--``) `--runs` times in a
row with a fresh, empty ``MEDUSA_JAX_CACHE_DIR`` (a temporary directory), so the first run converts
the model and the later ones read the converted-model cache; XLA's compilation cache is left as
it is. Prints, per run, the wall time, ``prefill_s + decode_s`` and the difference (imports, model
load, heads, tracing and compilation). ``--python`` picks the interpreter, e.g. the venv of a base
install without torch.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python scripts/startup_time.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=4, help="runs in a row (the first converts the model)")
    p.add_argument("--python", default=sys.executable, help="the interpreter that runs decode.py")
    p.add_argument("decode_args", nargs="*", help="extra decode.py flags (after --)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, MEDUSA_JAX_CACHE_DIR=cache)
        for i in range(args.runs):
            t0 = time.perf_counter()
            out = subprocess.run([args.python, "decode.py", "--json", "--max-new-tokens", "32", *args.decode_args],
                                 cwd=ROOT, env=env, capture_output=True, text=True)
            wall = time.perf_counter() - t0
            if out.returncode != 0:
                print(out.stderr[-2000:], file=sys.stderr)
                return out.returncode
            d = json.loads(out.stdout.strip().splitlines()[-1])
            work = d["prefill_s"] + d["decode_s"]
            print(f"run {i}: wall {wall:.2f} s, prefill + decode {work:.2f} s, start-up {wall - work:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
