"""The container runtimes' own configuration: whether each applies CDI and reads the spec dirs (read), and the
drop-in that turns it on (`devinject runtime configure`)."""
