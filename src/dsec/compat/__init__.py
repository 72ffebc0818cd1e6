"""The protocols users already run, each a thin translation onto DSec's own calls (docs/COMPAT.md)."""
