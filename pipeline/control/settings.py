"""What every stage's typed settings share: the check that a composed config group holds exactly the keys its
conf/ file declares (each stage's frozen settings type then validates the values, TRL's `XConfig` pattern)."""
from __future__ import annotations

from pipeline.errors import PipelineError


def check_keys(values: dict, names: list[str], where: str, conf_file: str) -> None:
    """One-line errors for keys of `values` (the group at `where`, e.g. calibrate) that `names` does
    not declare, and for declared names the group lacks."""
    unknown = [key for key in values if key not in names]
    if unknown:
        raise PipelineError(f"unknown setting(s) {', '.join(f'{where}.{key}' for key in unknown)}: use the keys of "
                            f"{conf_file} (check the spelling of the override)")
    missing = [key for key in names if key not in values]
    if missing:
        raise PipelineError(f"setting(s) {', '.join(f'{where}.{key}' for key in missing)} missing from the composed "
                            f"config: restore them in {conf_file}, where every setting is declared")
