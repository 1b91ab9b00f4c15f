#!/usr/bin/env python3
"""The Helm chart rendered by the real Helm engine (Helm's Go SDK, embedded by PyPI's
helm-python-sdk: no helm binary), as `helm template` would.

    python3 deploy/scripts/chart.py [--name N] [--namespace NS] [--set k=v ...] [--hooks all|none|only]

prints the manifests (hooks included unless --hooks none; NOTES.txt left out), one
document per object.
"""
import argparse, os, re, sys

HERE = os.path.dirname(os.path.abspath(__file__))
CHART = os.path.join(os.path.dirname(HERE), "helm", "gpu-coloc")
HELM_SDK = "helm-python-sdk==0.2.2"


def helm():
    try:
        import helm_python
    except ImportError:
        raise SystemExit(f"helm-python-sdk is needed: python3 -m pip install {HELM_SDK}")
    return helm_python


def values(sets=()):
    """`--set` expressions, merged as Helm merges them."""
    h = helm()
    merged = {}
    for s in sets:
        merge(merged, h.parse_set_string(s))
    return merged


def merge(into, new):
    for k, v in new.items():
        if isinstance(v, dict) and isinstance(into.get(k), dict):
            merge(into[k], v)
        else:
            into[k] = v
    return into


HOOK_ANNOTATION = re.compile(r"^[ \t]+helm\.sh/hook[a-z-]*:.*\n", re.M)


def is_hook(doc):
    import yaml
    obj = yaml.safe_load(doc) or {}
    return "helm.sh/hook" in ((obj.get("metadata") or {}).get("annotations") or {})


def plain(doc):
    """A hook object as a plain one: its helm.sh/hook* annotations removed."""
    doc = HOOK_ANNOTATION.sub("", doc + "\n")
    return re.sub(r"^([ ]+)annotations:\n(?!\1[ ])", "", doc, flags=re.M).rstrip("\n")


def render(vals=None, name="gpu-coloc", namespace="gpu-coloc", notes=False, hooks="all"):
    """Rendered manifests as one YAML stream, in template order; raises on a schema or
    template error. With notes=True, returns (stream, NOTES.txt). hooks: "all", "none"
    (the release's own objects), or "only" (the hook objects, as plain objects)."""
    h = helm()
    with h.Chart.load(CHART) as chart:
        out = chart.render(values=vals or {}, name=name, namespace=namespace, is_install=True)
    docs = []
    for path in sorted(out):
        if path.endswith("NOTES.txt"):
            continue
        body = out[path].strip("\n")
        if hooks != "all":
            parts = [d.strip("\n") for d in re.split(r"^---\n", body, flags=re.M)]
            keep = [d for d in parts if d.strip() and d.strip().startswith(("#", "apiVersion")) and is_hook(d) == (hooks == "only")]
            body = "\n---\n".join(plain(d) if hooks == "only" else d for d in keep)
        if body.strip():
            docs.append(f"# Source: {path}\n{body}")
    stream = "---\n" + "\n---\n".join(docs) + "\n"
    if notes:
        return stream, next((v for k, v in out.items() if k.endswith("NOTES.txt")), "")
    return stream


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--name", default="gpu-coloc")
    ap.add_argument("--namespace", default="gpu-coloc")
    ap.add_argument("--set", action="append", default=[])
    ap.add_argument("--hooks", choices=("all", "none", "only"), default="all",
                    help="all objects, the release's own (none), or the hook objects alone, as plain objects (only)")
    a = ap.parse_args()
    sys.stdout.write(render(values(a.set), a.name, a.namespace, hooks=a.hooks))


if __name__ == "__main__":
    main()
