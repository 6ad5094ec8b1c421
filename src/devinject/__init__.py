"""devinject: discover accelerators, write CDI specs, inject devices from an OCI hook.

This package's top level imports nothing: the OCI hook imports only what it needs.
"""

__version__ = "0.2.0"
