"""A bundle of Debian packages carried to a head without internet (`debs export FILE`, `debs import FILE`): one
tar file, its manifest.json first (every .deb's sha256 and size), then the .deb files, flat. The import reads
only those names, regular files of the listed size, into a staging folder; every sha256 must match before the
bundle replaces the head's (one rename), so a mismatch leaves the head as it was."""
from __future__ import annotations

import io
import shutil
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from cluster.bounds import FileRefused, open_regular
from cluster.errors import ClusterError, UsageError
from cluster.paths import write_atomic
from cluster.provision.wheelhouse import sha256_file
from cluster.provision.wheelhouse_export import CHUNK
from cluster.room.debs import MANIFEST, Bundle, bundle_dir, bundles, debs_root, load, parse_manifest, put_in_place

Progress = Callable[[int, int], None]  # (bytes done, bytes in all)
MANIFEST_MAX = 4 << 20
EXPORT_AGAIN = "export it again on the machine that built it (clusterctl debs export FILE), copy it again, import"


def choose(release: str | None) -> Bundle:
    """The bundle `release` (codename-arch) names, or the head's only one."""
    have = bundles()
    if release is not None:
        found = [b for b in have if b.name == release]
        if not found:
            raise ClusterError(f"no complete bundle {release} in {debs_root()}",
                               "clusterctl debs list shows what there is; clusterctl debs build makes one")
        return found[0]
    if len(have) != 1:
        raise UsageError(f"{debs_root()} holds {len(have)} bundles: say which ({', '.join(b.name for b in have)})"
                         if have else f"no bundle in {debs_root()}",
                         "--release CODENAME-ARCH" if have else "clusterctl debs build (on a connected machine)")
    return have[0]


def export(bundle: Bundle, dest: Path, progress: Progress | None = None) -> dict[str, Any]:
    """The bundle as one tar file at `dest` (written aside, then renamed: a cut export leaves no file), each
    .deb's sha256 checked against the manifest first: a damaged bundle is refused, naming the file."""
    src = bundle_dir(bundle.codename, bundle.arch)
    if dest.is_dir():
        dest = dest / f"clusterctl-debs-{bundle.name}.tar"
    for d in bundle.debs:
        if sha256_file(src / d["file"]) != d["sha256"]:
            raise ClusterError(f"{src / d['file']} does not match its sha256 in {src / MANIFEST}: the bundle is "
                               "damaged", "build it again: clusterctl debs build")
    part = dest.with_name(f".{dest.name}.part")
    total, done = bundle.bytes, 0
    try:
        with tarfile.open(part, "w", format=tarfile.PAX_FORMAT) as tar:
            manifest = (src / MANIFEST).read_bytes()
            tar.addfile(_info(MANIFEST, len(manifest)), io.BytesIO(manifest))
            for d in bundle.debs:
                with open(src / d["file"], "rb") as f:
                    tar.addfile(_info(d["file"], d["size"]), f)
                done += d["size"]
                if progress:
                    progress(done, total)
        part.replace(dest)
    except OSError as e:
        part.unlink(missing_ok=True)
        raise ClusterError(f"cannot write {dest}: {e.strerror or e}",
                           "check that the disk is mounted writable and has room, then export again") from None
    return {**bundle.summary(), "file": str(dest), "tar_bytes": dest.stat().st_size}


def _info(name: str, size: int) -> tarfile.TarInfo:
    """A plain member: no owner, no link, one mtime, so two exports of one bundle differ only in time."""
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = size, 0o644, int(time.time())
    return info


class ImportRefusedDebs(ClusterError):
    """Files of the tar do not match its manifest: nothing was imported; every mismatch is named."""

    def __init__(self, src: Path, mismatches: list[str]) -> None:
        shown = "; ".join(mismatches[:10]) + (f"; and {len(mismatches) - 10} more" if len(mismatches) > 10 else "")
        super().__init__(f"{src}: {len(mismatches)} file(s) do not match the bundle's manifest, nothing was "
                         f"imported: {shown}", EXPORT_AGAIN)
        self.mismatches = mismatches


def import_file(src: Path, progress: Progress | None = None) -> tuple[Bundle, str]:
    """The exported tar into the head's bundle for its release: (bundle, imported | replaced | present). Only
    the manifest and the files it lists are read, each a regular member at its listed size, written under a
    staging folder by its checked name (never a path from the tar); all sha256s match, or nothing changes."""
    fix = "give the file `clusterctl debs export FILE` wrote"
    try:
        with open_regular(src, fix, None, "an exported bundle") as f, tarfile.open(fileobj=f, mode="r|") as tar:
            return _import(src, tar, progress)
    except FileNotFoundError:
        raise UsageError(f"{src}: no such file", fix) from None
    except FileRefused:
        raise
    except (tarfile.TarError, EOFError) as e:
        raise UsageError(f"{src}: not a tar file `clusterctl debs export` wrote ({e})", EXPORT_AGAIN) from None
    except OSError as e:
        raise ClusterError(f"import of {src} failed: {e.strerror or e} ({e.filename or src})",
                           "check the disk and the head's CLUSTERCTL_HOME, then import again") from None


def _import(src: Path, tar: tarfile.TarFile, progress: Progress | None) -> tuple[Bundle, str]:
    first = tar.next()
    if first is None or first.name != MANIFEST or not first.isreg() or first.size > MANIFEST_MAX:
        raise UsageError(f"{src}: its first member is not the bundle's {MANIFEST}", EXPORT_AGAIN)
    reader = tar.extractfile(first)
    assert reader is not None
    raw = reader.read()
    bundle = parse_manifest(raw, f"{src}:{MANIFEST}")
    listed = {d["file"]: d for d in bundle.debs}
    root = debs_root()
    root.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=".import-", dir=root))
    mismatches: list[str] = []
    seen: set[str] = set()
    done, total = 0, bundle.bytes
    try:
        write_atomic(stage / MANIFEST, raw.decode())
        while (m := tar.next()) is not None:  # a streamed tar: each member once, in order
            d = listed.get(m.name)
            if d is None or m.name in seen:
                mismatches.append(f"{m.name!r}: " + ("listed twice" if d else "not in the manifest"))
                continue
            seen.add(m.name)
            if not m.isreg() or m.size != d["size"]:
                mismatches.append(f"{m.name}: " + ("not a regular file" if not m.isreg() else
                                                   f"{m.size} bytes, the manifest says {d['size']}"))
                continue
            data = tar.extractfile(m)
            assert data is not None
            with open(stage / d["file"], "wb") as out:  # the manifest's checked name, never the member's path
                shutil.copyfileobj(data, out, CHUNK)
            if sha256_file(stage / d["file"]) != d["sha256"]:
                mismatches.append(f"{m.name}: does not match its sha256 in the manifest")
            done += m.size
            if progress:
                progress(done, total)
        mismatches += [f"{f}: missing" for f in listed if f not in seen]
        if mismatches:
            raise ImportRefusedDebs(src, mismatches)
        target = bundle_dir(bundle.codename, bundle.arch)
        have = load(bundle.codename, bundle.arch)
        status = "present" if have is not None and have.debs == bundle.debs else \
            "replaced" if target.exists() else "imported"
        if status != "present":
            put_in_place(stage, target)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return bundle, status

