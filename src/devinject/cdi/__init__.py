"""The CDI model and its codec: specs, their version table, value rules and names."""
