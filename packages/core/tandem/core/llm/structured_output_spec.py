"""What a request asks its output to follow: a JSON schema, any JSON object, a regex, one of
several strings, or a grammar. A plain value (no grammar engine needed to hold one), hashable,
so equal requests share one compiled grammar."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from tandem.core.errors import InvalidRequestError

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
        try:
            return cls("json", json.dumps(schema, ensure_ascii=False), param)
        except RecursionError:
            raise InvalidRequestError(
                "the JSON schema nests too deeply to be read", param=param
            ) from None

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


_STRING_OR_BRACKET = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}]')


def json_depth(text: str) -> int:
    """How deeply objects and arrays nest in the JSON text ``text`` (0 for a scalar), read
    without parsing it, so any depth is measured (a parser would recurse, once per level).
    Text that is not JSON gets some number; parsing it fails later."""
    depth = deepest = 0
    for match in _STRING_OR_BRACKET.finditer(text):
        token = match.group()
        if token in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif token in "]}":
            depth -= 1
    return deepest
