"""The distributed runtime: CompNodes, coordinator, transport, inbox, schedules, link emulation, checkpoints."""
