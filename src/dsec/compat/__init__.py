"""The protocols users already run, translated onto DSec's own calls (no second exec or file
implementation): SWE-ReX's runtime (``swerex``), SandboxFusion's ``run_code``
(``sandboxfusion``). Each module has one ``add_*_routes`` the apiserver calls; see
docs/COMPAT.md."""
