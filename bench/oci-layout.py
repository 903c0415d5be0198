#!/usr/bin/env python3
"""Helpers for bench/make-image.sh (python3 stdlib only).

Subcommands:
  convert-whiteouts DIR [LOWERDIR...]
      Turn an overlayfs upper dir into an OCI layer dir, in place:
        char device 0/0 NAME         -> empty regular file .wh.NAME
        dir with trusted.overlay.opaque=y -> dir containing .wh..wh..opq
        all trusted.overlay.* xattrs are removed.
      If LOWERDIRs (the layer dirs below DIR) are given, opaque markers are
      only written for dirs that exist in some lower layer and whiteouts only
      for names that exist in some lower layer (overlayfs also marks some
      brand-new dirs opaque; a marker there would be a harmless no-op).
      Fails if a trusted.overlay.redirect / metacopy xattr is found (those
      cannot be expressed in an OCI layer; make-image.sh mounts overlayfs
      with redirect_dir=off,metacopy=off so they should never appear).

  write --out DIR --tag TAG [--cmd JSON] [--env K=V ...] LAYERDIR...
      Create an OCI image layout at DIR: every LAYERDIR becomes one
      application/vnd.oci.image.layer.v1.tar+gzip layer made with
      `tar --numeric-owner --xattrs -C LAYERDIR -cf - . | gzip -6`.
      Prints per-layer and total sizes.

  new-version --layout DIR --tag TAG --new-tag NEW --set PATH=TEXT [--set ...]
      Tag NEW in the layout at DIR: the image TAG with its top layer rewritten, each
      PATH (relative, e.g. app/version.txt) replaced by TEXT or added; the config's
      last diff_id and the manifest follow. The lower layers stay the same blobs, as
      they do when a new version of an application is built on the same base.
"""
import argparse
import datetime
import gzip
import io
import tarfile
import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys

OVL = "trusted.overlay."


def _listxattr(path):
    try:
        return os.listxattr(path, follow_symlinks=False)
    except OSError:
        return []


def convert_whiteouts(root, lowers=()):
    n_wh = n_opq = n_x = n_skip = 0

    def in_lower(path, want_dir):
        if not lowers:
            return True
        rel = os.path.relpath(path, root)
        for l in lowers:
            p = os.path.join(l, rel)
            if (os.path.isdir(p) and not os.path.islink(p)) if want_dir else os.path.lexists(p):
                return True
        return False

    for dirpath, dirnames, filenames in os.walk(root):
        # opaque directory marker
        for name in _listxattr(dirpath):
            if not name.startswith(OVL):
                continue
            if name in (OVL + "redirect", OVL + "metacopy"):
                sys.exit(f"convert-whiteouts: {dirpath}: unsupported xattr {name}")
            if name == OVL + "opaque":
                val = os.getxattr(dirpath, name, follow_symlinks=False)
                if val == b"y" and dirpath != root:
                    if in_lower(dirpath, True):
                        open(os.path.join(dirpath, ".wh..wh..opq"), "wb").close()
                        n_opq += 1
                    else:
                        n_skip += 1
            os.removexattr(dirpath, name, follow_symlinks=False)
            n_x += 1
        for name in list(filenames) + list(dirnames):
            p = os.path.join(dirpath, name)
            st = os.lstat(p)
            if stat.S_ISCHR(st.st_mode) and st.st_rdev == 0:
                os.unlink(p)
                if in_lower(p, False):
                    open(os.path.join(dirpath, ".wh." + name), "wb").close()
                    n_wh += 1
                else:
                    n_skip += 1
                continue
            if stat.S_ISDIR(st.st_mode):
                continue  # handled when os.walk visits it
            for xn in _listxattr(p):
                if xn.startswith(OVL):
                    if xn in (OVL + "redirect", OVL + "metacopy"):
                        sys.exit(f"convert-whiteouts: {p}: unsupported xattr {xn}")
                    try:
                        os.removexattr(p, xn, follow_symlinks=False)
                        n_x += 1
                    except OSError:
                        pass
    print(f"convert-whiteouts {root}: {n_wh} whiteouts, {n_opq} opaque dirs, "
          f"{n_x} overlay xattrs removed, {n_skip} markers without lower dropped")


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            b = f.read(1 << 20)
            if not b:
                break
            h.update(b)
    return h.hexdigest()


def put_blob(blobdir, data):
    d = hashlib.sha256(data).hexdigest()
    with open(os.path.join(blobdir, d), "wb") as f:
        f.write(data)
    return d, len(data)


def make_layer(layerdir, blobdir):
    """tar --numeric-owner --xattrs -C DIR -cf - . | gzip -6, hashing both."""
    tmp = os.path.join(blobdir, ".layer.tmp")
    with open(tmp, "wb") as out:
        tar = subprocess.Popen(
            ["tar", "--numeric-owner", "--xattrs", "--sort=name",
             "-C", layerdir, "-cf", "-", "."],
            stdout=subprocess.PIPE)
        gz = subprocess.Popen(["gzip", "-6", "-n"], stdin=subprocess.PIPE, stdout=out)
        h = hashlib.sha256()
        usize = 0
        while True:
            b = tar.stdout.read(1 << 20)
            if not b:
                break
            h.update(b)
            usize += len(b)
            gz.stdin.write(b)
        gz.stdin.close()
        if tar.wait() != 0 or gz.wait() != 0:
            sys.exit(f"tar/gzip failed for {layerdir}")
    digest = sha256_file(tmp)
    csize = os.path.getsize(tmp)
    os.replace(tmp, os.path.join(blobdir, digest))
    return {"diff_id": "sha256:" + h.hexdigest(), "digest": "sha256:" + digest,
            "usize": usize, "csize": csize}


def human(n):
    for u in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or u == "GiB":
            return f"{n:.1f} {u}" if u != "B" else f"{n} B"
        n /= 1024


def write_layout(args):
    out = args.out
    tmpout = out + ".tmp"
    shutil.rmtree(tmpout, ignore_errors=True)
    blobdir = os.path.join(tmpout, "blobs", "sha256")
    os.makedirs(blobdir)
    layers = []
    for i, d in enumerate(args.layers, 1):
        info = make_layer(d, blobdir)
        info["dir"] = d
        layers.append(info)
        print(f"  layer {i}: {os.path.basename(d.rstrip('/')):<16} "
              f"uncompressed {info['usize']:>12} ({human(info['usize'])})  "
              f"gzip {info['csize']:>12} ({human(info['csize'])})  {info['digest']}",
              flush=True)
    created = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    env = args.env or ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"]
    config = {
        "created": created,
        "architecture": "amd64",
        "os": "linux",
        "config": {"Env": env, "Cmd": json.loads(args.cmd), "WorkingDir": "/"},
        "rootfs": {"type": "layers", "diff_ids": [l["diff_id"] for l in layers]},
        "history": [{"created": created, "created_by": f"ferry make-image: {os.path.basename(l['dir'].rstrip('/'))}"}
                    for l in layers],
    }
    cfg_digest, cfg_size = put_blob(blobdir, json.dumps(config, indent=None, separators=(",", ":")).encode())
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                   "digest": "sha256:" + cfg_digest, "size": cfg_size},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip",
                    "digest": l["digest"], "size": l["csize"]} for l in layers],
    }
    man_digest, man_size = put_blob(blobdir, json.dumps(manifest, indent=None, separators=(",", ":")).encode())
    index = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [{"mediaType": "application/vnd.oci.image.manifest.v1+json",
                       "digest": "sha256:" + man_digest, "size": man_size,
                       "annotations": {"org.opencontainers.image.ref.name": args.tag}}],
    }
    with open(os.path.join(tmpout, "index.json"), "w") as f:
        json.dump(index, f)
    with open(os.path.join(tmpout, "oci-layout"), "w") as f:
        json.dump({"imageLayoutVersion": "1.0.0"}, f)
    tu = sum(l["usize"] for l in layers)
    tc = sum(l["csize"] for l in layers)
    summary = {"tag": args.tag, "manifest": "sha256:" + man_digest,
               "uncompressed_bytes": tu, "compressed_bytes": tc,
               "layers": [{k: l[k] for k in ("digest", "diff_id", "usize", "csize")}
                          | {"name": os.path.basename(l["dir"].rstrip("/"))} for l in layers]}
    with open(os.path.join(tmpout, "ferry-summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmpout, out)
    print(f"  total: {len(layers)} layers, uncompressed {tu} ({human(tu)}), "
          f"gzip {tc} ({human(tc)}), manifest sha256:{man_digest}")
    if args.min_bytes and tu < args.min_bytes:
        sys.exit(f"image is only {tu} bytes uncompressed, wanted >= {args.min_bytes}")


def new_version(args):
    d = args.layout

    def blob(dg):
        return os.path.join(d, "blobs", *dg.split(":"))

    def put(data):
        dg = "sha256:" + hashlib.sha256(data).hexdigest()
        with open(blob(dg), "wb") as f:
            f.write(data)
        return dg

    def load(dg):
        with open(blob(dg), "rb") as f:
            return f.read()

    sets = {}
    for s in args.set:
        path, sep, text = s.partition("=")
        if not sep or not path.lstrip("./"):
            sys.exit(f"--set takes PATH=TEXT, not {s!r}")
        sets[path.lstrip("./")] = text.encode()
    with open(os.path.join(d, "index.json")) as f:
        index = json.load(f)
    ref = "org.opencontainers.image.ref.name"
    desc = next((m for m in index["manifests"] if m.get("annotations", {}).get(ref) == args.tag), None)
    if desc is None:
        sys.exit(f"no tag {args.tag} in {d}")
    man = json.loads(load(desc["digest"]))
    cfg = json.loads(load(man["config"]["digest"]))
    top = man["layers"][-1]
    if not top["mediaType"].endswith("+gzip"):
        sys.exit(f"the top layer is {top['mediaType']}, not a gzip tar")
    src = tarfile.open(fileobj=io.BytesIO(gzip.decompress(load(top["digest"]))))
    out = io.BytesIO()
    dst = tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT)
    for m in src.getmembers():
        data = src.extractfile(m).read() if m.isfile() else None
        name = m.name.lstrip("./")
        if name in sets:
            data = sets.pop(name)
            m.size = len(data)
        dst.addfile(m, io.BytesIO(data) if data is not None else None)
    for name, data in sets.items():
        extra = tarfile.TarInfo(name)
        extra.size, extra.mode, extra.mtime = len(data), 0o644, int(datetime.datetime.now().timestamp())
        dst.addfile(extra, io.BytesIO(data))
    dst.close()
    raw = out.getvalue()
    gz = gzip.compress(raw, compresslevel=6, mtime=0)
    man["layers"][-1] = {"mediaType": top["mediaType"], "digest": put(gz), "size": len(gz)}
    cfg["rootfs"]["diff_ids"][-1] = "sha256:" + hashlib.sha256(raw).hexdigest()
    cb = json.dumps(cfg).encode()
    man["config"] = {"mediaType": man["config"]["mediaType"], "digest": put(cb), "size": len(cb)}
    mb = json.dumps(man).encode()
    index["manifests"] = [m for m in index["manifests"] if m.get("annotations", {}).get(ref) != args.new_tag]
    index["manifests"].append({"mediaType": desc["mediaType"], "digest": put(mb), "size": len(mb),
                               "annotations": {ref: args.new_tag}})
    with open(os.path.join(d, "index.json"), "w") as f:
        json.dump(index, f)


def main():
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd_name", required=True)
    c = sub.add_parser("convert-whiteouts")
    c.add_argument("dir")
    c.add_argument("lowers", nargs="*")
    w = sub.add_parser("write")
    w.add_argument("--out", required=True)
    w.add_argument("--tag", required=True)
    w.add_argument("--cmd", default='["/app/start.sh"]')
    w.add_argument("--env", action="append")
    w.add_argument("--min-bytes", type=int, default=0)
    w.add_argument("layers", nargs="+")
    n = sub.add_parser("new-version")
    n.add_argument("--layout", required=True)
    n.add_argument("--tag", required=True)
    n.add_argument("--new-tag", required=True)
    n.add_argument("--set", action="append", required=True)
    a = ap.parse_args()
    if a.cmd_name == "convert-whiteouts":
        convert_whiteouts(a.dir, a.lowers)
    elif a.cmd_name == "new-version":
        new_version(a)
    else:
        write_layout(a)


if __name__ == "__main__":
    main()
