"""A NIXL for the lent GPU machine small enough to carry (a script, not a test).

The nixl-cu13 wheel for Python 3.12 is 59 MB, most of the 64 MiB a device call carries; most of
it is backends a disaggregated `tandem up` on one host never loads (storage plugins, GPUNETIO,
libfabric, the expert-parallel extension, UCX's perftest). This keeps the package, the UCX plugin
and the shared libraries that those link (closure of ELF NEEDED entries, plus UCX's transport
modules, which UCX opens itself), and packs the tree as tar.xz (~10 MB). On the device:

    tar -xJf .gpu-wheels/nixl/nixl_cu13-slim.tar.xz -C /tmp/site    # next to the meta package

    python3 benchmarks/gpu_nixl_slim.py WHEEL OUT.tar.xz
"""
from __future__ import annotations

import pathlib
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile

KEEP_PLUGIN = "libplugin_UCX.so"


def needed(path: pathlib.Path) -> list[str]:
    """The shared libraries `path` names in its dynamic section."""
    out = subprocess.run(["readelf", "-d", str(path)], capture_output=True, text=True,
                         check=True).stdout
    return re.findall(r"\(NEEDED\).*\[(.+)\]", out)


def slim(root: pathlib.Path) -> list[str]:
    """Removes from the unpacked wheel at `root` what the UCX backend does not use; returns
    the bundled libraries kept."""
    pkg = next(p.parent.name for p in root.glob("nixl_cu*/_bindings*.so"))
    libs, meson = root / f"{pkg}.libs", root / f".{pkg}.mesonpy.libs"
    for extra in root.glob("nixl_ep*"):
        shutil.rmtree(extra) if extra.is_dir() else extra.unlink()
    plugins = [d for d in (meson / "plugins", libs / "nixl") if d.is_dir()]
    for folder in plugins:
        for f in folder.iterdir():
            if f.name != KEEP_PLUGIN:
                f.unlink()
    for f in (libs / "ucx").glob("*perftest*"):
        f.unlink()
    bundled = {f.name: f for d in (libs, meson) for f in d.iterdir() if f.is_file()}
    todo = [*root.glob(f"{pkg}/*.so"), *(f for d in plugins for f in d.iterdir()),
            *(libs / "ucx").glob("*.so*")]
    keep: set[str] = set()
    while todo:
        for name in needed(todo.pop()):
            if name in bundled and name not in keep:
                keep.add(name)
                todo.append(bundled[name])
    for name, f in bundled.items():
        if name not in keep:
            f.unlink()
    return sorted(keep)


def main() -> None:
    wheel, out = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
    with tempfile.TemporaryDirectory() as tmp:
        root = pathlib.Path(tmp)
        zipfile.ZipFile(wheel).extractall(root)
        for f in root.rglob("*.so*"):  # zipfile drops the mode bits
            f.chmod(0o755)
        kept = slim(root)
        with tarfile.open(out, "w:xz") as tar:
            for entry in sorted(root.iterdir()):
                tar.add(entry, arcname=entry.name)
    print(f"{out}: {out.stat().st_size / 2**20:.1f} MiB, {len(kept)} bundled libraries kept")


if __name__ == "__main__":
    main()
