"""AppArgs' settings read back from their declarations: each key's section, type, default and flag.

`tensorfold serve`'s flags (serve_app/cli_serve.py) and docs/config.md's table (serve_app/settings_doc.py)
are both built from these, so a field added to a section class (deployments/config.py, serve_app/args.py)
shows in the YAML's `args`, on the command line and in the docs at once.
"""

import inspect
from dataclasses import dataclass
from types import NoneType, UnionType
from typing import Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from deployments.config import Flag, Section
from serve_app.args import AppArgs

SECTIONS = (
    "model",
    "HTTP",
    "keys",
    "engine",
    "drafts",
    "store",
    "chat",
    "vision",
    "slide",
    "graph",
    "cluster",
    "routing",
    "resources",
)


@dataclass(frozen=True)
class Setting:
    """One key of the YAML's `args` (an AppArgs field), as declared."""

    key: str
    section: str
    field: FieldInfo
    flag: Flag

    @property
    def flag_name(self) -> str | None:
        """`--the-flag` (or the positional's placeholder); None where only the YAML sets it."""
        if not self.flag.exists:
            return None
        if self.flag.positional:
            return self.flag.metavar or self.key.upper()
        return self.flag.name or "--" + self.key.replace("_", "-")

    @property
    def default(self) -> Any:
        return self.field.get_default(call_default_factory=True)

    @property
    def description(self) -> str:
        return self.field.description or ""

    @property
    def options(self) -> tuple[Any, ...]:
        """The annotation's alternatives: types and literal values, None left out (it means unset)."""
        annotation = self.field.annotation
        arms = get_args(annotation) if get_origin(annotation) in (Union, UnionType) else (annotation,)
        options: list[Any] = []
        for arm in arms:
            options.extend(get_args(arm) if get_origin(arm) is Literal else [arm])
        return tuple(option for option in options if option is not NoneType)

    @property
    def choices(self) -> tuple[str, ...] | None:
        """The values allowed, where the type is a set of literal words."""
        options = self.options
        return options if all(isinstance(option, str) for option in options) else None

    def parse(self, text: str) -> Any:
        """A command-line value: one of the literal words, else the one type the annotation leaves."""
        words = [option for option in self.options if isinstance(option, str)]
        if text in words:
            return text
        (kind,) = [option for option in self.options if not isinstance(option, str)]
        return kind(text)


def type_label(setting: Setting) -> str:
    """The type as the docs name it: `int`, `list of str`, or the words allowed (`auto / int`)."""
    names = []
    for option in setting.options:
        if isinstance(option, str):
            names.append(option)
        elif get_origin(option) is list:
            names.append("list of " + " / ".join(arg.__name__ for arg in get_args(option)))
        else:
            names.append(option.__name__)
    return " / ".join(names)


def value_label(value: Any) -> str:
    """A default as the YAML spells it; None reads `unset`."""
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return format(value, "g")
    return str(value)


def settings(model: type[BaseModel] = AppArgs) -> list[Setting]:
    """Every field of `model`, section by section in SECTIONS' order, each in its class's declaration order."""
    found: list[Setting] = []
    for cls in model.__mro__:
        if not (isinstance(cls, type) and issubclass(cls, Section)):
            continue
        seen = {setting.key for setting in found}  # a field redeclared lower in the MRO is the one in force
        own = [name for name in inspect.get_annotations(cls) if name in model.model_fields]
        if own and cls.__dict__.get("SECTION") not in SECTIONS:
            raise TypeError(f"{cls.__name__} declares settings but no SECTION among {SECTIONS}")
        for name in own:
            if name not in seen:
                field = model.model_fields[name]
                found.append(Setting(name, cls.SECTION, field, _flag_of(field)))
    missing = set(model.model_fields) - {setting.key for setting in found}
    if missing:
        raise TypeError(f"{model.__name__} fields outside any section: {sorted(missing)}")
    return sorted(found, key=lambda setting: SECTIONS.index(setting.section))


def _flag_of(field: FieldInfo) -> Flag:
    return next((marker for marker in field.metadata if isinstance(marker, Flag)), Flag())
