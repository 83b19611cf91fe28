"""``cri-shim controller``: the cluster component that writes each ImageSet's rollout truth."""
