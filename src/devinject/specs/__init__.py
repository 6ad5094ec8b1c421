"""The spec pipeline: discovered devices -> CDI specs -> validated -> written (with generations in
directories `watch` manages)."""
