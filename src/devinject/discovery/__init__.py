"""Discovery: the host's own view of its accelerators (sysfs, procfs, ld.so.cache) under a root,
and the device families (profiles) that say what to look for."""
