"""Resource manager: per-scope pod pools. No HTTP routes; reached only through ``facade``."""
