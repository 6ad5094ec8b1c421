"""The container runtimes devinject knows, named once: what `runtime configure --runtime` and `doctor --runtime`
take, and which of them `runtime configure` can turn CDI on in. Imports nothing: the CLI reads it at its start."""

RUNTIMES = ("containerd", "crio", "docker", "podman", "runc")
CONFIGURABLE = ("containerd", "crio", "docker", "podman")  # runc applies no CDI: install-hook's hook does it
