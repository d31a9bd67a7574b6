"""The local Kubernetes harness: a real control plane, real nodes and real images, built
from their Go modules and Debian packages, for the operator's tests and for trying the
product by hand.

- :mod:`.build`: the pinned binaries (``versions.json``), built once into the cache;
- :mod:`.images`: the worker and operator images (buildah on a debootstrapped base);
- :mod:`.pki`: the certificates the components trust;
- :mod:`.control_plane`: etcd, kube-apiserver, controller-manager, scheduler, kwok fake GPU
  nodes, ``up`` and ``down``;
- :mod:`.nodes`: real nodes (containerd, runc, CNI, kubelet) beside the fake ones;
- :mod:`.babysitter`: restarts a node agent that exits and reports it.

Its own tests sit beside it (``tests/harness/test_*.py``); the command line is
``python -m tests.cluster {build,images,up,down}``, and the operator's tests that use it
are in ``tests/cluster``.
"""
