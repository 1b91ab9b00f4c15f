#!/usr/bin/env python3
"""Render deploy/helm/gpu-coloc without helm (helm is not in this machine's registries).

Implements exactly the Go-template subset the chart uses, with Helm's semantics:
  {{ .Values.a.b }}  {{ .Release.Name }}  {{ .Release.Namespace }}  {{ .Chart.AppVersion }}
  {{ X | quote }}    {{ toYaml X | nindent N }}    {{ .Files.Get "path" | nindent N }}
  {{ if X }} / {{ if not X }} / {{ else }} / {{ end }}      and the {{- / -}} trim markers.
Any other action is an error, so the chart cannot drift into syntax this renderer would
silently get wrong. `helm template` renders the same chart the same way.

usage: render-chart.py [-f values.yaml]... [--set key.path=value]... [--name N] [--namespace NS]
"""
import argparse, os, re, sys
import yaml

CHART = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "helm", "gpu-coloc")
ACTION = re.compile(r"\{\{(-?)\s*(.*?)\s*(-?)\}\}", re.S)


def merge(a, b):
    for k, v in b.items():
        if isinstance(v, dict) and isinstance(a.get(k), dict):
            merge(a[k], v)
        else:
            a[k] = v
    return a


def go_str(v):
    if isinstance(v, bool):
        return "true" if v else "false"
    if v is None:
        return ""
    return str(v)


def truthy(v):
    return not (v is None or v is False or v == 0 or v == "" or v == {} or v == [])


class Ctx:
    def __init__(self, values, name, ns, chart):
        self.root = {"Values": values, "Release": {"Name": name, "Namespace": ns},
                     "Chart": {"AppVersion": chart.get("appVersion"), "Name": chart.get("name")}}

    def path(self, p):
        if not p.startswith("."):
            raise ValueError(f"unsupported expression {p!r}")
        cur = self.root
        for part in p[1:].split("."):
            if not isinstance(cur, dict):
                return None
            cur = cur.get(part)
        return cur

    def value(self, expr):
        expr = expr.strip()
        m = re.fullmatch(r'\.Files\.Get\s+"([^"]+)"', expr)
        if m:
            with open(os.path.join(CHART, m.group(1))) as f:
                return f.read()
        m = re.fullmatch(r"toYaml\s+(\S+)", expr)
        if m:
            v = self.path(m.group(1))
            return yaml.safe_dump(v, default_flow_style=False, sort_keys=False).rstrip("\n") if v not in (None, {}, []) else ("{}" if isinstance(v, dict) else "[]")
        return self.path(expr)

    def eval(self, expr):
        parts = [p.strip() for p in expr.split("|")]
        v = self.value(parts[0])
        for f in parts[1:]:
            m = re.fullmatch(r"nindent\s+(\d+)", f)
            if f == "quote":
                v = '"' + go_str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'
            elif m:
                pad = " " * int(m.group(1))
                v = "\n" + "\n".join(pad + line if line else line for line in go_str(v).split("\n"))
            else:
                raise ValueError(f"unsupported function {f!r}")
        return go_str(v)


def render(text, ctx, source):
    out, pos = [], 0
    stack = []  # (emitting_before, condition_true, in_else)
    emitting = True
    tokens = []
    for m in ACTION.finditer(text):
        tokens.append(("text", text[pos:m.start()]))
        tokens.append(("action", m))
        pos = m.end()
    tokens.append(("text", text[pos:]))
    # Apply trim markers to neighbouring text.
    for i, (kind, tok) in enumerate(tokens):
        if kind != "action":
            continue
        if tok.group(1) == "-" and i > 0:
            tokens[i - 1] = ("text", tokens[i - 1][1].rstrip(" \t\n"))
        if tok.group(3) == "-" and i + 1 < len(tokens):
            tokens[i + 1] = ("text", tokens[i + 1][1].lstrip(" \t\n"))
    for kind, tok in tokens:
        if kind == "text":
            if emitting:
                out.append(tok)
            continue
        expr = tok.group(2)
        if expr.startswith("/*"):
            continue
        m = re.fullmatch(r"if\s+(not\s+)?(\S+)", expr)
        if m:
            cond = truthy(ctx.value(m.group(2)))
            if m.group(1):
                cond = not cond
            stack.append((emitting, cond))
            emitting = emitting and cond
        elif expr == "else":
            if not stack:
                raise ValueError(f"{source}: else without if")
            before, cond = stack[-1]
            emitting = before and not cond
        elif expr == "end":
            if not stack:
                raise ValueError(f"{source}: end without if")
            emitting, _ = stack.pop()
        elif emitting:
            out.append(ctx.eval(expr))
    if stack:
        raise ValueError(f"{source}: unclosed if")
    return "".join(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-f", "--values", action="append", default=[])
    ap.add_argument("--set", action="append", default=[])
    ap.add_argument("--name", default="gpu-coloc")
    ap.add_argument("--namespace", default="gpu-coloc")
    a = ap.parse_args()
    with open(os.path.join(CHART, "values.yaml")) as f:
        values = yaml.safe_load(f)
    for p in a.values:
        with open(p) as f:
            merge(values, yaml.safe_load(f) or {})
    for s in a.set:
        key, _, raw = s.partition("=")
        cur = values
        parts = key.split(".")
        for k in parts[:-1]:
            cur = cur.setdefault(k, {})
        cur[parts[-1]] = yaml.safe_load(raw)
    with open(os.path.join(CHART, "Chart.yaml")) as f:
        chart = yaml.safe_load(f)
    ctx = Ctx(values, a.name, a.namespace, chart)
    tdir = os.path.join(CHART, "templates")
    docs = []
    for name in sorted(os.listdir(tdir)):
        if not name.endswith(".yaml"):
            continue
        with open(os.path.join(tdir, name)) as f:
            text = render(f.read(), ctx, name)
        for doc in re.split(r"^---\s*$", text, flags=re.M):
            body = "\n".join(l for l in doc.strip("\n").split("\n"))
            if yaml.safe_load(body) is None:
                continue
            docs.append(f"# Source: gpu-coloc/templates/{name}\n{body.strip()}\n")
    sys.stdout.write("---\n".join(docs))


if __name__ == "__main__":
    main()
