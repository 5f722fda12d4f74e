"""Peak host memory of loading a Llama-family checkpoint onto a mesh of host devices, each way in a fresh process.

Ways (each in its own subprocess, so one's peak cannot hide another's):
  * ``mesh``: ``llama.load(path, dtype=bfloat16, mesh=mesh)``, each tensor read, cast and sent to its shards;
  * ``whole``: the whole float32 model first (``llama.load(path)``), then cast to bfloat16 and
    ``llama.shard(...)``: what placing a model by hand after loading costs.

Each process reads its resident memory from ``/proc/self/status``: ``VmRSS`` once the JAX runtime is up
(the mesh made, nothing loaded: the baseline), ``VmHWM`` (the peak) after loading, and the peak of
``RssAnon`` (memory that is not a mapped file) sampled every millisecond while loading. The devices of a
host mesh live in host memory, so the params' own shards (``device bytes``: every shard on every device,
replicas included) are part of that peak; ``transient`` is what the load held beyond them:
``peak - baseline - device bytes``. ``bf16 size`` is the model's bfloat16 size (one copy). Each way runs
--repeats times (3 or more), each time in a fresh process, the ways interleaved; after each run's row the
median peak, transient and load seconds (wall and the process's CPU time) are printed with their spread
(min-max), and a ``summary:`` JSON line with the command and the machine.

    python experiments/load_memory.py                 # the bundled SmolLM2-135M (Q4_1 GGUF), 2 x 3 mesh
    python experiments/load_memory.py --mesh 1x1 --ways mesh --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _status() -> dict[str, int]:
    """``/proc/self/status``'s memory lines in bytes."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
            out[key] = int(value.split()[0]) * 1024
    return out


def _child(way: str, path: str | None, shape: tuple[int, int]) -> dict:  # runs in the subprocess
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxattn import llama
    from jaxattn.checkpoint import cast_params

    mesh = jax.make_mesh(shape, ("data", "model"))
    jax.device_put(np.zeros(4, np.float32)).block_until_ready()
    base = _status()
    peak_anon = [base["RssAnon"]]
    done = threading.Event()

    def sample():
        while not done.is_set():
            peak_anon[0] = max(peak_anon[0], _status()["RssAnon"])
            time.sleep(0.001)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t0, c0 = time.perf_counter(), time.process_time()
    if way == "mesh":
        params, config, _ = llama.load(path, dtype=jnp.bfloat16, mesh=mesh)
    else:
        params, config, _ = llama.load(path)
        params = llama.shard(cast_params(params, jnp.bfloat16), config, mesh)
    jax.block_until_ready(params)
    seconds, cpu_seconds = time.perf_counter() - t0, time.process_time() - c0  # CPU: every thread, the sampler's too
    done.set()
    sampler.join()
    end = _status()
    leaves = jax.tree.leaves(params)
    device_bytes = sum(s.data.nbytes for leaf in leaves for s in leaf.addressable_shards)
    bf16_bytes = sum(leaf.size for leaf in leaves) * 2
    return dict(way=way, mesh="x".join(map(str, shape)), devices=len(jax.devices()), seconds=round(seconds, 3),
                cpu_seconds=round(cpu_seconds, 3),
                baseline=base["VmRSS"], peak=end["VmHWM"], peak_anon=peak_anon[0], base_anon=base["RssAnon"],
                device_bytes=device_bytes, bf16_bytes=bf16_bytes, end_rss=end["VmRSS"], end_file=end["RssFile"])


def mesh_arg(text: str) -> tuple[int, int]:  # jaxattn.io.mesh_arg's twin: this script sets up
    # the environment before anything imports jax (importing jaxattn would), so it keeps its own
    """An argparse ``type=``: ``DATAxMODEL`` (e.g. ``2x3``) as two positive ints (else a usage error, exit 2)."""
    parts = text.split("x")
    if len(parts) != 2 or not all(p.isascii() and p.isdigit() and int(p) >= 1 for p in parts):
        raise argparse.ArgumentTypeError(f"must be DATAxMODEL, two positive ints such as 2x3, received {text!r}")
    return int(parts[0]), int(parts[1])


def int_at_least(minimum: int):  # jaxattn.io.int_at_least's twin, for the same reason as mesh_arg's
    """An argparse ``type=``: an int >= ``minimum`` (else a usage error, exit 2)."""
    def parse(text: str) -> int:
        if not (text.isascii() and text.isdigit() and int(text) >= minimum):
            raise argparse.ArgumentTypeError(f"must be an int >= {minimum}, received {text!r}")
        return int(text)

    parse.__name__ = f"int >= {minimum}"
    return parse


def _spread(xs: list[float], scale: float = 1, unit: str = "", digits: int = 0) -> str:
    """The median with the spread: ``12M (11-14)``."""
    m, lo, hi = statistics.median(xs) / scale, min(xs) / scale, max(xs) / scale
    return f"{m:.{digits}f}{unit} ({lo:.{digits}f}-{hi:.{digits}f})"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--path", default=None, help="a .gguf file or checkpoint directory (default: the bundled SmolLM2)")
    parser.add_argument("--mesh", type=mesh_arg, default="2x3", help="data x model host devices (default 2x3)")
    parser.add_argument("--ways", nargs="+", default=["mesh", "whole"], choices=["mesh", "whole"])
    parser.add_argument("--repeats", type=int_at_least(3), default=3,
                        help="fresh processes per way, interleaved (default 3): medians with their spread")
    parser.add_argument("--child", default=None, choices=["mesh", "whole"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    shape = args.mesh
    mesh_text = f"{shape[0]}x{shape[1]}"
    if args.path is not None and not os.path.exists(args.path):  # before any process starts or model loads
        parser.error(f"--path {args.path!r}: no such file or folder")
    if args.child:
        print(json.dumps(_child(args.child, args.path, shape)))
        return
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={shape[0] * shape[1]}").strip()
    mib = 2**20
    print(f"{'way':6} {'mesh':5} {'baseline':>9} {'peak':>9} {'peak-base':>10} {'device':>9} {'transient':>10} "
          f"{'bf16 size':>10} {'transient/bf16':>15} {'(peak-base)/bf16':>17} {'seconds':>8}")
    runs = {way: [] for way in args.ways}
    for _ in range(args.repeats):  # interleaved: load on the machine hits every way alike
        for way in args.ways:
            cmd = [sys.executable, __file__, "--child", way, "--mesh", mesh_text] + (["--path", args.path] if args.path else [])
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if proc.returncode:
                sys.exit(f"{way}: the load failed:\n{proc.stderr[-3000:]}")
            r = json.loads(proc.stdout.strip().splitlines()[-1])
            rise = r["peak"] - r["baseline"]
            transient = rise - r["device_bytes"]
            runs[way].append(dict(r, rise=rise, transient=transient))
            print(f"{way:6} {r['mesh']:5} {r['baseline'] / mib:8.0f}M {r['peak'] / mib:8.0f}M {rise / mib:9.0f}M "
                  f"{r['device_bytes'] / mib:8.0f}M {transient / mib:9.0f}M {r['bf16_bytes'] / mib:9.0f}M "
                  f"{transient / r['bf16_bytes']:15.2f} {rise / r['bf16_bytes']:17.2f} {r['seconds']:8.1f}")
            print("       raw: " + json.dumps(r))
    print(f"\nmedian of {args.repeats} fresh processes per way (min-max):")
    summary = dict(command="python experiments/load_memory.py " + " ".join(sys.argv[1:] if argv is None else argv),
                   machine=f"{platform.node()} {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
                   repeats=args.repeats, ways={})
    for way, rs in runs.items():
        col = {k: [r[k] for r in rs] for k in ("peak", "rise", "transient", "seconds", "cpu_seconds")}
        print(f"{way:6} {mesh_text:5} peak {_spread(col['peak'], mib, 'M')}, peak-base {_spread(col['rise'], mib, 'M')}, "
              f"transient {_spread(col['transient'], mib, 'M')}; load {_spread(col['seconds'], unit=' s', digits=2)} wall, "
              f"{_spread(col['cpu_seconds'], unit=' s', digits=2)} CPU")
        summary["ways"][way] = {k: dict(median=statistics.median(v), min=min(v), max=max(v)) for k, v in col.items()}
    print("summary: " + json.dumps(summary))


if __name__ == "__main__":
    main()
