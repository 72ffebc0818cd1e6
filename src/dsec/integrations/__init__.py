"""DSec as a provider for the harnesses people run."""
