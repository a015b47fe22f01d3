"""Manifests: the YAML files that say which runs to do.

`load_manifest(path, overrides)` parses, applies `--set` overrides, substitutes `${vars}` and
validates against the schema; every problem is reported as a UserError with file:line.
"""

from caramba.manifest.loader import load_manifest, parse_manifest, resolved_manifest_yaml, resolved_run_yaml
from caramba.manifest.schema import (
    MODES,
    Defaults,
    GenerateSettings,
    Manifest,
    ModelSpec,
    ResolvedRun,
    Run,
    SpeculativeSettings,
    Target,
)

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
