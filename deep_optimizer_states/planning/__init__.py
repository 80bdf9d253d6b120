"""Planning: the performance model, calibration, refinement from telemetry, and the current plan."""
