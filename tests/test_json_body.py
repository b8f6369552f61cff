"""Request bodies: nesting is bounded before the recursive JSON parser runs (no RecursionError, no 500)."""

from __future__ import annotations

import json

import pytest

from pat_engine.serve.json_body import MAX_JSON_DEPTH, BadJSON, nesting_depth, parse_json


@pytest.mark.parametrize("text, depth", [
    ("1", 0), ("[]", 1), ('{"a": [1, [2]]}', 3), ('["[[[[", "]]"]', 1), (r'["\"[[[", {"k": "\\"}]', 2),
    ("[" * 70 + "]" * 70, 70),
])
def test_nesting_depth_ignores_brackets_inside_strings(text, depth):
    assert nesting_depth(text.encode()) == depth


def test_deep_bodies_are_refused_and_shallow_ones_parse():
    for raw in (b"[" * 100_000, b'{"a":' * 5000, ("[" * (MAX_JSON_DEPTH + 1) + "]" * (MAX_JSON_DEPTH + 1)).encode()):
        with pytest.raises(BadJSON, match="levels deep"):
            parse_json(raw)
    ok = {"messages": [{"role": "user", "content": "[[[[" * 1000}], "stop": ["]]"]}
    assert parse_json(json.dumps(ok).encode()) == ok
    with pytest.raises(BadJSON, match="not valid JSON"):
        parse_json(b'{"a": ')
