"""The chaos suite (``irisfed chaos``): seeded faults, then DESIGN.md §6 checks."""
