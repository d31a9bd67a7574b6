"""``python -m tests.cluster {build,images,up,down}``; see the package docstring."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tests.harness import node_stores
from tests.harness.build import NODE_BINARIES, Builder, BuildError
from tests.harness.control_plane import SERVICE_CIDR, ClusterError, default_directory, down, up
from tests.harness.images import ImageBuilder


def _progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.cluster", description=__doc__)
    parser.add_argument("command", choices=["build", "images", "up", "down"])
    parser.add_argument(
        "--dir", type=Path, default=None, help=f"cluster directory (default: {default_directory()})"
    )
    parser.add_argument("--nodes", type=int, default=3, help="fake GPU nodes (default: 3)")
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument(
        "--real-nodes",
        type=int,
        default=0,
        help="real nodes (containerd + kubelet on this machine; root; default: 0); with "
        "build: also their binaries, with images: also import the images into their stores",
    )
    parser.add_argument(
        "--service-cidr",
        default=SERVICE_CIDR,
        help=f"the Service ClusterIP range (default: {SERVICE_CIDR})",
    )
    args = parser.parse_args()
    try:
        if args.command == "build":
            print(Builder(progress=_progress).ensure(NODE_BINARIES if args.real_nodes else ()))
        elif args.command == "images":
            images = ImageBuilder(progress=_progress).ensure()
            if args.real_nodes:
                references = {image.reference: image.archive for image in images.values()}
                node_stores.prepare(args.real_nodes, references, _progress)
            for image in images.values():
                print(f"{image.reference} {image.archive}")
        elif args.command == "up":
            state = up(
                args.dir,
                nodes=args.nodes,
                gpus_per_node=args.gpus_per_node,
                real_nodes=args.real_nodes,
                service_cidr=args.service_cidr,
                progress=_progress,
            )
            print(state.kubeconfig)
        else:
            down(args.dir, progress=_progress)
    except (BuildError, ClusterError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
