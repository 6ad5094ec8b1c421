"""The Linux toolkit: the C library, the mount table, device cgroups, the linker cache, ELF
headers, trusted dirs and locks."""
