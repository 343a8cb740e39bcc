"""What a request asks its output to follow: a JSON schema, any JSON object, a regex, one of
several strings, or a grammar. A plain value (no grammar engine needed to hold one), hashable,
so equal requests share one compiled grammar."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

StructuredOutputKind = Literal["json", "json_object", "regex", "choice", "grammar"]


@dataclass(frozen=True)
class StructuredOutputSpec:
    kind: StructuredOutputKind
    # json: the schema as canonical JSON text; choice: the choices as a JSON list; regex and
    # grammar: their text; json_object: empty.
    value: str = ""
    # The request field it came from, named by errors about it.
    param: str = field(default="structured_outputs", compare=False)

    @classmethod
    def json_schema(cls, schema: dict[str, Any], param: str) -> StructuredOutputSpec:
        # Not sorted: the order of properties is the order the output writes them in.
        return cls("json", json.dumps(schema, ensure_ascii=False), param)

    @classmethod
    def json_object(cls, param: str) -> StructuredOutputSpec:
        return cls("json_object", "", param)

    @classmethod
    def regex(cls, pattern: str, param: str) -> StructuredOutputSpec:
        return cls("regex", pattern, param)

    @classmethod
    def choice(cls, choices: list[str], param: str) -> StructuredOutputSpec:
        return cls("choice", json.dumps(choices, ensure_ascii=False), param)

    @classmethod
    def grammar(cls, text: str, param: str) -> StructuredOutputSpec:
        return cls("grammar", text, param)
