"""Multi-host (multi-process) setup, and a self-check that runs on one machine with 2 CPU processes.

On a cluster every process (one per host, each driving its local GPUs) runs the same program:

    from sharding.multihost import initialize
    initialize()                      # jax.distributed.initialize(): env/cluster auto-detection, or pass
                                      # coordinator_address="host0:1234", num_processes=N, process_id=i
    mesh = sharding.make_mesh("tp8ep2")          # over jax.devices(): all processes' devices
    target = kimijax.load_target(path, mesh=mesh, layout="tp8ep2")

`jax.make_mesh` orders devices so the innermost axis ("tensor") stays inside a host (NVLink), and
`load_target` builds each array with `jax.make_array_from_callback`, which only calls back for the devices of
this process: each host reads only the expert slices and tensor shards its own GPUs hold.

Self-check (2 processes x 4 CPU devices = one 8-device mesh, gloo collectives):
    python -m sharding.multihost --check [--layout ep8]
spawns 2 workers; each loads a tiny8 checkpoint onto the global mesh and computes the full-sequence logits; the
result (gathered across processes) must equal a single-process computation.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, cpu: bool = False, **kw):
    """jax.distributed.initialize (arguments optional where the cluster is auto-detected: SLURM, Open MPI,
    Kubernetes, or JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID). cpu=True selects gloo
    collectives so CPU devices of different processes can talk (tests)."""
    import jax
    if cpu:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    args = {k: v for k, v in dict(coordinator_address=coordinator_address, num_processes=num_processes,
                                  process_id=process_id).items() if v is not None}
    jax.distributed.initialize(**args, **kw)


def _worker(args):
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.local_devices}"
    os.environ["JAX_PLATFORMS"] = "cpu"
    initialize(f"localhost:{args.port}", args.nproc, args.rank, cpu=True)
    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    from kimijax.loading import load_target
    from sharding.mesh import make_mesh

    mesh = make_mesh(args.layout)
    t = load_target(args.ckpt, mesh=mesh, layout=args.layout, dtype="float32", progress=False)
    local = sum(len(a.addressable_shards) for a in jax.tree_util.tree_leaves(t.params))
    total = sum(len(a.sharding.device_set) for a in jax.tree_util.tree_leaves(t.params))
    toks = np.load(os.path.join(args.ckpt, "tokens.npy"))
    logits = multihost_utils.process_allgather(t.forward(toks), tiled=True)
    if jax.process_index() == 0:
        np.save(args.out, np.asarray(logits))
    print(f"process {jax.process_index()}/{jax.process_count()}: {len(jax.local_devices())} local of "
          f"{len(jax.devices())} devices, built {local} of {total} param shards locally", flush=True)
    jax.distributed.shutdown()


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def check(layout: str = "ep8", nproc: int = 2, local_devices: int = 4, port: int | None = None, timeout: int = 300):
    """Run the 2-process self-check; returns max |logits - single-process logits|."""
    import dataclasses

    import numpy as np

    from kimijax.loading import load_target, save_hf_checkpoint
    from kimijax.target import random_kimi_params
    from sharding.experiments import tiny8_config

    cfg = dataclasses.replace(tiny8_config("float32"), num_hidden_layers=2)
    with tempfile.TemporaryDirectory() as d:
        ck = os.path.join(d, "ck")
        save_hf_checkpoint(cfg, random_kimi_params(cfg, 0), ck)
        toks = np.random.default_rng(0).integers(3, cfg.vocab_size - 1, size=(2, 8))
        np.save(os.path.join(ck, "tokens.npy"), toks)
        want = np.asarray(load_target(ck, dtype="float32", progress=False).forward(toks))
        out = os.path.join(d, "logits.npy")
        env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS",)}
        port = port or _free_port()
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        procs = [subprocess.Popen([sys.executable, "-m", "sharding.multihost", "--worker", "--rank", str(r),
                                   "--nproc", str(nproc), "--local-devices", str(local_devices), "--port", str(port),
                                   "--layout", layout, "--ckpt", ck, "--out", out], env=env, cwd=root)
                 for r in range(nproc)]
        try:
            codes = [p.wait(timeout=timeout) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        if any(codes):
            raise RuntimeError(f"multihost workers failed: exit codes {codes}")
        got = np.load(out)
    return float(np.abs(got - want).max())


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m sharding.multihost", description="multi-process self-check")
    p.add_argument("--check", action="store_true")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--local-devices", type=int, default=4)
    p.add_argument("--port", type=int, default=None, help="coordinator port (default: a free one)")
    p.add_argument("--layout", default="ep8")
    p.add_argument("--ckpt", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return _worker(args)
    err = check(args.layout, args.nproc, args.local_devices, args.port)
    print(f"{args.nproc} processes x {args.local_devices} CPU devices, layout {args.layout}: "
          f"max |logits - single process| = {err:.2e}")
    if err > 1e-3:
        sys.exit(1)


if __name__ == "__main__":
    main()
