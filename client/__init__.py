"""moe-sidecar client: the library inside each inference rank."""
