"""Request bodies as JSON, with a bound on nesting depth checked before the parser runs.

Python's JSON decoder recurses once per nesting level: a few kilobytes of ``[[[[...``
reach the interpreter's recursion limit inside the parser (a RecursionError, which
would be a 500). No request pat-serve understands nests deeper than a handful of
levels, so a body nesting deeper than ``MAX_JSON_DEPTH`` is refused as a 400 first.
The depth is read from the body's brackets outside string literals, with numpy's
running sum, so even a body of nothing but brackets costs milliseconds.
"""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np

MAX_JSON_DEPTH = 64  # chat messages with tool calls nest about 6 levels

_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')  # a JSON string literal, escapes included (unrolled: fast)
_NOT_BRACKET = bytes(b for b in range(256) if b not in b"[]{}")
_STEP = np.zeros(256, dtype=np.int8)
_STEP[list(b"[{")], _STEP[list(b"]}")] = 1, -1


class BadJSON(ValueError):
    """The body is not JSON pat-serve will parse; the message says why."""


def nesting_depth(raw: bytes) -> int:
    """The deepest nesting of arrays and objects in ``raw`` (brackets inside strings do not count)."""
    brackets = _STRING.sub(b"", raw).translate(None, _NOT_BRACKET)
    opens = brackets.count(b"[") + brackets.count(b"{")
    if opens <= 1:
        return opens
    return int(np.cumsum(_STEP.take(np.frombuffer(brackets, dtype=np.uint8)), dtype=np.int64).max())


def parse_json(raw: bytes, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """``raw`` decoded, or ``BadJSON`` naming the problem (syntax, encoding, nesting)."""
    depth = nesting_depth(raw) if raw.count(b"[") + raw.count(b"{") > max_depth else 0
    if depth > max_depth:
        raise BadJSON(f"the request body nests {depth} levels deep; at most {max_depth} are accepted")
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BadJSON(f"the request body is not valid JSON: {exc}") from None
    except RecursionError:  # unreachable with the depth bound; kept so no parser recursion is ever a 500
        raise BadJSON("the request body nests too deeply") from None
