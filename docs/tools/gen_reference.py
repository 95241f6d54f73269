"""Generate the reference pages of the docs site from the code:

- docs/configuration.md: every ``COHORT_*`` variable of ``cohort.settings.Settings`` (groups as
  ``COHORT_<GROUP>__<KNOB>``), with its type, default and description;
- docs/api.md: the HTTP API from the FastAPI app's OpenAPI document (``gateway.app.create_app``).

Run: ``.venv/bin/python docs/tools/gen_reference.py`` (tests/ops/test_docs.py fails when the pages are stale).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def _cell(text: object) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _type(annotation: object) -> str:
    name = getattr(annotation, "__name__", None) or str(annotation)
    return name.replace("typing.", "").replace("pathlib.", "")


def settings_variables() -> list[tuple[str, str, str, str]]:
    """(variable, type, default, description) for every setting, groups flattened."""
    from pydantic import BaseModel

    from cohort.settings import Settings
    out = []
    for name, field in Settings.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            for knob, sub in ann.model_fields.items():
                out.append((f"COHORT_{name.upper()}__{knob.upper()}", _type(sub.annotation), repr(sub.default),
                            sub.description or ""))
        else:
            default = "(computed)" if name == "shared_dir" else repr(field.default)
            out.append((f"COHORT_{name.upper()}", _type(ann), default, field.description or ""))
    return out


def configuration_page() -> str:
    lines = ["# Configuration", "",
             "Every setting is an environment variable (or a line of a `.env` file in the working directory).",
             "Tuning knobs sit in groups read as `COHORT_<GROUP>__<KNOB>`; their old flat names still work and log",
             "once that they moved. This page is generated from `cohort/settings.py` by",
             "`.venv/bin/python docs/tools/gen_reference.py`.", "",
             "| variable | type | default | meaning |", "| --- | --- | --- | --- |"]
    for var, typ, default, desc in settings_variables():
        lines.append(f"| `{var}` | {_cell(typ)} | `{_cell(default)}` | {_cell(desc)} |")
    return "\n".join(lines) + "\n"


def openapi() -> dict:
    from cohort.settings import Settings
    from gateway.app import create_app
    with tempfile.TemporaryDirectory() as tmp:
        app = create_app(Settings(data_dir=Path(tmp), database_url=f"sqlite:///{tmp}/log.db"))
        return app.openapi()


def api_page() -> str:
    doc = openapi()
    lines = ["# API", "",
             "The gateway's HTTP API: OpenAI-compatible `/v1/completions`, `/v1/chat/completions`, `/v1/models`,",
             "the Files and Batch APIs, cohort's own `/v1/generate`, and `/health` and `/metrics`. Any OpenAI",
             "client works with `base_url=http://HOST:8000/v1`. The live document is at `/openapi.json`;",
             "`/admin/openapi.json` (admin token) adds the admin endpoints. This page is generated from it by",
             "`.venv/bin/python docs/tools/gen_reference.py`; behaviour of each OpenAI field: [Parameters](parameters.md).",
             ""]
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            lines += [f"## `{method.upper()} {path}`", ""]
            if op.get("summary"):
                lines += [op["summary"], ""]
            if op.get("description"):
                lines += [op["description"].strip(), ""]
            body = op.get("requestBody", {}).get("content", {})
            for ctype, media in body.items():
                ref = media.get("schema", {}).get("$ref", "")
                if ref:
                    lines += [f"Body ({ctype}): `{ref.rsplit('/', 1)[-1]}`", ""]
            lines += ["Responses:", ""]
            lines += [f"- {code}: {_cell(r.get('description', ''))}" for code, r in op.get("responses", {}).items()]
            lines.append("")
    schemas = doc.get("components", {}).get("schemas", {})
    if schemas:
        lines += ["## Schemas", ""]
        for name, schema in schemas.items():
            props = schema.get("properties", {})
            if not props:
                continue
            lines += [f"### `{name}`", "", "| field | type | description |", "| --- | --- | --- |"]
            for field, p in props.items():
                typ = p.get("type") or " / ".join(x.get("type", x.get("$ref", "").rsplit("/", 1)[-1])
                                                  for x in p.get("anyOf", [])) or p.get("$ref", "").rsplit("/", 1)[-1]
                lines.append(f"| `{field}` | {_cell(typ)} | {_cell(p.get('description', ''))} |")
            lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def main() -> None:
    (ROOT / "docs" / "configuration.md").write_text(configuration_page())
    (ROOT / "docs" / "api.md").write_text(api_page())


if __name__ == "__main__":
    main()
