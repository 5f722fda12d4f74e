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
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["The capital of France is", "One, two, three,", "def add(a, b):", "The trophy didn't fit in"]
BATCH = len(PROMPTS)  # sequences in the batch (the tiny model's too), split over the processes and over data


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

    mesh = jax.make_mesh(args.mesh, ("data", "model"))  # every process's devices; Explicit axes
    t0 = time.perf_counter()
    if args.model == "tiny":
        config = llama.LlamaConfig.make(vocab_size=64, hidden_size=32, intermediate_size=24, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
        host = jax.tree.map(np.asarray, llama.init_params(1, config))
        params = llama.shard(host, config, mesh)
        rng = np.random.default_rng(0)
        ids, mask = rng.integers(0, 64, (BATCH, 8)).astype(np.int32), np.ones((BATCH, 8), bool)
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
        mesh=mesh_text(args.mesh), model=args.model, output_specs=specs, logits_rel_err=rel,
        log_prob_rel_err=float(np.max(np.abs(score - ref[1])) / np.max(np.abs(ref[1]))),
        tokens_equal=bool(np.array_equal(tokens, ref[2])), load_seconds=round(load_seconds, 1),
        first_run_seconds=round(run_seconds, 1))), flush=True)


def worker_command(args: argparse.Namespace, process_id: int, port: int) -> list[str]:
    """The command line of worker ``process_id``: this script again, joining the others at ``port``."""
    return [sys.executable, __file__, "--process-id", str(process_id), "--port", str(port),
            "--processes", str(args.processes), "--mesh", mesh_text(args.mesh), "--model", args.model]


def _stop(procs: list[subprocess.Popen]) -> None:
    """Kill every worker still running with all it started (each runs in a process group of its own), and reap it."""
    alive = [p for p in procs if p.poll() is None]
    for p in alive:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    for p in alive:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


def _text(f) -> str:
    f.seek(0)
    return f.read().decode("utf-8", "replace")


def launch(args: argparse.Namespace) -> int:
    """Start the workers, wait for them all within ``--timeout`` seconds, print process 0's JSON line.

    Returns 0 when every worker succeeded; 1 when one failed or the time ran out: then every worker still
    running, and whatever it started, is killed before this returns (one failure stops the others, which
    would otherwise wait for it until the timeout)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"--xla_force_host_platform_device_count={args.devices_per_process}",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    procs: list[subprocess.Popen] = []
    outs = [tempfile.TemporaryFile() for _ in range(args.processes)]  # files, not pipes: nothing blocks on a full pipe
    errs = [tempfile.TemporaryFile() for _ in range(args.processes)]
    deadline = time.monotonic() + args.timeout
    try:
        for i in range(args.processes):  # each in a session (and process group) of its own: killed as a whole
            procs.append(subprocess.Popen(worker_command(args, i, port), env=env, stdin=subprocess.DEVNULL,
                                          stdout=outs[i], stderr=errs[i], start_new_session=True))
        while True:
            codes = [p.poll() for p in procs]
            failed = [i for i, c in enumerate(codes) if c]
            if failed:
                _stop(procs)
                for i in failed:
                    print(f"process {i} failed ({codes[i]}):\n{_text(errs[i])[-3000:]}", file=sys.stderr)
                return 1
            if all(c == 0 for c in codes):
                break
            if time.monotonic() >= deadline:
                waiting = [i for i, c in enumerate(codes) if c is None]
                _stop(procs)
                print(f"error: the workers did not finish within --timeout {args.timeout:g} s; stopped process"
                      f"{'es' * (len(waiting) != 1)} {', '.join(map(str, waiting))} and all they started",
                      file=sys.stderr)
                return 1
            time.sleep(0.05)
        for f in outs:
            for line in _text(f).splitlines():
                if line.startswith("{"):
                    print(line)
        return 0
    finally:  # an interrupt or an error here too: no worker is left running
        _stop(procs)
        for f in outs + errs:
            f.close()


def mesh_arg(text: str) -> tuple[int, int]:  # jaxattn.io.mesh_arg's twin: this script sets up
    # the environment before anything imports jax (importing jaxattn would), so it keeps its own
    """An argparse ``type=``: ``DATAxMODEL`` (e.g. ``2x3``) as two positive ints (else a usage error, exit 2)."""
    parts = text.split("x")
    if len(parts) != 2 or not all(p.isascii() and p.isdigit() and int(p) >= 1 for p in parts):
        raise argparse.ArgumentTypeError(f"must be DATAxMODEL, two positive ints such as 2x3, received {text!r}")
    return int(parts[0]), int(parts[1])


def mesh_text(shape: tuple[int, int]) -> str:
    return f"{shape[0]}x{shape[1]}"


def int_at_least(minimum: int):  # jaxattn.io.int_at_least's twin, for the reason mesh_arg has one
    """An argparse ``type=``: the text as an int >= ``minimum`` (anything else is a usage error, exit 2)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum:
            raise argparse.ArgumentTypeError(f"must be {'a positive int' if minimum == 1 else f'an int >= {minimum}'}, "
                                             f"received {text!r}")
        return value

    parse.__name__ = f"int >= {minimum}"
    return parse


def positive_seconds(text: str) -> float:
    """An argparse ``type=``: a finite number of seconds > 0."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, received {text!r}")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["smollm2", "tiny"], default="smollm2")
    parser.add_argument("--processes", type=int_at_least(2), default=2,
                        help="worker processes (2 or more: the point is several processes joined as one mesh)")
    parser.add_argument("--devices-per-process", type=int_at_least(1), default=3)
    parser.add_argument("--mesh", type=mesh_arg, default="2x3", help="data x model over all processes' devices")
    parser.add_argument("--timeout", type=positive_seconds, default=600,
                        help="seconds for the whole run; past them every worker is killed (exit 1)")
    parser.add_argument("--process-id", type=int_at_least(0), default=None, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int_at_least(1), default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    data, model = args.mesh
    if args.process_id is None:  # the launcher: the workers' sizes checked before any starts
        devices = args.processes * args.devices_per_process
        if data * model != devices:
            parser.error(f"--mesh {mesh_text(args.mesh)} must cover every device: --processes {args.processes} x "
                         f"--devices-per-process {args.devices_per_process} = {devices}, and {data} x {model} = {data * model}")
        if data % args.processes or BATCH % data:
            parser.error(f"the data axis of --mesh {mesh_text(args.mesh)} ({data}) must be a multiple of --processes "
                         f"({args.processes}), each process feeding its own rows, and divide the batch of {BATCH} sequences")
        return launch(args)
    if args.port is None or args.process_id >= args.processes:
        parser.error("--process-id and --port are given by the launcher: run without them")
    worker(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
