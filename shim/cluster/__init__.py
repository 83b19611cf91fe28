"""Image sets from the Kubernetes API: this node's sets, its Node's labels, and its status object."""
