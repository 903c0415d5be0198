//! Node state is root's (or the daemon user's) alone: the chunk store and the file cache
//! hold decompressed bytes of files that may be 0600 inside their image, so their
//! directories are 0700 and their files 0600, whatever the umask, and a store made
//! before this rule is tightened when it is opened.

use std::fs;
use std::io;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::Path;

/// Mode of every node-state directory.
pub const PRIVATE_DIR_MODE: u32 = 0o700;
/// Mode of every node-state file.
pub const PRIVATE_FILE_MODE: u32 = 0o600;

/// Creates `dir` (and missing parents, 0700 too) and makes it 0700 if it existed with
/// group or other bits. A shared sticky directory (`/tmp`) is refused, never made
/// private: node state needs a directory of its own.
pub fn private_dir(dir: &Path) -> io::Result<()> {
    fs::DirBuilder::new()
        .recursive(true)
        .mode(PRIVATE_DIR_MODE)
        .create(dir)?;
    if fs::metadata(dir)?.permissions().mode() & 0o1000 != 0 {
        return Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!(
                "{} is a shared (sticky) directory; give ferry's state a directory of its own",
                dir.display()
            ),
        ));
    }
    tighten(dir, PRIVATE_DIR_MODE)
}

/// Makes `path` `mode` when it grants anything to group or others (a file or directory
/// made before node state was private); leaves a stricter mode alone.
pub fn tighten(path: &Path, mode: u32) -> io::Result<()> {
    let current = fs::symlink_metadata(path)?.permissions().mode();
    if current & 0o077 != 0 {
        fs::set_permissions(path, fs::Permissions::from_mode(mode))?;
    }
    Ok(())
}

/// Options that create a new file 0600 (`create_new`, write).
pub fn new_private_file() -> fs::OpenOptions {
    let mut o = fs::OpenOptions::new();
    o.write(true).create_new(true).mode(PRIVATE_FILE_MODE);
    o
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn mode(p: &Path) -> u32 {
        fs::metadata(p).unwrap().permissions().mode() & 0o7777
    }

    #[test]
    fn dirs_and_files_are_owner_only_and_old_ones_are_tightened() {
        let t = tempfile::tempdir().unwrap();
        let nested = t.path().join("a/b");
        private_dir(&nested).unwrap();
        assert_eq!(mode(&nested), 0o700);
        assert_eq!(mode(&t.path().join("a")), 0o700, "created parents too");
        let open = t.path().join("open");
        fs::create_dir(&open).unwrap();
        fs::set_permissions(&open, fs::Permissions::from_mode(0o755)).unwrap();
        private_dir(&open).unwrap();
        assert_eq!(mode(&open), 0o700);
        let f = open.join("f");
        new_private_file().open(&f).unwrap();
        assert_eq!(mode(&f), 0o600);
        fs::set_permissions(&f, fs::Permissions::from_mode(0o644)).unwrap();
        tighten(&f, PRIVATE_FILE_MODE).unwrap();
        assert_eq!(mode(&f), 0o600);
        // A shared sticky directory is refused, not locked.
        let shared = t.path().join("shared");
        fs::create_dir(&shared).unwrap();
        fs::set_permissions(&shared, fs::Permissions::from_mode(0o1777)).unwrap();
        assert!(private_dir(&shared).is_err());
        assert_eq!(mode(&shared), 0o1777);
        // Stricter than asked is left alone.
        fs::set_permissions(&f, fs::Permissions::from_mode(0o400)).unwrap();
        tighten(&f, PRIVATE_FILE_MODE).unwrap();
        assert_eq!(mode(&f), 0o400);
    }
}
