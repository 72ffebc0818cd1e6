"""DSec as a provider for the agent harnesses people already run: each module plugs DSec's
sandboxes into one harness through that harness's own extension point (its environment or
sandbox class), so a harness's config, not its code, selects DSec. ``minisweagent``:
mini-swe-agent's ``Environment``; ``inspect``: Inspect's sandbox environment ``dsec``. See
docs/INTEGRATIONS.md."""
