"""The OCI hook side of devinject: lean imports only (no click, jsonschema, pynvml, pyroute2)."""
