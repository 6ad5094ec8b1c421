"""Node-local state shared by the hook and the agent: the device ledger, events, sharing policy,
and the live evidence a lost ledger is rebuilt from."""
