"""What the lent GPU machine lacks for the GPU check, resolved by pip rather than listed by hand.

The machine's image (eval/gpu_image.txt: its packages as documented, versions where known) runs CPython 3.12 and
reaches no package index; what the check imports beyond it travels as wheels.

  resolve OUT   pip's own resolver, for CPython 3.12 on manylinux x86_64, over this package's dependencies, its
                `serve` extra and what the GPU suite imports besides (DEVICE_TESTS). An image package of a
                documented version is pinned to it where that version meets every requirement of the closure on
                it, and carried otherwise (sentence-transformers 6.0.1: we need >= 6.2). Writes OUT/manifest.txt
                (every package of the closure, its version and where it comes from) and downloads the carried
                wheels into OUT/wheels. Any failure stops it with a non-zero exit.
  check MANIFEST   on the device or its CPU twin: every package of the manifest is installed at its version (a
                package the documentation gives no version of: any version that meets the closure's
                requirements), and imports; `--freeze FILE` writes the interpreter's whole package list, which
                can replace eval/gpu_image.txt for the next resolve.

Where a package comes from, in the manifest: `image` (there at that version), `image?` (there, version not
documented: the twin holds the resolved one, `check` reads the device's), `carry` (a wheel in OUT/wheels), and
`shadowed` (the image's own version of a carried package, which the carried one comes before on sys.path).
"""

from __future__ import annotations

import argparse
import importlib
import json
import re
import subprocess
import sys
import tempfile
import warnings
from importlib import metadata
from pathlib import Path

import tomllib
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
PYTHON = "3.12"
# manylinux_2_5 to 2_39: the image's glibc is 2.39 (Ubuntu 24.04, whose Python is the image's 3.12.3).
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in range(5, 40)] + ["manylinux2014_x86_64", "manylinux1_x86_64"]
# What the GPU suite's modules import beyond the package and its serve extra (eval/gpu_check.sh runs them).
DEVICE_TESTS = ["pytest", "pyarrow", "openai", "cohere", "httpx"]
# Tied to the image's CUDA build of PyTorch: used as the image has them, never carried.
CUDA_BUILD = re.compile(r"^(torch|triton|nvidia-.*|cuda-.*)$")
# The markers of CPython 3.12 on Linux x86_64, to read which requirements apply there.
ENVIRONMENT = {
    "python_version": PYTHON, "python_full_version": "3.12.3", "implementation_name": "cpython",
    "platform_python_implementation": "CPython", "sys_platform": "linux", "platform_system": "Linux",
    "platform_machine": "x86_64", "os_name": "posix", "implementation_version": "3.12.3",
}  # fmt: skip


def name_of(text: str) -> str:
    return re.sub(r"[-_.]+", "-", text).lower()


def read_image(path: Path) -> dict[str, str | None]:
    """name -> documented version (None where the documentation gives none)."""
    image: dict[str, str | None] = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            image[name_of(name)] = version or None
    return image


def requirements() -> list[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return [*project["dependencies"], *project["optional-dependencies"]["serve"], *DEVICE_TESTS]


def pip(*args: str) -> None:
    """pip of this interpreter; its own output goes to the terminal, a failure ends the run."""
    command = [sys.executable, "-m", "pip", *args]
    if subprocess.run(command).returncode != 0:
        sys.exit(f"gpu_carry: failed: pip {' '.join(args[:3])} ...")


def target_options() -> list[str]:
    options = ["--only-binary=:all:", "--python-version", PYTHON, "--implementation", "cp", "--abi", "cp312"]
    return options + [option for platform in PLATFORMS for option in ("--platform", platform)]


def resolve_closure(wanted: list[str], pins: dict[str, str], work: Path) -> list[dict]:
    """pip's resolution for the device: the report's `install` list (metadata, requested extras)."""
    constraints = work / "pins.txt"
    constraints.write_text("".join(f"{name}=={version}\n" for name, version in sorted(pins.items())))
    report = work / "report.json"
    pip("install", "--quiet", "--dry-run", "--ignore-installed", "--target", str(work / "unused"),
        "--report", str(report), "-c", str(constraints), *target_options(), *wanted)  # fmt: skip
    return json.loads(report.read_text())["install"]


def demands(closure: list[dict], wanted: list[str]) -> dict[str, list[SpecifierSet]]:
    """name -> the version ranges the closure (and our own requirements) ask of it, on the device."""
    asked: dict[str, list[SpecifierSet]] = {}
    lines = [(line, "") for line in wanted]
    for item in closure:
        extras = item.get("requested_extras") or [""]
        lines += [(line, extra) for line in item["metadata"].get("requires_dist", []) for extra in extras]
    for line, extra in lines:
        requirement = Requirement(line)
        if requirement.marker is None or requirement.marker.evaluate({**ENVIRONMENT, "extra": extra}):
            asked.setdefault(name_of(requirement.name), []).append(requirement.specifier)
    return asked


def resolve(out: Path, image_file: Path) -> None:
    image = read_image(image_file)
    wanted = requirements()
    # Pinning one package (transformers to the image's) can let another keep the image's version (its
    # huggingface-hub): pins grow until no further image version meets what the closure asks.
    pins = {name: version for name, version in image.items() if version and CUDA_BUILD.match(name)}
    with tempfile.TemporaryDirectory() as scratch:
        while True:
            closure = resolve_closure(wanted, pins, Path(scratch))
            asked = demands(closure, wanted)
            names = [name_of(item["metadata"]["name"]) for item in closure]
            meets = {
                name: image[name]
                for name in names
                if image.get(name)
                and all(spec.contains(Version(image[name]), prereleases=True) for spec in asked.get(name, []))
            }
            if meets.keys() <= pins.keys():
                break
            pins |= meets
    unmet = {name: f"image {image[name]}, asked {', '.join(str(s) for s in asked[name] if str(s))}"
             for name in names if image.get(name) and name not in pins}  # fmt: skip
    rows = []
    for item in sorted(closure, key=lambda item: name_of(item["metadata"]["name"])):
        name, version = name_of(item["metadata"]["name"]), item["metadata"]["version"]
        if name in pins:
            source = "image"
        elif name in image and name not in unmet:
            source = "image?"
        else:
            source = "carry"
        if source == "carry" and CUDA_BUILD.match(name):
            sys.exit(f"gpu_carry: {name} {version} would be carried, but it is tied to the image's CUDA build")
        rows.append((name, version, source))
    out.mkdir(parents=True, exist_ok=True)
    rows += [(name, image[name], "shadowed") for name in sorted(unmet)]  # the image's, under the carried one
    lines = [f"{name}=={version}  # {source}" for name, version, source in rows]
    header = [f"# resolved by eval/gpu_carry.py for CPython {PYTHON} on manylinux x86_64 from {image_file.name}"]
    header += [f"# carried although in the image: {name} ({why})" for name, why in sorted(unmet.items())]
    (out / "manifest.txt").write_text("\n".join(header + lines) + "\n")
    carried = [f"{name}=={version}" for name, version, source in rows if source == "carry"]
    wheels = out / "wheels"
    for stale in wheels.glob("*.whl"):
        stale.unlink()
    pip("download", "--quiet", "--no-deps", *target_options(), "-d", str(wheels), *carried)
    print("\n".join(header[1:]))
    print(f"{len(rows) - len(unmet)} packages: {sum(s == 'image' for *_, s in rows)} image, "
          f"{sum(s == 'image?' for *_, s in rows)} image (version undocumented), {len(carried)} carried: "
          f"{' '.join(carried)}")  # fmt: skip


def read_manifest(path: Path) -> list[tuple[str, str, str]]:
    rows = []
    for line in path.read_text().splitlines():
        if line and not line.startswith("#"):
            pinned, _, source = line.partition("#")
            name, _, version = pinned.strip().partition("==")
            rows.append((name, version, source.strip()))
    return rows


def modules_of(dist: metadata.Distribution) -> list[str]:
    """The top-level modules a distribution installs (none for a stubs-only package such as types-requests)."""
    names = set()
    for file in dist.files or []:
        package = len(file.parts) > 1 and file.name == "__init__.py"
        if package or len(file.parts) == 1 and file.suffix in (".py", ".so"):
            names.add(file.parts[0].split(".")[0])
    return sorted(n for n in names if not n.startswith("_") and n not in ("tests", "test", "benchmarks", "docs"))


def check(manifest: Path, freeze: Path | None) -> int:
    """Problems found in this interpreter against the manifest, printed; the count is the exit status."""
    rows = read_manifest(manifest)
    installed = {name_of(d.metadata["Name"]): d for d in reversed(list(metadata.distributions()))}  # sys.path order
    problems = []
    rows = [row for row in rows if row[2] != "shadowed"]
    for name, version, source in rows:
        dist = installed.get(name)
        if dist is None:
            problems.append(f"{name}: missing ({source} {version})")
        elif source != "image?" and dist.version != version:
            problems.append(f"{name}: {dist.version} installed, the manifest says {version} ({source})")
    closure = {name for name, _, _ in rows}
    for name in sorted(closure & installed.keys()):
        for line in installed[name].requires or []:
            requirement = Requirement(line)
            if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
                continue
            other = installed.get(name_of(requirement.name))
            if other is not None and not requirement.specifier.contains(other.version, prereleases=True):
                problems.append(f"{name} asks {requirement}, {other.version} installed")
    for name, _, _ in rows:
        if name in installed and not CUDA_BUILD.match(name):
            for module in modules_of(installed[name]):
                try:
                    with warnings.catch_warnings():  # deprecation notices of what imports cleanly are not problems
                        warnings.simplefilter("ignore")
                        importlib.import_module(module)
                except Exception as error:  # any failure to import is what this check is for
                    problems.append(f"{name}: import {module} failed: {type(error).__name__}: {error}")
    if freeze is not None:
        listed = sorted(f"{name}=={d.version}" for name, d in installed.items())
        freeze.write_text("\n".join(listed) + "\n")
    print("\n".join(problems) or f"gpu_carry check: the {len(rows)} packages of {manifest} are all in place")
    return len(problems)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    verbs = parser.add_subparsers(dest="verb", required=True)
    resolving = verbs.add_parser("resolve")
    resolving.add_argument("out", type=Path)
    resolving.add_argument("--image", type=Path, default=ROOT / "eval" / "gpu_image.txt")
    checking = verbs.add_parser("check")
    checking.add_argument("manifest", type=Path)
    checking.add_argument("--freeze", type=Path)
    args = parser.parse_args()
    if args.verb == "resolve":
        resolve(args.out, args.image)
    else:
        sys.exit(min(check(args.manifest, args.freeze), 1))


if __name__ == "__main__":
    main()
