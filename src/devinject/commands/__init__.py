"""The click commands, one module per command (`devinject.cli` assembles them): click parsing and exit codes
only; the work is in the library. The options several commands share are in `options.py`, the group and
`note` in `group.py`, what the commands do alike in `common.py`."""
