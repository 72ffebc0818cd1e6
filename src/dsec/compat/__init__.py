"""The protocols users already run, translated onto DSec's own calls (no second exec or file
implementation): E2B's API and envd (``e2b``), SWE-ReX's runtime (``swerex``), SandboxFusion's
``run_code`` (``sandboxfusion``). Each has one ``add_*_routes`` the apiserver calls; see
docs/COMPAT.md."""
