"""The operator, chart and worker images tested against a real control plane
(:mod:`tests.harness`), and the harness's command line:

python -m tests.cluster build   # build the binaries into the cache (idempotent)
                                # (--real-nodes N: also the kubelet, kube-proxy, CoreDNS)
python -m tests.cluster images  # build the worker and operator images (buildah; cached)
                                # (--real-nodes N: also import them into N node stores)
python -m tests.cluster up      # start it; prints the kubeconfig path
                                # (--real-nodes N: also N kubelets with containerd, root)
python -m tests.cluster down    # stop it; leaves no process behind
"""
