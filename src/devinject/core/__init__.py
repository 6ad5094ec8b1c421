"""The shared core: the CDI model and codec, names, errors, small helpers. Imported by everything,
including the hook, so it stays lean (no click, yaml at import, typing at run time)."""
