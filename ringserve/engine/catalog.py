"""The models a server knows (placeholder: the ``[model]`` table's model and the presets)."""

from __future__ import annotations

import fnmatch
from pathlib import Path

import attrs

from ringserve.config import Config, ModelSettings
from ringserve.engine.modelfile import default_model_path


@attrs.frozen
class CatalogEntry:
    """A model: its name and settings (``settings.model.path`` its file)."""

    name: str
    settings: ModelSettings


@attrs.frozen
class Catalog:
    """The models, and which one a request's name reaches."""

    entries: tuple[CatalogEntry, ...]
    default: str | None = None
    strict: bool = False

    def resolve(self, requested: str) -> CatalogEntry | None:
        """The model ``requested`` names: a name, an alias, an alias pattern, else the default."""
        by_name = {e.name: e for e in self.entries}
        if requested in by_name:
            return by_name[requested]
        for entry in self.entries:
            if requested in entry.settings.model.aliases:
                return entry
        for entry in self.entries:
            if any(fnmatch.fnmatchcase(requested, p) for p in entry.settings.model.aliases):
                return entry
        if self.default is None or (self.strict and requested):
            return None
        return by_name[self.default]

    def names(self) -> list[str]:
        return sorted(e.name for e in self.entries)


def discover(config: Config) -> Catalog:
    """The ``[model]`` table's model (the bundled one without a path) and the presets."""
    entries = []
    for name in config.models:
        preset = config.preset(name)
        settings = attrs.evolve(preset, model=attrs.evolve(preset.model, name=preset.model.name or name))
        entries.append(CatalogEntry(settings.model.name, settings))
    model = config.model
    default = None
    if model.path or not entries:
        path = Path(model.path) if model.path else default_model_path()
        name = model.name or path.stem
        startup = model.load_on_startup is not False
        settings = attrs.evolve(config.settings,
                                model=attrs.evolve(model, path=str(path), name=name, load_on_startup=startup))
        entries.insert(0, CatalogEntry(name, settings))
        default = name
    default = config.router.default_model or default
    return Catalog(tuple(entries), default, config.router.strict_model_name)
