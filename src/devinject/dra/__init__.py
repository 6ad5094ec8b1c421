"""The DRA kubelet plugin (resource.k8s.io/v1, structured parameters): ResourceSlices from discovery, claims
prepared as claim-scoped CDI specs (docs/dra.md)."""
