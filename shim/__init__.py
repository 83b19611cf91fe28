"""cri-shim: a CRI proxy for image pulls."""
