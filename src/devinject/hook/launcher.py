"""The hook's launcher: `python3 -IS <this file> hook ...` (what `devinject install-hook` writes). Isolated
(-I) and without `site` (-S), the interpreter starts ~3 ms sooner on every container start. The package is
found from this file's own location (a wheel install and a source checkout alike). Kept this small: a script
is compiled on every run, a module's bytecode is cached; the work is in entry.py (`launch`)."""

import sys

sys.path.insert(0, __file__.rsplit("/", 3)[0])
from devinject.entry import launch

launch(sys.argv[1:])
