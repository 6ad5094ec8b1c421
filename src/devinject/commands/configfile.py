"""`--config FILE` of the Kubernetes agents: option values from a YAML file."""

from __future__ import annotations

from typing import Any

import click

from devinject.core.errors import UsageError


class ConfigFileError(UsageError):
    """A --config file that cannot be used: a usage error (exit 2, as click's), said in one line."""


def _load_config(ctx: click.Context, _param: click.Parameter, path: str | None) -> str | None:
    """`--config FILE`: a YAML mapping of this command's option names (without dashes) to values, read before
    the other options, which win over it. Unknown names are an error, not silently ignored."""
    if path is None:
        return None
    import yaml

    try:
        with open(path, "rb") as handle:  # bytes: PyYAML decodes, and marks where a file is not UTF-8
            data = yaml.safe_load(handle) or {}
    except OSError as err:
        raise ConfigFileError(f"{path}: {err.strerror or err}") from None
    except yaml.YAMLError as err:
        from devinject.discovery.profiles import yaml_problem

        raise ConfigFileError(yaml_problem(path, err)) from None
    if not isinstance(data, dict):
        raise ConfigFileError(f"{path}: expected a mapping of option names to values")
    known = {p.name: p for p in ctx.command.params if isinstance(p, click.Option) and p.name}
    names = {opt.lstrip("-").replace("-", "_"): p.name for p in known.values() for opt in p.opts if p.name}
    defaults: dict[str, Any] = {}
    given: dict[str, object] = {}  # option -> the key that gave it: an old spelling beside the new is one too many
    for key, value in data.items():
        if ctx.command.name == "device-plugin" and key in ("sharing", "version"):
            _sharing_section(ctx, path, str(key), value)  # NVIDIA's device plugin's shape, carried over
            continue
        name = names.get(str(key).replace("-", "_"))
        if name is None or name == "config":
            raise ConfigFileError(f"{path}: unknown option {key!r}")
        if name in given:
            raise ConfigFileError(f"{path}: {key}: the same option as {given[name]}, given twice")
        given[name] = key
        defaults[name] = list(value) if known[name].multiple and isinstance(value, list) else value
        try:  # checked here, where the file can be named (click would blame the option)
            known[name].type_cast_value(ctx, defaults[name])
        except click.BadParameter as err:
            raise ConfigFileError(f"{path}: {key}: {err.message}") from None
    ctx.default_map = {**(ctx.default_map or {}), **defaults}
    return path


def _sharing_section(ctx: click.Context, path: str, key: str, value: object) -> None:
    """The device plugin's config: `sharing:` (time-slicing, docs/sharing.md) and NVIDIA's `version: v1`."""
    if key == "version":
        if value != "v1":
            raise ConfigFileError(f"{path}: version: expected v1 (the version of NVIDIA's config shape), got {value!r}")
        return
    from devinject.deviceplugin.sharing import SharingConfigError, parse_sharing

    try:
        ctx.meta["devinject.sharing"] = parse_sharing(value, path)
    except SharingConfigError as err:
        raise ConfigFileError(err.message) from None
