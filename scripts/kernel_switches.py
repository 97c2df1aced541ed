"""The opt-in kernels a script can switch on for an A/B (each off by default until a GPU run shows it pays):
the target's skinny MLP and projection kernels (pallas_kernels/skinny_mlp.py, LlamaTarget fields) and the
round's one-kernel tree pops and cache commit (`kimijax.RoundKernels`, an Engine argument). One set of flags
for profile_round.py, bench_e2e.py and offline_gpu.py."""

from __future__ import annotations

import dataclasses

from kimijax.spec.kernels import IMPLS

SWITCHES = {  # flag -> what it switches
    "mlp_impl": "the target's MLP for passes of <= 256 rows (pallas_kernels/skinny_mlp.py)",
    "proj_impl": "the target's q/k/v/o projections for passes of <= 256 rows (skinny_mlp.linear_pallas)",
    "tree_impl": "the tree's best-first pops as one kernel (pallas_kernels/ddtree_frontier.py)",
    "commit_impl": "the cache commit as one kernel for all layers (pallas_kernels/row_move.py)",
}


def add_args(parser) -> None:
    for name, what in SWITCHES.items():
        parser.add_argument("--" + name.replace("_", "-"), default="xla", choices=IMPLS, help="experiment: " + what)


def chosen(args) -> dict:
    """{switch: impl} for the JSON record."""
    return {name: getattr(args, name) for name in SWITCHES}


def round_kernels(args):
    """The round's opt-in kernels that `args` asks for, for `Engine(..., round_kernels=...)`."""
    from kimijax.spec.kernels import RoundKernels

    return RoundKernels(tree=args.tree_impl, commit=args.commit_impl)


def apply(args, target):
    """A copy of `target` with the skinny kernels `args` asks for (the round's are `round_kernels(args)`)."""
    if args.mlp_impl != "xla" or args.proj_impl != "xla":
        target = dataclasses.replace(target, mlp_impl=args.mlp_impl, proj_impl=args.proj_impl)
    return target
