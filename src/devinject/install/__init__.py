"""What devinject installs on a host: hooks.d files, the runc snippet, the hook server's
systemd unit, the node hook bundle."""
