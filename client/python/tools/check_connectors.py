"""make check-connectors: do the connectors match the pinned engines' interfaces?

Downloads the pinned vLLM and SGLang wheels once (pip download --no-deps, SHA-256 checked,
cached in ${KVPOOL_CACHE:-~/.cache/kvpool}/engines), reads the interface classes' source out of
the wheels (nothing is installed or imported), and compares them by parsing (ast) with the
connectors in kvpool.connectors:

- every abstract method of the engine's class must be defined by the connector;
- every method the connector defines that the engine's class also has must take the same
  parameters (names, order, kinds, which have defaults; annotations are not compared);
- the remaining engine methods are inherited from the engine's base class when the engine
  loads the connector (the connector subclasses it whenever the engine is importable);
- the connector is constructed the way the engine's loader calls it.

Exit status 0 when everything matches, 1 otherwise.
"""

from __future__ import annotations

import ast
import hashlib
import os
import subprocess
import sys
import zipfile
from typing import Dict, List, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
PACKAGE = os.path.join(HERE, "..", "kvpool", "connectors")

ENGINES = [
    {
        "name": "vLLM", "requirement": "vllm==0.33.0",
        "wheel": "vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl",
        "sha256": "4b6bdec4ab269990bf70d45a3c1e94c3760a27064513760193b26d6f0da883aa",
        "platform": ["manylinux_2_28_x86_64"], "python": "3.11",
        "interface": ("vllm/distributed/kv_transfer/kv_connector/v1/base.py",
                      "KVConnectorBase_V1"),
        "connector": ("vllm_connector.py", "KvpoolConnector"),
        # vllm/distributed/kv_transfer/kv_connector/factory.py: connector_cls(config, role,
        # kv_cache_config)
        "loader": ("vllm/distributed/kv_transfer/kv_connector/factory.py",
                   "connector_cls(config, role, kv_cache_config)", 3),
        "required": ["get_num_new_matched_tokens", "update_state_after_alloc",
                     "build_connector_meta", "request_finished", "register_kv_caches",
                     "start_load_kv", "wait_for_layer_load", "save_kv_layer", "wait_for_save",
                     "get_finished"],
    },
    {
        "name": "SGLang", "requirement": "sglang==0.5.23",
        "wheel": "sglang-0.5.23-cp311-cp311-manylinux_2_34_x86_64.whl",
        "sha256": "00b3cd5b265ac76c64185fbb6b95424f324ddd9f428d0306b77bc9db9d859937",
        "platform": ["manylinux_2_34_x86_64"], "python": "3.11",
        "interface": ("sglang/srt/mem_cache/hicache_storage.py", "HiCacheStorage"),
        "connector": ("sglang_hicache.py", "KvpoolHiCacheStorage"),
        # sglang/srt/mem_cache/storage/backend_factory.py, the "dynamic" backend
        "loader": ("sglang/srt/mem_cache/storage/backend_factory.py",
                   "backend_class(storage_config, kwargs)", 2),
        "required": ["batch_exists", "batch_get", "batch_set", "exists", "get", "set"],
    },
]


def fetch(engine: dict, cache: str) -> str:
    path = os.path.join(cache, engine["wheel"])
    if not os.path.exists(path) or sha256(path) != engine["sha256"]:
        print(f"check-connectors: downloading {engine['requirement']} into {cache}", flush=True)
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check",
               "--no-deps", "--only-binary=:all:", "--python-version", engine["python"],
               "-d", cache, engine["requirement"]]
        for p in engine["platform"]:
            cmd += ["--platform", p]
        subprocess.run(cmd, check=True)
    got = sha256(path)
    if got != engine["sha256"]:
        raise SystemExit(f"{path}: sha256 {got}, expected {engine['sha256']}")
    return path


def sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def params(fn: ast.FunctionDef) -> List[Tuple[str, str, bool]]:
    """(name, kind, has default) of every parameter, in order."""
    a = fn.args
    out = []
    positional = a.posonlyargs + a.args
    first_default = len(positional) - len(a.defaults)
    for i, p in enumerate(positional):
        out.append((p.arg, "positional", i >= first_default))
    if a.vararg:
        out.append((a.vararg.arg, "*args", False))
    for p, d in zip(a.kwonlyargs, a.kw_defaults):
        out.append((p.arg, "keyword-only", d is not None))
    if a.kwarg:
        out.append((a.kwarg.arg, "**kwargs", False))
    return out


def methods(source: str, cls: str) -> Dict[str, Tuple[List, bool]]:
    """name -> (parameters, abstract) of the methods defined in class `cls` of `source`."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            out = {}
            for f in node.body:
                if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    abstract = any(ast.unparse(d).endswith("abstractmethod")
                                   for d in f.decorator_list)
                    out[f.name] = (params(f), abstract)
            return out
    raise SystemExit(f"class {cls} not found")


def fmt(p: List[Tuple[str, str, bool]]) -> str:
    return ", ".join(("*" if k == "*args" else "**" if k == "**kwargs" else "") + n +
                     ("=..." if d else "") for n, k, d in p)


def check(engine: dict, wheel: str) -> bool:
    iface_path, iface_cls = engine["interface"]
    loader_path, loader_call, loader_args = engine["loader"]
    with zipfile.ZipFile(wheel) as z:
        iface = methods(z.read(iface_path).decode(), iface_cls)
        loader_src = z.read(loader_path).decode()
    conn_file, conn_cls = engine["connector"]
    with open(os.path.join(PACKAGE, conn_file)) as f:
        ours = methods(f.read(), conn_cls)
    ok = True
    print(f"\n{engine['name']} {engine['requirement'].split('==')[1]}: {iface_cls} "
          f"({iface_path}) vs kvpool.connectors.{conn_file[:-3]}.{conn_cls}")
    same, inherited = [], []
    for name, (p, abstract) in sorted(iface.items()):
        if name in ours:
            if ours[name][0] == p:
                same.append(name)
            else:
                ok = False
                print(f"  MISMATCH {name}({fmt(p)})  vs ours ({fmt(ours[name][0])})")
        elif abstract or name in engine["required"]:
            ok = False
            print(f"  MISSING  {name}({fmt(p)}){' [abstract]' if abstract else ''}")
        else:
            inherited.append(name)
    for name in engine["required"]:
        if name not in iface:
            ok = False
            print(f"  the engine has no method {name} any more")
    init_ok = "__init__" in ours and len(
        [x for x in ours["__init__"][0] if x[1] == "positional"]) - 1 >= loader_args and \
        all(x[2] for x in ours["__init__"][0][1 + loader_args:])
    found_call = loader_call in loader_src
    ok &= init_ok and found_call
    print(f"  same parameters ({len(same)}): {', '.join(same)}")
    print(f"  inherited from {iface_cls} ({len(inherited)}): {', '.join(inherited)}")
    print(f"  loader: {loader_call} in {loader_path}: "
          f"{'found' if found_call else 'NOT FOUND'}; __init__({fmt(ours['__init__'][0])}) "
          f"{'accepts it' if init_ok else 'DOES NOT accept it'}")
    print(f"  {'OK' if ok else 'FAILED'}: {len(iface)} engine methods, "
          f"{sum(1 for _, a in iface.values() if a)} abstract")
    return ok


def main() -> int:
    cache = os.path.join(os.environ.get("KVPOOL_CACHE",
                                        os.path.join(os.path.expanduser("~"), ".cache",
                                                     "kvpool")), "engines")
    os.makedirs(cache, exist_ok=True)
    results = [check(e, fetch(e, cache)) for e in ENGINES]
    print("\ncheck-connectors:", "all interfaces match" if all(results) else "MISMATCHES")
    return 0 if all(results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
