"""Where things live by default. A module of constants, so that reading one loads nothing else."""

DEFAULT_SPEC_DIRS = ("/etc/cdi", "/var/run/cdi")  # CDI's own defaults, in priority order (later wins)
