"""``cri-shim controller``: the cluster component that writes each ImageSet's truth and paces its rollout."""
