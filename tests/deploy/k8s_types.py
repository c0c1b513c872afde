"""Strict JSON Schemas for Kubernetes objects, built from the npm package kubernetes-types.

kubernetes-types (pinned in schemas/package-lock.json) holds the Kubernetes API types of one
release (1.30) as TypeScript declarations generated from that release's OpenAPI document:
one `export interface` per definition, a field `name?: T` optional and `name: T` required,
`apiVersion?: "apps/v1"` and `kind?: "DaemonSet"` on the top-level kinds. No package on the
npm registry ships the Kubernetes JSON Schemas themselves for a recent release, so this module
translates those declarations into JSON Schema (draft 7) definitions:

  * an interface with fields is an object whose properties are exactly its fields:
    `additionalProperties: false` (a misspelt or misplaced field is an error, as with
    `kubectl --validate=strict`), its non-optional fields `required`;
  * an interface without fields (RawExtension, FieldsV1, JSON: free-form by design) and the
    map type `{[name: string]: T}` are objects of any keys;
  * `string`, `number`, `boolean`, string literals, `Array<T>`/`T[]`, unions and references
    to other declarations (across files, through the `import` lines) map one to one;
  * Quantity is declared `string`, but the API server also takes a plain number there
    (`cpu: 2`), so it is a string or a number.

The grammar read is the small subset those generated files use; anything else raises
TypesError naming the file, so a new release with new syntax fails loudly instead of
validating less. Standard library only.
"""

import os
import re

# The declarations the API server reads more loosely than the types say (see above).
LOOSER = {
    "api.resource.Quantity": {"anyOf": [{"type": "string"}, {"type": "number"}]},
}


class TypesError(Exception):
    pass


TOKEN = re.compile(r"""
    (?P<space>\s+)
  | (?P<string>"(?:[^"\\]|\\.)*")
  | (?P<ident>[A-Za-z_$][A-Za-z0-9_$]*)
  | (?P<number>-?[0-9]+(?:\.[0-9]+)?)
  | (?P<punct>[{}\[\]<>();:,?|=.*])
""", re.VERBOSE)
COMMENT = re.compile(r"/\*.*?\*/|//[^\n]*", re.DOTALL)


def _tokens(text, path):
    text = COMMENT.sub(" ", text)
    out = []
    pos = 0
    while pos < len(text):
        m = TOKEN.match(text, pos)
        if not m:
            raise TypesError("%s: cannot read %r" % (path, text[pos:pos + 40]))
        pos = m.end()
        if m.lastgroup != "space":
            out.append((m.lastgroup, m.group(0)))
    return out


class _Parser:
    def __init__(self, tokens, path):
        self.t = tokens
        self.i = 0
        self.path = path

    def peek(self, k=0):
        return self.t[self.i + k] if self.i + k < len(self.t) else (None, None)

    def take(self, value=None):
        kind, text = self.peek()
        if kind is None or (value is not None and text != value):
            raise TypesError("%s: expected %r, found %r (token %d)" % (self.path, value, text,
                                                                      self.i))
        self.i += 1
        return text

    def at(self, value):
        return self.peek()[1] == value

    # type := primary ('|' primary)*
    def type_expr(self):
        options = [self.primary()]
        while self.at("|"):
            self.take("|")
            options.append(self.primary())
        return options[0] if len(options) == 1 else ("union", options)

    def primary(self):
        kind, text = self.peek()
        if kind == "string":
            self.take()
            node = ("literal", text[1:-1])
        elif text == "{":
            # {[name: string]: T;}
            self.take("{")
            self.take("[")
            self.take()
            self.take(":")
            self.take("string")
            self.take("]")
            self.take(":")
            value = self.type_expr()
            if self.at(";"):
                self.take(";")
            self.take("}")
            node = ("map", value)
        elif text == "(":
            self.take("(")
            node = self.type_expr()
            self.take(")")
        elif kind == "ident":
            self.take()
            if text in ("string", "number", "boolean"):
                node = ("prim", text)
            elif text == "Array":
                self.take("<")
                node = ("array", self.type_expr())
                self.take(">")
            else:
                node = ("ref", text)
        else:
            raise TypesError("%s: unexpected %r in a type" % (self.path, text))
        while self.at("[") and self.peek(1)[1] == "]":
            self.take("[")
            self.take("]")
            node = ("array", node)
        return node

    def interface_body(self):
        fields = []
        self.take("{")
        while not self.at("}"):
            if self.at("readonly") and self.peek(1)[1] not in (":", "?"):
                self.take("readonly")  # read-only fields (set by the server) are fields too
            kind, name = self.peek()
            if kind not in ("ident", "string"):
                raise TypesError("%s: unexpected %r in an interface" % (self.path, name))
            self.take()
            if kind == "string":
                name = name[1:-1]
            optional = self.at("?")
            if optional:
                self.take("?")
            self.take(":")
            fields.append((name, optional, self.type_expr()))
            self.take(";")
        self.take("}")
        return fields


def _parse_module(text, path):
    """(imports {name: module-relative-spec}, declarations {name: node})."""
    p = _Parser(_tokens(text, path), path)
    imports, decls = {}, {}
    while p.peek()[0] is not None:
        word = p.take()
        if word == "import":
            p.take("{")
            names = []
            while not p.at("}"):
                names.append(p.take())
                if p.at(","):
                    p.take(",")
            p.take("}")
            p.take("from")
            spec = p.take()[1:-1]
            if p.at(";"):
                p.take(";")
            for n in names:
                imports[n] = spec
        elif word == "export":
            what = p.take()
            name = p.take()
            if what == "interface":
                decls[name] = ("interface", p.interface_body())
            elif what == "type":
                p.take("=")
                decls[name] = p.type_expr()
                p.take(";")
            else:
                raise TypesError("%s: unexpected export %s" % (path, what))
        else:
            raise TypesError("%s: unexpected %r at top level" % (path, word))
    return imports, decls


_LOADED = {}


def load(package_dir):
    """Reads every .d.ts of the kubernetes-types package at `package_dir` (once a process)."""
    key = os.path.realpath(package_dir)
    if key not in _LOADED:
        _LOADED[key] = _load(package_dir)
    return _LOADED[key]


def _load(package_dir):
    """Reads every .d.ts of the kubernetes-types package at `package_dir`.

    Returns (definitions, kinds): `definitions` maps "apps.v1.DaemonSet" to its JSON Schema,
    whose references point into the same map as "#/definitions/<key>"; `kinds` maps
    (apiVersion, kind) to the key of each top-level kind.
    """
    modules = {}
    for dirpath, dirnames, files in os.walk(package_dir):
        dirnames[:] = [d for d in dirnames if d != "node_modules"]
        for f in files:
            if f.endswith(".d.ts") and f != "index.d.ts":
                full = os.path.join(dirpath, f)
                rel = os.path.relpath(full, package_dir)[:-len(".d.ts")].replace(os.sep, "/")
                with open(full, encoding="utf-8") as fh:
                    modules[rel] = _parse_module(fh.read(), full)
    if not modules:
        raise TypesError("%s: no .d.ts files" % package_dir)

    def key(module, name):
        return module.replace("/", ".") + "." + name

    def resolve(module, name):
        imports, decls = modules[module]
        if name in decls:
            return key(module, name)
        if name in imports:
            target = os.path.normpath(os.path.join(os.path.dirname(module),
                                                   imports[name])).replace(os.sep, "/")
            if target not in modules:
                raise TypesError("%s: import of %s from missing %s" % (module, name, target))
            return resolve(target, name)
        raise TypesError("%s: unknown type %s" % (module, name))

    def schema(module, node):
        tag = node[0]
        if tag == "prim":
            return {"type": node[1]}
        if tag == "literal":
            return {"enum": [node[1]]}
        if tag == "array":
            return {"type": "array", "items": schema(module, node[1])}
        if tag == "map":
            return {"type": "object", "additionalProperties": schema(module, node[1])}
        if tag == "union":
            return {"anyOf": [schema(module, n) for n in node[1]]}
        if tag == "ref":
            return {"$ref": "#/definitions/" + resolve(module, node[1])}
        if tag == "interface":
            fields = node[1]
            if not fields:
                return {"type": "object"}
            out = {"type": "object", "additionalProperties": False,
                   "properties": {n: schema(module, t) for n, _, t in fields}}
            required = [n for n, optional, _ in fields if not optional]
            if required:
                out["required"] = required
            return out
        raise TypesError("%s: unknown node %r" % (module, tag))

    definitions, kinds = {}, {}
    for module, (_, decls) in sorted(modules.items()):
        for name, node in decls.items():
            k = key(module, name)
            definitions[k] = LOOSER.get(k) or schema(module, node)
            if node[0] == "interface":
                types = {n: t for n, _, t in node[1]}
                api, kind = types.get("apiVersion"), types.get("kind")
                if api and kind and api[0] == "literal" and kind[0] == "literal":
                    kinds[(api[1], kind[1])] = k
    return definitions, kinds


def kind_schema(definitions, key):
    """A standalone schema for the kind `key`, apiVersion and kind required."""
    return {
        "$schema": "http://json-schema.org/draft-07/schema#",
        "allOf": [{"$ref": "#/definitions/" + key}, {"required": ["apiVersion", "kind"]}],
        "definitions": definitions,
    }
