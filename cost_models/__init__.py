"""Cost models for autoshard: hardware profiles, collective time, compute time and per-rank memory."""
