"""bench.py's sections, a module each, and what they share: the timing, the report and the settings."""
