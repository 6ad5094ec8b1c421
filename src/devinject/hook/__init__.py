"""The OCI hook side of devinject: lean imports only (core, hook, nodestate; no click, yaml, pynvml)."""
