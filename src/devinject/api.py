"""The library's one way in: a `LiveNode` made from the roots a command was pointed at (host root, target root,
profile dirs, state dir, kernel log), checked once, its profiles loaded and its devices discovered once, that
answers what the commands show: `devices()`, `channels()` (IMEX channels: char nodes, no PCI function),
`topology()`, `health()`, `specs(options)`, `holders()`, `inventory()`, `events()`, `find()`,
`dev_char_links()`. Every answer is a list of result records (or the Topology), each with its `to_json()` in the
vocabulary of docs/json.md.

Discovery's half of it is `devinject.discovery.node.Node` (what the layers below the agent take: discovery,
nodestate, specs: the devices found); `LiveNode` adds what needs the layers above, the node's live state
(health, specs, the ledger). `Node` is the name it had, kept for scripts that import it: deprecated. It sits
at the top beside the commands (docs/architecture.md), so that each command is parse, call, render.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from devinject.agent.health import PROBE_TIMEOUT
from devinject.core.paths import DEFAULT_STATE_DIR
from devinject.discovery import node as discovery_node
from devinject.results import Event

if TYPE_CHECKING:
    from devinject.cdi.model import Spec
    from devinject.results import DeviceHealth, DeviceRecord, HeldNode
    from devinject.specs.generate import GenerateOptions

class LiveNode(discovery_node.Node):
    """A node, as every command reads it: its devices (discovery/node.py: the roots and their checks) and
    their live state."""

    def health(self, *, timeout: float = PROBE_TIMEOUT) -> list[DeviceHealth]:
        """Every device's verdict, bound to its driver or not (an unbound one by its key)."""
        from devinject.inventory import device_health

        return device_health(self, timeout=timeout)

    def inventory(self) -> list[DeviceRecord]:
        """Every discovered device with its health, the containers the ledger booked it for, its pairs."""
        from devinject.inventory import inventory

        return inventory(self)

    def holders(self, device: str | None = None) -> list[HeldNode]:
        """Processes holding a node of the devices (those `device` names) open, with their containers."""
        from devinject.inventory import holders

        return holders(self, device)

    def specs(self, options: GenerateOptions) -> list[Spec]:
        """The CDI specs `generate` writes for this node: `options` with the node's roots, for the node's
        profiles and devices (generate_specs reads the options' profile dirs only when it is given no node)."""
        from devinject.specs.generate import generate_specs

        options = replace(options, root=self.root, target_root=self.target_root)
        return generate_specs(options, node=self)

    def events(self, device: str | None = None) -> list[Event]:
        """The state dir's last transitions per device (all, or those of the device `device` names: its key as
        filed, else any name discovery/resolve.py reads on this node), by device then time."""
        from devinject.nodestate.events import device_history

        state_dir = self.state_dir or DEFAULT_STATE_DIR
        history = device_history(state_dir)
        if device is not None:
            from devinject.discovery.resolve import resolve

            keys = {device} if device in history else set(resolve(self, device).keys)
            history = {key: entries for key, entries in history.items() if key in keys}
        return [Event.of(key, entry) for key, entries in sorted(history.items()) for entry in entries]

    def dev_char_links(self) -> list[tuple[str, str]]:
        """(link, relative target) for each discovered node that has no /dev/char/MAJ:MIN link."""
        from devinject.discovery.devchar import missing_links

        return missing_links(self)


Node = LiveNode  # deprecated: the name LiveNode had (it read as discovery.node.Node, its base)
