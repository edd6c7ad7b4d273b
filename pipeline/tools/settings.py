"""Every registered setting with its default and help, read from the dataclasses that declare them
(pipeline/settings.py): `python -m pipeline.tools settings [tool.group=distill]`."""
from __future__ import annotations

from dataclasses import dataclass

from omegaconf import OmegaConf

from pipeline.errors import PipelineError
from pipeline.settings import help_lines, register, setting


@dataclass(frozen=True)
class SettingsToolSettings:
    """settings: every setting's default and help, from the dataclasses that declare them."""
    group: str | None = setting(None, "one group (e.g. distill, model/_base, tools/gpu-check); null = every group")


register("tools", SettingsToolSettings, name="settings", package="tool")


def registered() -> dict[str, type]:
    """`group/option` -> its settings dataclass, for every structured config registered."""
    import importlib

    from hydra.core.config_store import ConfigStore

    from pipeline.tools.__main__ import SUBCOMMANDS

    for module in SUBCOMMANDS.values():  # each tool's module registers its settings
        importlib.import_module(module)
    found = {}
    for group, options in ConfigStore.instance().repo.items():
        if group == "hydra":  # Hydra's own
            continue
        for option, entry in options.items() if isinstance(options, dict) else ():
            if hasattr(entry, "node") and OmegaConf.get_type(entry.node) is not None:
                found[f"{group}/{option.removesuffix('.yaml')}"] = OmegaConf.get_type(entry.node)
    return dict(sorted(found.items()))


def run(cfg) -> dict:
    groups = registered()
    wanted = cfg.tool.group
    names = [name for name in groups if wanted in (None, name, name.removesuffix("/default"))]
    if not names:
        raise PipelineError(f"tool.group={wanted!r} is no registered group: use one of "
                            f"{', '.join(n.removesuffix('/default') for n in groups)}")
    for name in names:
        prefix = name.removesuffix("/default").removeprefix("tools/").replace("/", ".")
        prefix = "tool." if name.startswith("tools/") else "model." if name == "model/_base" else prefix + "."
        print(f"# {name}\n" + "\n".join(help_lines(groups[name], prefix)) + "\n")
    return {"groups": names}
