//! Tar builders shared by the unpacker's tests: entries written with raw header fields,
//! so hostile names, links and sizes can be built that `tar::Builder` would refuse.
#![allow(dead_code, clippy::unwrap_used)]

/// A tar entry written with raw header fields (so hostile names can be built).
pub struct Raw<'a> {
    pub path: &'a str,
    pub kind: tar::EntryType,
    pub data: &'a [u8],
    pub link: Option<&'a str>,
    pub mode: u32,
    pub uid: u64,
    pub mtime: u64,
}

pub fn raw(path: &str, kind: tar::EntryType) -> Raw<'_> {
    Raw {
        path,
        kind,
        data: b"",
        link: None,
        mode: if kind == tar::EntryType::Directory {
            0o755
        } else {
            0o644
        },
        uid: 0,
        mtime: 1_600_000_000,
    }
}

pub fn tar_of(entries: &[Raw<'_>]) -> Vec<u8> {
    let mut out = Vec::new();
    for e in entries {
        let mut h = tar::Header::new_gnu();
        let name = &mut h.as_gnu_mut().unwrap().name;
        name[..e.path.len()].copy_from_slice(e.path.as_bytes());
        if let Some(link) = e.link {
            let field = &mut h.as_gnu_mut().unwrap().linkname;
            field[..link.len()].copy_from_slice(link.as_bytes());
        }
        h.set_entry_type(e.kind);
        h.set_size(e.data.len() as u64);
        h.set_mode(e.mode);
        h.set_uid(e.uid);
        h.set_gid(e.uid);
        h.set_mtime(e.mtime);
        h.set_device_major(0).unwrap();
        h.set_device_minor(0).unwrap();
        h.set_cksum();
        out.extend_from_slice(h.as_bytes());
        out.extend_from_slice(e.data);
        out.resize(out.len().div_ceil(512) * 512, 0);
    }
    out.resize(out.len() + 1024, 0);
    out
}

pub fn file<'a>(path: &'a str, data: &'a [u8]) -> Raw<'a> {
    Raw {
        data,
        ..raw(path, tar::EntryType::Regular)
    }
}
