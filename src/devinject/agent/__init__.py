"""The node agent: health checks, the watch loop that keeps specs true to the hardware, inventory."""
