"""What a JSON Schema may cost the grammar engine, checked before it sees it.

llguidance compiles a schema recursively (a long ``$ref`` chain overflows the
native stack: SIGSEGV, which no ``except`` catches) and some shapes compile
super-linearly (hundreds of ``patternProperties``), so every schema is walked
here first, iteratively and in time linear in its size, and refused with a
message naming the limit it passes. The limits sit far above what real
schemas use and far below where the engine stalls or crashes
(docs/structured-output.md, "Limits").
"""

from __future__ import annotations

import re
from typing import Any, Iterator, Optional
from urllib.parse import unquote, urldefrag, urljoin

MAX_VALUES = 150_000  # JSON values in the schema (256 KiB holds at most ~130,000): the walk stays short
MAX_NESTING = 100  # JSON containers inside one another (the engine's own parser stops at 128)
MAX_DEPTH = 40  # subschemas inside one another, following $ref (a chain of ~1,500 crashes the engine)
MAX_SUBSCHEMAS = 5_000  # subschemas in all
MAX_PROPERTIES = 1_000  # 'properties' entries in all
MAX_PATTERN_PROPERTIES = 64  # 'patternProperties' entries in all (200: seconds, 500: ~40 s)
MAX_PATTERNS = 256  # regular expressions in all ('pattern', 'patternProperties', 'propertyNames')
MAX_PATTERN_CHARS = 1_000  # characters of one regular expression
MAX_REGEX_SIZE = 10_000  # one regular expression unrolled: 'a{100}' is 100, '(a{1000}){1000}' 1,000,000
MAX_ENUM_VALUES = 2_000  # 'enum' values and 'const's in all

# keyword -> how it holds subschemas; the second item: whether the keyword
# produces its own JSON text (a cycle through only non-producing keywords,
# such as {"$ref": "#"}, describes no JSON at all).
_ONE, _LIST, _MAP = "one", "list", "map"
_SUBSCHEMAS = {
    "items": (_ONE, True), "additionalItems": (_ONE, True), "unevaluatedItems": (_ONE, True),
    "contains": (_ONE, True), "additionalProperties": (_ONE, True), "unevaluatedProperties": (_ONE, True),
    "propertyNames": (_ONE, True), "prefixItems": (_LIST, True), "properties": (_MAP, True),
    "patternProperties": (_MAP, True), "dependentSchemas": (_MAP, False),
    "anyOf": (_LIST, False), "oneOf": (_LIST, False), "allOf": (_LIST, False),
    "not": (_ONE, False), "if": (_ONE, False), "then": (_ONE, False), "else": (_ONE, False),
}
_DEFINITIONS = ("$defs", "definitions")
_COUNTED = re.compile(r"\{(\d*)(?:,(\d*))?\}")


def schema_problem(schema: Any) -> Optional[str]:
    """Why ``schema`` is refused (the limit it passes, in a short sentence), or None."""
    return _nesting(schema) or _Walk(schema).problem()


def _nesting(value: Any) -> Optional[str]:
    stack, seen = [(value, 1)], 1
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            if depth > MAX_NESTING:
                return f"nests JSON more than {MAX_NESTING} levels deep (limit {MAX_NESTING})"
            seen += len(item)
            if seen > MAX_VALUES:
                return f"has more than {MAX_VALUES} JSON values (limit {MAX_VALUES})"
            stack.extend((v, depth + 1) for v in (item.values() if isinstance(item, dict) else item))
    return None


def _children(node: dict) -> Iterator[tuple[str, Any, bool]]:
    """(JSON pointer step, subschema, whether the keyword produces JSON text) of ``node``."""
    for key, (shape, produces) in _SUBSCHEMAS.items():
        value = node.get(key)
        if shape == _ONE or (key == "items" and isinstance(value, list)):
            if isinstance(value, list):
                yield from ((f"{key}/{i}", v, produces) for i, v in enumerate(value))
            else:
                yield key, value, produces
        elif shape == _LIST and isinstance(value, list):
            yield from ((f"{key}/{i}", v, produces) for i, v in enumerate(value))
        elif shape == _MAP and isinstance(value, dict):
            yield from ((f"{key}/{_escape(k)}", v, produces) for k, v in value.items())


def _escape(key: str) -> str:
    return str(key).replace("~", "~0").replace("/", "~1")


class _Refused(Exception):
    pass


class _Walk:
    """Every subschema reachable from the root, its definitions or a $ref, counted."""

    def __init__(self, root: Any):
        self.root = root
        self.where: dict[int, str] = {}  # id(subschema) -> its JSON pointer (or the $ref that reached it)
        self.base: dict[int, str] = {}  # id(subschema) -> the URI its $refs resolve against
        self.resources: dict[str, dict] = {}  # $id (no fragment) -> subschema; "" is the root
        self.anchors: dict[str, dict] = {}  # "$id#anchor" -> subschema
        self.nodes: list[dict] = []
        self.counts = {"properties": 0, "patternProperties": 0, "patterns": 0, "enum": 0}

    def problem(self) -> Optional[str]:
        if isinstance(self.root, dict):
            self.resources[""] = self.root
        try:
            return self._collect("#", self.root, "") or self._depth()
        except _Refused as exc:
            return str(exc)

    # -- every subschema, and what it holds ------------------------------------
    def _collect(self, pointer: str, start: Any, base: str) -> Optional[str]:
        stack = [(pointer, start, base)]
        while stack:
            pointer, node, base = stack.pop()
            if not isinstance(node, dict) or id(node) in self.where:
                continue
            if isinstance(node.get("$id"), str):
                url, fragment = urldefrag(urljoin(base, node["$id"]))
                if url != base or not fragment:
                    base = url
                    self.resources.setdefault(url, node)
                if fragment:
                    self.anchors.setdefault(f"{url}#{fragment}", node)
            for key in ("$anchor", "$dynamicAnchor"):
                if isinstance(node.get(key), str):
                    self.anchors.setdefault(f"{base}#{node[key]}", node)
            self.where[id(node)] = pointer
            self.base[id(node)] = base
            self.nodes.append(node)
            if len(self.nodes) > MAX_SUBSCHEMAS:
                return f"has more than {MAX_SUBSCHEMAS} subschemas (limit {MAX_SUBSCHEMAS})"
            problem = self._count(node, pointer)
            if problem:
                return problem
            for step, child, _ in _children(node):
                stack.append((f"{pointer}/{step}", child, base))
            for key in _DEFINITIONS:
                if isinstance(node.get(key), dict):
                    stack.extend((f"{pointer}/{key}/{_escape(k)}", v, base) for k, v in node[key].items())
        return None

    def _count(self, node: dict, pointer: str) -> Optional[str]:
        counts = self.counts
        regexes = []
        if isinstance(node.get("properties"), dict):
            counts["properties"] += len(node["properties"])
        if isinstance(node.get("patternProperties"), dict):
            counts["patternProperties"] += len(node["patternProperties"])
            regexes += [(f"{pointer}/patternProperties", k) for k in node["patternProperties"]]
        if isinstance(node.get("pattern"), str):
            regexes.append((f"{pointer}/pattern", node["pattern"]))
        if isinstance(node.get("enum"), list):
            counts["enum"] += len(node["enum"])
        if "const" in node:
            counts["enum"] += 1
        counts["patterns"] += len(regexes)
        for name, limit, what in (("properties", MAX_PROPERTIES, "'properties' entries"),
                                  ("patternProperties", MAX_PATTERN_PROPERTIES, "'patternProperties' entries"),
                                  ("patterns", MAX_PATTERNS, "regular expressions"),
                                  ("enum", MAX_ENUM_VALUES, "'enum'/'const' values")):
            if counts[name] > limit:
                return f"has more than {limit} {what} (limit {limit})"
        for where, regex in regexes:
            if len(regex) > MAX_PATTERN_CHARS:
                return f"{where}: a regular expression of {len(regex)} characters (limit {MAX_PATTERN_CHARS})"
            size = regex_size(regex)
            if size > MAX_REGEX_SIZE:
                return (f"{where}: the regular expression repeats to a size of {size} "
                        f"(limit {MAX_REGEX_SIZE})")
        return None

    # -- depth through $ref, and cycles that produce no JSON ---------------------
    def _edges(self, node: dict) -> Iterator[tuple[dict, bool]]:
        for _, child, produces in _children(node):
            if isinstance(child, dict):
                yield child, produces
        target = self._resolve(node.get("$ref"), node) if "$ref" in node else None
        if target is not None:
            yield target, False

    def _resolve(self, ref: Any, node: dict) -> Optional[dict]:
        """The subschema ``node``'s ``$ref`` names ($id, $anchor, JSON pointer);
        a reference to nothing in the schema is refused (the engine follows none
        outside it)."""
        if not isinstance(ref, str):
            return None
        url, fragment = urldefrag(urljoin(self.base.get(id(node), ""), ref))
        target: Any = self.resources.get(url)
        if target is not None and fragment.startswith("/"):
            for part in unquote(fragment).split("/")[1:]:
                part = part.replace("~1", "/").replace("~0", "~")
                if isinstance(target, dict) and part in target:
                    target = target[part]
                elif isinstance(target, list) and part.isdigit() and int(part) < len(target):
                    target = target[int(part)]
                else:
                    target = None
                    break
        elif target is not None and fragment:
            target = self.anchors.get(f"{url}#{fragment}")
        if not isinstance(target, dict):
            raise _Refused(f"$ref {ref[:100]!r} names nothing in the schema (at {self.where[id(node)]})")
        if id(target) not in self.where:  # a subschema under a keyword dlm does not walk: count it too
            problem = self._collect(ref[:100], target, url)
            if problem:
                raise _Refused(problem)
        return target

    def _depth(self) -> Optional[str]:
        """The longest path of subschemas from the root (a $ref back into the
        path ends it: recursion is fine when it produces JSON on the way)."""
        if not isinstance(self.root, dict):
            return None
        depth: dict[int, int] = {}  # id -> the longest path below it, itself included
        on_path: dict[int, int] = {}  # id -> index in frames
        # frames: [node, whether the edge into it produces JSON, its edges, its deepest child]
        frames: list[list] = []

        def enter(node: dict, produces: bool) -> Optional[str]:
            on_path[id(node)] = len(frames)
            frames.append([node, produces, self._edges(node), 0])
            if len(frames) > MAX_DEPTH:
                return (f"nests subschemas more than {MAX_DEPTH} deep, following $ref "
                        f"(at {self.where[id(node)]}; limit {MAX_DEPTH})")
            return None

        problem = enter(self.root, True)
        while frames and not problem:
            frame = frames[-1]
            for child, produces in frame[2]:
                if id(child) in depth:
                    frame[3] = max(frame[3], depth[id(child)])
                elif id(child) in on_path:  # a cycle: it must produce JSON somewhere on the way
                    start = on_path[id(child)]
                    if not produces and not any(f[1] for f in frames[start + 1:]):
                        loop = " -> ".join(self.where[id(f[0])] for f in frames[start:])
                        return f"$ref cycle {loop} -> {self.where[id(child)]} produces no JSON"
                else:
                    problem = enter(child, produces)
                    break
            else:  # every edge seen: leave the node
                node, _, _, deepest = frames.pop()
                del on_path[id(node)]
                depth[id(node)] = deepest + 1
                if deepest + 1 + len(frames) > MAX_DEPTH:
                    return (f"nests subschemas more than {MAX_DEPTH} deep, following $ref "
                            f"(at {self.where[id(node)]}; limit {MAX_DEPTH})")
                if frames:
                    frames[-1][3] = max(frames[-1][3], deepest + 1)
        return problem


def regex_size(regex: str) -> int:
    """An estimate of ``regex`` unrolled: a sequence adds, an alternation takes
    its largest branch, a counted repetition multiplies ('*', '+', '?' do not)."""
    stack: list[list[int]] = [[0, 0, 0]]  # per group: [largest branch, current branch, last atom]
    i, n = 0, len(regex)
    while i < n:
        ch = regex[i]
        top = stack[-1]
        if ch == "\\":
            top[1] += 1
            top[2] = 1
            i += 2
            continue
        if ch == "[":
            j = i + 1
            if j < n and regex[j] == "^":
                j += 1
            if j < n and regex[j] == "]":
                j += 1
            while j < n and regex[j] != "]":
                j += 2 if regex[j] == "\\" else 1
            top[1] += 1
            top[2] = 1
            i = j + 1
            continue
        if ch == "(":
            stack.append([0, 0, 0])
        elif ch == ")" and len(stack) > 1:
            group = stack.pop()
            size = max(group[0], group[1], 1)
            stack[-1][1] += size
            stack[-1][2] = size
        elif ch == "|":
            top[0] = max(top[0], top[1])
            top[1] = top[2] = 0
        elif ch == "{":
            m = _COUNTED.match(regex, i)
            if m and (m.group(1) or m.group(2)):
                count = max(int(m.group(1) or 0), int(m.group(2) or 0))
                top[1] += top[2] * (count - 1)
                top[2] *= count
                i = m.end()
                continue
            top[1] += 1
            top[2] = 1
        elif ch not in "*+?^$":
            top[1] += 1
            top[2] = 1
        i += 1
    while len(stack) > 1:  # unbalanced: the engine reports it
        group = stack.pop()
        stack[-1][1] += max(group[0], group[1])
    return max(stack[0][0], stack[0][1])
