"""Benchmark: a model's batched forward and a head-ablation table on a mesh of every device against one device.

The model (a random Llama of --model's size, or the bundled SmolLM2-135M) runs as
``jax.jit(jax.vmap(llama.forward))`` over --batch sequences of --T tokens: once with its params on one
device, once placed by ``llama.shard`` on a ``data x model`` mesh of all devices (Explicit axes, the
batch split over ``data``). The table is ``interventions.ablation_effects`` of every head on one
sequence (one forward per head), once on one device and once with ``mesh=`` (the heads' forwards split
over ``data``, the model over ``model``). Everything is compiled before timing; each time is the median
of --repeats runs, interleaved, with the spread (min to max) and the process CPU time beside it.

On one device there is nothing to compare: the script says so and exits 0 (experiments/device_check.sh
skips its step then).

    python experiments/bench_mesh.py                          # every device; model axis chosen to fit
    python experiments/bench_mesh.py --model smollm2 --mesh 2x3
    XLA_FLAGS=--xla_force_host_platform_device_count=4 python experiments/bench_mesh.py --model tiny --batch 4 --T 32
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's jaxattn, whatever is installed

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxattn import interventions, llama
from jaxattn.checkpoint import cast_params
from jaxattn.io import OutputFolderError, int_at_least, mesh_arg, prepare_output_folder, write_json

MODELS = {  # random Llama shapes (NumPy init, nothing downloaded); smollm2 is the bundled checkpoint
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=512),
    "1b": dict(vocab_size=32768, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
               num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=4096),
}


def _model(name: str, dtype) -> tuple[dict | None, llama.LlamaConfig]:
    """``(params, config)``: the bundled checkpoint, loaded (a few seconds), or a random model's config alone
    (params None: made by :func:`_params` once the mesh is checked, 1b's billion of them included)."""
    if name == "smollm2":
        params, config, _ = llama.load(dtype=dtype)
        return params, config
    return None, llama.LlamaConfig.make(**MODELS[name])


def _params(params: dict | None, config: llama.LlamaConfig, dtype) -> dict:
    return cast_params(llama.init_params(0, config), dtype) if params is None else params


def _mesh_shape(n: int, config: llama.LlamaConfig, asked: tuple[int, int] | None) -> tuple[int, int]:
    if asked:
        return asked
    # the largest model axis the key/value heads and the MLP divide by that leaves a data axis of 2 or more
    fits = [d for d in range(1, n // 2 + 1)
            if n % d == 0 and math.gcd(config.num_key_value_heads, config.intermediate_size) % d == 0]
    model = max(fits)
    return n // model, model


def _timed(fns: dict, repeats: int) -> dict:
    """Median, min and max wall seconds and the median process CPU seconds of each function, interleaved."""
    wall = {k: [] for k in fns}
    cpu = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            w, c = time.perf_counter(), time.process_time()
            jax.block_until_ready(fn())
            wall[k].append(time.perf_counter() - w)
            cpu[k].append(time.process_time() - c)
    return {k: dict(median=statistics.median(wall[k]), min=min(wall[k]), max=max(wall[k]),
                    cpu=statistics.median(cpu[k])) for k in fns}


def _compile_and_compare(fns: dict) -> None:
    """Run each once (compiling it) and print the relative difference of the second's result from the first's."""
    outs = []
    for k, fn in fns.items():
        t = time.perf_counter()
        outs.append(np.asarray(jax.block_until_ready(fn()), np.float64))
        print(f"  compiled {k} in {time.perf_counter() - t:.1f} s")
    print(f"  max |mesh - one| / max |one| = {np.max(np.abs(outs[1] - outs[0])) / np.max(np.abs(outs[0])):.2e}")


def _row(name: str, t: dict, base: dict | None) -> str:
    ratio = f"{base['median'] / t['median']:8.2f}x" if base else " " * 9
    return (f"{name:34} {t['median'] * 1e3:10.1f} ms  ({t['min'] * 1e3:.1f} to {t['max'] * 1e3:.1f})  "
            f"cpu {t['cpu'] * 1e3:10.1f} ms  {ratio}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["tiny", "1b", "smollm2"], default="1b")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    parser.add_argument("--mesh", type=mesh_arg, default=None,
                        help="data x model, e.g. 2x4 (default: every device, the largest model axis the heads and "
                             "MLP divide by with data >= 2)")
    parser.add_argument("--batch", type=int_at_least(1), default=16)
    parser.add_argument("--T", type=int_at_least(1), default=512)
    parser.add_argument("--table-T", type=int_at_least(2), default=64, help="tokens of the ablation table's sequence")
    parser.add_argument("--repeats", type=int_at_least(3), default=5)
    parser.add_argument("--no-table", action="store_true")
    parser.add_argument("--json", default=None, help="also write the numbers to this file")
    args = parser.parse_args(argv)
    if not args.no_table and args.table_T > args.T:
        parser.error(f"--table-T {args.table_T} must be at most --T {args.T} (the table's sequence is the first "
                     f"--table-T tokens of a batch row), or give --no-table")
    if args.json:
        try:  # before any work: nothing wasted, nothing half-written
            json_path = Path(args.json).absolute()
            prepare_output_folder(json_path.parent, (json_path.name,), argument="--json", create=False)
        except OutputFolderError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    n = len(jax.devices())
    print(f"jax {jax.__version__}, {n} x {jax.devices()[0].device_kind} ({jax.default_backend()})")
    if n < 2:
        print("one device: a mesh needs 2 or more; nothing to compare (skipped)")
        return 0
    if args.mesh:  # before the model loads
        if args.mesh[0] * args.mesh[1] > n:
            parser.error(f"--mesh {args.mesh[0]}x{args.mesh[1]} needs {args.mesh[0] * args.mesh[1]} devices, and there are {n}")
        if args.batch % args.mesh[0]:
            parser.error(f"--batch {args.batch} must be a multiple of the mesh's data axis ({args.mesh[0]})")
    dtype = jnp.dtype(args.dtype)
    params, config = _model(args.model, dtype)
    data, model = _mesh_shape(n, config, args.mesh)
    if args.batch % data:  # the default mesh's data axis depends on the model's sizes; before random params are made
        parser.error(f"--batch {args.batch} must be a multiple of the mesh's data axis ({data}); give --batch or --mesh")
    params = _params(params, config, dtype)
    mesh = jax.make_mesh((data, model), ("data", "model"), devices=jax.devices()[:data * model])
    print(f"model {args.model} ({sum(x.size for x in jax.tree.leaves(params)) / 1e6:.0f}M params, {args.dtype}), "
          f"mesh data={data} x model={model}, batch {args.batch} x T={args.T}")
    one = jax.devices()[0]
    params1 = jax.device_put(params, one)
    sharded = llama.shard(params, config, mesh)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, config.vocab_size, (args.batch, args.T)).astype(np.int32)
    forward = jax.jit(jax.vmap(lambda p, i: llama.forward(p, config, i).logits, in_axes=(None, 0)))
    ids1 = jax.device_put(ids, one)
    ids_m = jax.device_put(ids, NamedSharding(mesh, P("data")))
    def on_mesh(fn):  # run under the mesh (the one-device runs must not be: their arrays live on one device)
        def run():
            with jax.set_mesh(mesh):
                return fn()
        return run

    fns = {"forward, one device": lambda: forward(params1, ids1),
           f"forward, mesh {data}x{model}": on_mesh(lambda: forward(sharded, ids_m))}
    _compile_and_compare(fns)
    results = _timed(fns, args.repeats)
    if not args.no_table:
        tab_ids = ids[0, : args.table_T]

        def metric(out):  # the log-probability of the last token
            return jax.nn.log_softmax(out.logits[-2].astype(jnp.float32))[int(tab_ids[-1])]

        bound1 = interventions.bind(llama, params1, config, tab_ids)
        bound_m = interventions.bind(llama, sharded, config, tab_ids)
        tables = {"ablation table, one device": lambda: interventions.ablation_effects(bound1, metric),
                  f"ablation table, mesh {data}x{model}": lambda: interventions.ablation_effects(bound_m, metric,
                                                                                               mesh=mesh)}
        _compile_and_compare(tables)
        results.update(_timed(tables, args.repeats))
    print(f"\nmedian of {args.repeats} (min to max), process CPU time, speed-up over one device:")
    names = list(results)
    for i, k in enumerate(names):
        base = results[names[i - 1]] if "mesh" in k else None
        print(_row(k, results[k], base))
    if args.json:
        write_json(json_path, dict(
            command="python experiments/bench_mesh.py " + " ".join(sys.argv[1:] if argv is None else argv),
            machine=f"{platform.node()} {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
                    f"{n} x {jax.devices()[0].device_kind} ({jax.default_backend()})",
            jax=jax.__version__, model=args.model, dtype=args.dtype, mesh=[data, model], batch=args.batch,
            T=args.T, repeats=args.repeats, results=results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
