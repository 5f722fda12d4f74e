"""Every attention implementation this machine runs against the float64 oracle, on one grid; one table.

A thin script over jaxattn.check_conformance (the grid, the oracle, the comparison) and
jaxattn.conformance_table: it parses arguments, runs the check, and writes markdown and JSON with the
command and the machine.

  python experiments/conformance.py                      # the whole grid -> conformance-output/conformance.md
  python experiments/conformance.py --quick              # float32 and bfloat16, odd lengths only
  python experiments/conformance.py --out docs --implementations xla blockwise

Exit status 1 if any (case, implementation) that ran is beyond its tolerance.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's jaxattn, whatever is installed

import jax

import jaxattn
from jaxattn.io import OutputFolderError, atomic_write, int_at_least, prepare_output_folder, write_json

IMPLEMENTATIONS = ("xla", "cudnn", "pallas", "blockwise")


def _machine() -> str:
    dev = jax.devices()[0]
    return (f"{platform.machine()}, {os.cpu_count()} CPU cores; jax {jax.__version__}, backend "
            f"{jax.default_backend()} ({dev.device_kind}, {jax.device_count()} device(s))")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="conformance-output", help="output folder (conformance.md, conformance.json)")
    parser.add_argument("--quick", action="store_true", help="float32 and bfloat16, odd lengths only")
    parser.add_argument("--implementations", nargs="+", default=list(IMPLEMENTATIONS), choices=IMPLEMENTATIONS,
                        help="the implementations checked (at least one; default: all)")
    parser.add_argument("--seed", type=int_at_least(0), default=0)
    args = parser.parse_args()
    try:  # before any work: nothing wasted, nothing half-written
        prepare_output_folder(args.out, ("conformance.md", "conformance.json"), create=False)
    except OutputFolderError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2)

    grid = dict(dtypes=("float32", "bfloat16"), lengths=((13, 29),)) if args.quick else {}
    report = lambda r: print(f"{r['label']} {r['implementation']}: {r['status']}", flush=True)
    start = time.perf_counter()
    records = jaxattn.check_conformance(args.implementations, seed=args.seed, progress=report, **grid)
    seconds = time.perf_counter() - start
    command = " ".join(["python", "experiments/conformance.py", *sys.argv[1:]])
    text = (f"# Conformance: every implementation against the float64 oracle\n\nCommand: `{command}`  \n"
            f"Machine: {_machine()}; {datetime.date.today().isoformat()}; {seconds:.0f} s.\n\n"
            + jaxattn.conformance_table(records))
    out = Path(args.out)
    atomic_write(out / "conformance.md", text)
    write_json(out / "conformance.json", records)  # an inf error (a failed case) as a string: strict JSON
    print(text)
    print(f"wrote {out / 'conformance.md'} and {out / 'conformance.json'}")
    sys.exit(1 if any(r["status"] == "fail" for r in records) else 0)


if __name__ == "__main__":
    main()
