"""Write docs/config.md, the reference of every ``megatron-quads train`` config key, from the schema.

    python tools/config_reference.py [--check]

``--check`` exits 1 when docs/config.md is out of date (a test runs it), so the reference cannot
drift from ``megatron_quads.controller.config.RunConfig``.
"""

from __future__ import annotations

import argparse
import sys
import typing
from pathlib import Path

from pydantic import BaseModel

from megatron_quads.controller.config import RunConfig

OUT = Path(__file__).parents[1] / "docs" / "config.md"
HEADER = """# Config reference

`megatron-quads train CONFIG [key=value ...]`: a YAML file merged with dotted overrides, validated
before any worker starts (unknown keys and impossible layouts are errors that name the key). Generated
by `python tools/config_reference.py` from `megatron_quads/controller/config.py`; examples in
`examples/*.yaml`.

| key | type | default | meaning |
|---|---|---|---|
"""


def _model_type(annotation) -> type[BaseModel] | None:
    for candidate in (annotation, *typing.get_args(annotation)):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def _type_name(annotation) -> str:
    text = getattr(annotation, "__name__", None) if not typing.get_args(annotation) else None
    return (text or str(annotation).replace("typing.", "")).replace("|", "\\|")


def rows(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Markdown table rows for ``model``'s fields, nested sections flattened to dotted keys."""
    out = []
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        nested = _model_type(field.annotation)
        doc = (field.description or "").replace("|", "\\|")
        if nested is not None and nested is not RunConfig:
            section = (nested.__doc__ or "").strip().splitlines()[0] if nested.__doc__ else ""
            out.append(f"| `{key}` | section | | {doc or section} |")
            out.extend(rows(nested, key + "."))
            continue
        default = "required" if field.is_required() else repr(field.get_default(call_default_factory=True))
        out.append(f"| `{key}` | {_type_name(field.annotation)} | `{default}` | {doc} |")
    return out


def render() -> str:
    """The whole reference page."""
    return HEADER + "\n".join(rows(RunConfig)) + "\n"


def main() -> int:
    """Write (or check) docs/config.md."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()
    text = render()
    if args.check:
        if not OUT.exists() or OUT.read_text() != text:
            print(f"{OUT} is out of date: run python tools/config_reference.py", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
