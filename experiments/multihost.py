"""The single-process mesh code, run by several processes under ``jax.distributed.initialize()``, on one machine.

The launcher starts ``--processes`` copies of this script on this host's CPU (each with
``--devices-per-process`` host devices, joined through gloo, JAX's CPU collectives), as a cluster
manager would start one per host. Each process runs the same lines a single process runs (``worker``
below: ``jax.make_mesh`` over every process's devices, ``llama.load(..., mesh=)``, a ``jax.jit(jax.vmap(...))``
forward, log_prob and greedy generate of a batch split over ``data``), with two multi-host lines
around them: its share of the batch goes in through ``jax.make_array_from_process_local_data``, and
the outputs come back through ``multihost_utils.process_allgather``. Process 0 then compares them with
the same functions on one device of its own, unsharded, and prints one JSON line.

    python experiments/multihost.py                       # SmolLM2-135M, 2 processes x 3 devices: a 2 x 3 mesh
    python experiments/multihost.py --model tiny --processes 2 --devices-per-process 2 --mesh 2x2

On GPU hosts the same worker runs with ``jax.distributed.initialize()`` and no arguments (the cluster's
environment names the coordinator), one process per host; ``docs/scaling.md`` says what was run where.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["The capital of France is", "One, two, three,", "def add(a, b):", "The trophy didn't fit in"]


def worker(args: argparse.Namespace) -> None:
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{args.port}", num_processes=args.processes,
                               process_id=args.process_id)
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxattn import llama
    from jaxattn.models import left_pad

    shape = tuple(int(n) for n in args.mesh.split("x"))
    mesh = jax.make_mesh(shape, ("data", "model"))  # every process's devices; Explicit axes
    t0 = time.perf_counter()
    if args.model == "tiny":
        config = llama.LlamaConfig.make(vocab_size=64, hidden_size=32, intermediate_size=24, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
        host = jax.tree.map(np.asarray, llama.init_params(1, config))
        params = llama.shard(host, config, mesh)
        rng = np.random.default_rng(0)
        ids, mask = rng.integers(0, 64, (4, 8)).astype(np.int32), np.ones((4, 8), bool)
        mask[1, :2] = False
    else:
        params, config, tokenizer = llama.load(mesh=mesh)  # each process places only its own devices' shards
        host = None
        ids, mask = (np.asarray(a) for a in left_pad([tokenizer.encode(t) for t in PROMPTS]))
    load_seconds = time.perf_counter() - t0
    new = 6

    def run(p, i, k):
        out = llama.forward(p, config, i, attention_mask=k)
        score = llama.log_prob(p, config, i, attention_mask=k, start=1)
        tokens = llama.generate(p, config, i, attention_mask=k, max_new_tokens=new)
        return out.logits, score, tokens

    program = jax.jit(jax.vmap(run, in_axes=(None, 0, 0)))
    B = ids.shape[0]
    share = slice(B // jax.process_count() * jax.process_index(), B // jax.process_count() * (jax.process_index() + 1))
    batch = NamedSharding(mesh, P("data"))
    g_ids, g_mask = (jax.make_array_from_process_local_data(batch, a[share], a.shape) for a in (ids, mask))
    t0 = time.perf_counter()
    with jax.set_mesh(mesh):
        out = jax.block_until_ready(program(params, g_ids, g_mask))
    run_seconds = time.perf_counter() - t0
    specs = [str(x.sharding.spec) for x in out]
    logits, score, tokens = (np.asarray(x) for x in multihost_utils.process_allgather(out, tiled=True))
    if jax.process_index() != 0:
        return
    if host is None:
        host, _, _ = llama.load()
    ref = jax.jit(jax.vmap(run, in_axes=(None, 0, 0)))(host, jnp.asarray(ids), jnp.asarray(mask))
    ref = [np.asarray(x, np.float64) for x in ref]
    real = mask[:, :, None]
    rel = float(np.max(np.abs(np.where(real, logits - ref[0], 0))) / np.max(np.abs(np.where(real, ref[0], 0))))
    print(json.dumps(dict(
        processes=jax.process_count(), devices=len(jax.devices()), local_devices=len(jax.local_devices()),
        mesh=args.mesh, model=args.model, output_specs=specs, logits_rel_err=rel,
        log_prob_rel_err=float(np.max(np.abs(score - ref[1])) / np.max(np.abs(ref[1]))),
        tokens_equal=bool(np.array_equal(tokens, ref[2])), load_seconds=round(load_seconds, 1),
        first_run_seconds=round(run_seconds, 1))), flush=True)


def launch(args: argparse.Namespace) -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"--xla_force_host_platform_device_count={args.devices_per_process}",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    procs = [subprocess.Popen([sys.executable, __file__, "--process-id", str(i), "--port", str(port),
                               "--processes", str(args.processes), "--mesh", args.mesh, "--model", args.model],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(args.processes)]
    status = 0
    for i, p in enumerate(procs):
        out, err = p.communicate(timeout=args.timeout)
        if p.returncode:
            print(f"process {i} failed ({p.returncode}):\n{err[-3000:]}", file=sys.stderr)
            status = 1
        for line in out.splitlines():
            if line.startswith("{"):
                print(line)
    return status


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["smollm2", "tiny"], default="smollm2")
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--devices-per-process", type=int, default=3)
    parser.add_argument("--mesh", default="2x3", help="data x model over all processes' devices")
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--process-id", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.process_id is None:
        sys.exit(launch(args))
    worker(args)


if __name__ == "__main__":
    main()
