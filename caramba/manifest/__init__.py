"""Manifests: the YAML files that say which runs to do.

`load_manifest(path, overrides)` parses, applies `--set` overrides, substitutes `${vars}` and
validates against the schema; every problem is reported as a UserError with file:line.
`Manifest`, `Run`, `Target` and `MODES` follow the registry of modes (caramba.manifest.schema).
"""

from typing import Any

from caramba.manifest import schema
from caramba.manifest.loader import load_manifest, parse_manifest, resolved_manifest_yaml, resolved_run_yaml
from caramba.manifest.schema import Defaults, GenerateSettings, ModelSpec, ResolvedRun, SpeculativeSettings


def __getattr__(name: str) -> Any:
    """Manifest, Run, Target and MODES as the registry of modes stands now (see caramba.manifest.schema)."""
    if name in ("MODES", "Manifest", "Run", "Target"):
        return getattr(schema, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "MODES",
    "Defaults",
    "GenerateSettings",
    "Manifest",
    "ModelSpec",
    "ResolvedRun",
    "Run",
    "SpeculativeSettings",
    "Target",
    "load_manifest",
    "parse_manifest",
    "resolved_manifest_yaml",
    "resolved_run_yaml",
]
